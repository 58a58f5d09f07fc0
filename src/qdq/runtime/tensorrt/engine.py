"""TensorRT engines: a strongly typed engine built from a Q/DQ ONNX graph (:func:`build_engine`), run on a CUDA GPU
(:class:`TensorRtRuntime`).

Strong typing makes every tensor keep the type the graph gives it: the Q/DQ nodes alone decide where int8
is used and the ONNX types decide where FP16/BF16 is (:mod:`qdq.targets.tensorrt.float_types` writes such a graph), with
no builder precision flags and no calibrator. TensorRT 11 removed weak typing (``BuilderFlag.FP16/INT8``,
``int8_calibrator``; the ``STRONGLY_TYPED`` network flag is deprecated and ignored there); TensorRT 10 builds
strongly typed when asked with that flag, which qdq does. Older TensorRT is refused with an install hint.

Before building, the graph goes through TensorRT's rule check (:func:`check_rules`: the ``rule_check`` of the target
made for TensorRT, :func:`qdq.targets.tensorrt.check.check_tensorrt`): a graph TensorRT would reject or run in
float (ORT's uint8 Q/DQ, a Cast between a DQ and its conv...) fails early with the broken rules named
(``check=False`` builds anyway).

Buffers are torch CUDA tensors, so no pycuda is needed. ``tensorrt`` and ``torch`` are imported when
an engine is built; without ``tensorrt`` or without a CUDA GPU, ``load`` raises
:class:`~qdq.errors.QdqBackendUnavailable`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqBackendUnavailable, QdqConfigError, QdqError
from qdq.runtime.base import Inputs, Runtime, check_common_options, import_backend
from qdq.runtime.model_info import ModelInfo, read_model_info
from qdq.runtime.target_check import target_advice
from qdq.runtime_registry import TENSORRT_RUNTIME
from qdq.targets.registry import native_fact

if TYPE_CHECKING:
    import tensorrt
    import torch

__all__ = ["TensorRtRuntime", "build_engine", "check_rules", "network_flags", "rule_check", "tensorrt_version"]

_INSTALL = "pip install tensorrt  (or: pip install 'qdq[tensorrt]')"
_MIN_MAJOR = 10  # strongly typed networks from Q/DQ ONNX graphs


def _trt() -> Any:
    return import_backend("tensorrt", _INSTALL)


def _cuda_torch() -> Any:
    torch = import_backend("torch", "pip install torch")
    if not torch.cuda.is_available():
        raise QdqBackendUnavailable("the tensorrt runtime needs a CUDA GPU, and torch sees none")
    return torch


def tensorrt_version(trt: Any) -> tuple[int, int]:
    """``(major, minor)`` of an imported ``tensorrt`` module (``"10.12.0.36"`` -> ``(10, 12)``)."""
    parts = re.findall(r"\d+", str(getattr(trt, "__version__", "0")))
    return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0) if parts else (0, 0)


def network_flags(trt: Any) -> int:
    """The ``create_network`` flags of a strongly typed network on this TensorRT.

    TensorRT 11: 0 (strong typing is always on; the flag is deprecated and ignored). TensorRT 10: the
    ``STRONGLY_TYPED`` bit. Older: refused.

    Raises:
        QdqBackendUnavailable: TensorRT older than 10.
    """
    major, minor = tensorrt_version(trt)
    if major < _MIN_MAJOR:
        raise QdqBackendUnavailable(
            f"TensorRT {major}.{minor} is too old: qdq builds strongly typed networks from Q/DQ ONNX graphs, "
            f"which needs TensorRT >= {_MIN_MAJOR} (TensorRT 11 recommended). Upgrade: pip install 'tensorrt>=10'"
        )
    if major >= 11:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def rule_check() -> Callable[[Any], Any]:
    """TensorRT's rule check: the ``rule_check`` of the first registered target made for TensorRT (``"native"``).

    Raises:
        QdqConfigError: no registered target made for TensorRT records one.
    """
    found = native_fact(TENSORRT_RUNTIME, lambda target: target.rule_check)
    if found is None:
        raise QdqConfigError("no registered target made for TensorRT records its rule check (Target.rule_check).")
    return found


def check_rules(onnx_path: str | Path) -> None:
    """Raise ``QdqConfigError`` naming the broken rules (at most three violations shown) unless ``onnx_path`` follows
    TensorRT's rules (:func:`rule_check`)."""
    report = rule_check()(onnx_path)
    if report.ok:
        return
    shown = "; ".join(f"{v.node}: {v.rule} ({v.message})" for v in report.violations[:3])
    more = f" and {len(report.violations) - 3} more" if len(report.violations) > 3 else ""
    raise QdqConfigError(
        f"{Path(onnx_path).name} breaks TensorRT's rules ({', '.join(sorted(report.rules_broken()))}): {shown}{more}. "
        f"See `qdq check {onnx_path}` for the table; export it with target='tensorrt' (or pass check=False)."
    )


def build_engine(onnx_path: str | Path, *, batch: int = 1, workspace_mib: int = 1024, check: bool = True) -> bytes:
    """Parse ``onnx_path`` into a strongly typed network and return the serialized engine (the plan).

    The graph is checked against TensorRT's rules first (``check``). A dynamic leading dimension gets an
    optimization profile from 1 to ``batch`` (optimised for ``batch``); any other dynamic dimension is
    refused. ``workspace_mib`` caps TensorRT's scratch memory (MiB). No precision flag is set: the graph's
    Q/DQ nodes and float types decide every precision. The plan can be written to a file and deserialized
    by ``tensorrt.Runtime``.

    Raises:
        QdqBackendUnavailable: no ``tensorrt``, or one older than 10.
        QdqConfigError: the graph breaks TensorRT's rules, or TensorRT cannot parse it.
    """
    trt = _trt()
    flags = network_flags(trt)
    if check:
        check_rules(onnx_path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise QdqConfigError(f"TensorRT cannot parse {Path(onnx_path).name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    profile = _batch_profile(builder, network, batch)
    if profile is not None:
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise QdqError(f"TensorRT failed to build an engine for {Path(onnx_path).name}; see its log above")
    return bytes(plan)


class TensorRtRuntime(Runtime):
    """A TensorRT engine and its execution context; inputs and outputs live in torch CUDA tensors."""

    name = TENSORRT_RUNTIME.name

    def __init__(self, info: ModelInfo, plan: bytes, *, batch: int | None) -> None:
        super().__init__(info, threads=None, batch=batch)
        trt = _trt()
        # The TensorRT runtime (and its logger) must outlive the engine it deserialized.
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._trt_runtime = trt.Runtime(self._logger)
        self.engine: tensorrt.ICudaEngine | None = self._trt_runtime.deserialize_cuda_engine(plan)
        self._context = self.engine.create_execution_context()
        self._torch = _cuda_torch()

    @classmethod
    def load(
        cls,
        onnx_path: str | Path,
        *,
        threads: int | None = None,
        batch: int | None = None,
        workspace_mib: int = 1024,
        check: bool = True,
    ) -> TensorRtRuntime:
        """Build an engine for ``onnx_path`` (see :func:`build_engine`; ``check``: run the rule checker first).

        ``threads`` is accepted for a uniform interface and ignored (the GPU runs the model).
        ``batch`` is the largest batch the engine accepts (default 1).
        """
        check_common_options(threads, batch)
        info = read_model_info(onnx_path)
        advice = target_advice(info, TENSORRT_RUNTIME)  # an onnxruntime-target graph is refused before any GPU work
        network_flags(_trt())  # an old TensorRT fails here, before the GPU is looked for
        _cuda_torch()
        plan = build_engine(info.path, batch=batch or 1, workspace_mib=workspace_mib, check=check)
        runtime = cls(info, plan, batch=batch)
        runtime.advice = advice
        return runtime

    @property
    def precision(self) -> str:
        """``"int8"`` for a Q/DQ graph (``"int8+fp16"`` when its float part is FP16), else the float type of the
        graph (strong typing keeps each type the file gives)."""
        return self.info.precision

    def bind(self, inputs: Inputs) -> Callable[[], object]:
        """Copy ``inputs`` to the GPU once; the callable runs the engine and waits for it."""
        device_inputs = self._to_device(self._feed(inputs))

        def call() -> list[torch.Tensor]:
            self._ensure_open()
            return self._execute(device_inputs)

        return call

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self._execute(self._to_device(feed))
        return [out.cpu().numpy() for out in outputs]

    def _to_device(self, feed: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        torch = self._torch
        assert self.engine is not None  # callers check _ensure_open() first
        return {
            name: torch.from_numpy(array).to("cuda", dtype=_torch_dtype(self.engine.get_tensor_dtype(name)))
            for name, array in feed.items()
        }

    def _execute(self, device_inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        torch, context, engine = self._torch, self._context, self.engine
        assert engine is not None  # callers check _ensure_open() first
        for name, tensor in device_inputs.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in self.output_names:
            shape = tuple(context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=_torch_dtype(engine.get_tensor_dtype(name)), device="cuda")
            context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise QdqError(f"TensorRT failed to execute {self.path.name}")
        stream.synchronize()
        return outputs

    def _release(self) -> None:
        # Destroy in reverse order of creation: context, engine, then the TensorRT runtime.
        self._context = None
        self.engine = None
        self._trt_runtime = None


def _batch_profile(builder: Any, network: Any, batch: int) -> Any:
    """An optimization profile for a dynamic leading dimension, or None if every input is static."""
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = list(tensor.shape)
        if all(d >= 0 for d in shape):
            continue
        if any(d < 0 for d in shape[1:]):
            raise QdqConfigError(f"input {tensor.name!r} has dynamic dimensions beyond the batch: {shape}")
        dynamic = True
        profile.set_shape(tensor.name, [1, *shape[1:]], [batch, *shape[1:]], [batch, *shape[1:]])
    return profile if dynamic else None


def _torch_dtype(trt_dtype: Any) -> torch.dtype:
    torch, trt = _cuda_torch(), _trt()
    names = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }
    for name, dtype in names.items():
        if getattr(trt, name, None) == trt_dtype:
            return dtype
    raise QdqConfigError(f"TensorRT tensor type {trt_dtype} has no torch equivalent")

"""Fidelity check: does the deployed INT8 engine compute what the PyTorch fake-quant model computes?

``verify(model, "model.onnx", data, runtime="onnxruntime")`` runs the same batches through the PyTorch
model (eval mode, quantizers as calibrated) and through the runtime, and reports:

* **top-1 agreement**: percent of samples whose arg-max class is the same in both;
* **max error in steps**: the largest absolute output difference divided by one int8 step of the
  output's range, ``step = max|y_torch| / 127`` over the data (so 1.0 means "one quantization level of
  an int8 output");
* **SQNR** per output, in dB: ``10 log10(sum y_torch^2 / sum (y_torch - y_runtime)^2)`` (inf when equal).

The verdict (:meth:`VerifyResult.verdict`) is PASS when the agreement reaches ``min_agreement`` (99.5 %)
and the max error stays within ``max_error_steps`` (8 output steps), FAIL otherwise; the result names
the thresholds it applied. When an engine fails, :func:`locate_divergence` finds where it departs from
PyTorch: it runs the ONNX graph cut after each activation quantizer (in graph order) on the runtime and
compares that quantizer's output with PyTorch's, in steps of that quantizer.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.utils.batches import ModelInputs, flatten_outputs, model_inputs

__all__ = [
    "MAX_ERROR_STEPS",
    "MIN_AGREEMENT",
    "Divergence",
    "QuantizerAgreement",
    "VerifyResult",
    "locate_divergence",
    "verify",
]

#: default PASS threshold: percent of samples whose top-1 class is the same in PyTorch and the engine
MIN_AGREEMENT = 99.5
#: default PASS threshold: largest output difference, in int8 steps of the output's range
MAX_ERROR_STEPS = 8.0


@dataclass
class VerifyResult:
    """Agreement between the PyTorch model and one runtime over ``samples`` inputs, and the thresholds
    of its verdict (``min_agreement`` percent, ``max_error_steps`` output steps)."""

    runtime: str
    samples: int
    top1_agreement: float
    max_abs_error: float
    max_error_steps: float
    output_step: float
    sqnr_db: list[float]
    min_agreement: float = MIN_AGREEMENT
    max_allowed_steps: float = MAX_ERROR_STEPS

    def ok(self, min_agreement: float | None = None, max_error_steps: float | None = None) -> bool:
        """True when the agreement reaches ``min_agreement`` percent and the max error is within
        ``max_error_steps`` (each default: the result's own threshold)."""
        agreement = self.min_agreement if min_agreement is None else min_agreement
        steps = self.max_allowed_steps if max_error_steps is None else max_error_steps
        return self.top1_agreement >= agreement and self.max_error_steps <= steps

    @property
    def verdict(self) -> str:
        """``"PASS"`` or ``"FAIL"`` by the result's thresholds."""
        return "PASS" if self.ok() else "FAIL"

    def verdict_line(self) -> str:
        """The verdict with each threshold and how the measurement compares to it."""
        agree = ">=" if self.top1_agreement >= self.min_agreement else "<"
        error = "<=" if self.max_error_steps <= self.max_allowed_steps else ">"
        return (
            f"{self.verdict}: top-1 agreement {self.top1_agreement:.2f} % {agree} {self.min_agreement:.2f} %, "
            f"max error {self.max_error_steps:.2f} {error} {self.max_allowed_steps:.2f} output steps"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}

    def __str__(self) -> str:
        sqnr = ", ".join("inf" if math.isinf(s) else f"{s:.1f}" for s in self.sqnr_db)
        return (
            f"{self.runtime}: top-1 agreement {self.top1_agreement:.2f}% over {self.samples} samples, "
            f"max error {self.max_error_steps:.2f} steps ({self.max_abs_error:.3g}), SQNR {sqnr} dB"
        )


def _as_list(outputs: Any) -> list[np.ndarray]:
    return [
        o.detach().float().cpu().numpy() if isinstance(o, torch.Tensor) else np.asarray(o, np.float32)
        for o in flatten_outputs(outputs)
    ]


_Step = Callable[[Any, Any], tuple[list[np.ndarray], list[np.ndarray]]]


def _torch_step(model: nn.Module) -> _Step:
    """One batch through the PyTorch model and the engine, fed by the batch convention (qdq.utils.batches)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def step(batch: Any, engine: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        inputs = model_inputs(batch, model)
        reference = _as_list(inputs.to(device)(model))
        return reference, engine.run(_feed(inputs, engine.input_names))

    return step


def _feed(inputs: ModelInputs, engine_names: list[str]) -> dict[str, np.ndarray]:
    """The engine's feed: the batch's tensors under the names export gave them (a one-input file whatever its
    input's name)."""
    named = {name: t.detach().cpu().numpy() for name, t in inputs.tensors()}
    if set(named) == set(engine_names):
        return named
    if len(named) == len(engine_names) == 1:
        return {engine_names[0]: next(iter(named.values()))}
    raise QdqConfigError(
        f"the batch gives inputs {list(named)} but the ONNX model's inputs are {engine_names}; export the model "
        "with an example batch of the same form (a dict's keys name the ONNX inputs)."
    )


def _framework_step(model: Any) -> _Step:
    """Another framework's callable (a Keras model, called in inference mode) on one-input batches."""
    call = getattr(model, "predict_on_batch", model)

    def step(batch: Any, engine: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        x = batch[0] if isinstance(batch, tuple | list) else batch
        if isinstance(x, torch.Tensor):
            x = x.cpu().numpy()
        if not hasattr(x, "numpy") and not isinstance(x, np.ndarray):
            raise QdqConfigError(f"verify needs array batches or (inputs, labels) pairs, got {type(x).__name__}.")
        x = np.asarray(x, dtype=np.float32)
        return _as_list(call(x)), engine.run(x)

    return step


def _step_for(model: Any) -> _Step:
    if isinstance(model, nn.Module):
        return _torch_step(model)
    if callable(model):  # e.g. a Keras model
        return _framework_step(model)
    raise QdqConfigError(f"verify needs a model (torch.nn.Module or a Keras model), got {type(model).__name__}.")


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-30) / noise)


def verify(
    model: nn.Module | Any,
    onnx_path: str | Path,
    data: Iterable[Any],
    runtime: str = "onnxruntime",
    *,
    num_batches: int | None = None,
    threads: int | None = None,
    min_agreement: float = MIN_AGREEMENT,
    max_error_steps: float = MAX_ERROR_STEPS,
    **runtime_options: Any,
) -> VerifyResult:
    """Compare ``model`` (PyTorch or Keras, fake-quant) with ``onnx_path`` running on ``runtime``.

    Args:
        model: the quantized model the ONNX file was exported from: a ``torch.nn.Module`` (run in eval
            mode), or a Keras model from :func:`qdq.keras.quantize_model` (run in inference mode).
        data: batches: for a PyTorch model a tensor, a tuple of positional arguments, a dict of keyword
            arguments or an ``(inputs, labels)`` pair (:mod:`qdq.utils.batches`; labels are not used), fed
            to the engine under the names :func:`qdq.export.export_onnx` gave them; for a Keras model
            arrays or ``(inputs, labels)`` pairs.
        runtime: ``"onnxruntime"``, ``"openvino"`` or ``"tensorrt"``.
        min_agreement: the verdict's threshold on top-1 agreement, in percent (PASS needs at least this).
        max_error_steps: the verdict's threshold on the max error, in output steps (PASS needs at most this).
        runtime_options: passed to :func:`qdq.runtime.load_runtime` (e.g. ``precision="f32"``).
    """
    from qdq.runtime import load_runtime

    step = _step_for(model)
    batches = list(itertools.islice(data, num_batches) if num_batches else data)
    if not batches:
        raise QdqConfigError("verify got no data: pass at least one batch.")
    is_torch = isinstance(model, nn.Module)
    was_training = model.training if is_torch else False
    if is_torch:
        model.eval()
    torch_outs: list[list[np.ndarray]] = []
    engine_outs: list[list[np.ndarray]] = []
    try:
        with load_runtime(onnx_path, runtime, threads=threads, **runtime_options) as engine, torch.no_grad():
            for batch in batches:
                reference, engine_out = step(batch, engine)
                torch_outs.append(reference)
                engine_outs.append([np.asarray(o, dtype=np.float32) for o in engine_out])
    finally:
        if is_torch:
            model.train(was_training)
    result = _compare(runtime, torch_outs, engine_outs)
    result.min_agreement, result.max_allowed_steps = float(min_agreement), float(max_error_steps)
    return result


def _compare(
    runtime: str, torch_outs: Sequence[list[np.ndarray]], engine_outs: Sequence[list[np.ndarray]]
) -> VerifyResult:
    n_outputs = len(torch_outs[0])
    if any(len(e) != n_outputs for e in engine_outs):
        raise QdqConfigError(f"the ONNX model has a different number of outputs than the PyTorch model ({n_outputs}).")
    ref = [np.concatenate([b[i] for b in torch_outs]) for i in range(n_outputs)]
    got = [np.concatenate([b[i] for b in engine_outs]) for i in range(n_outputs)]
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            raise QdqConfigError(f"output shapes differ: PyTorch {r.shape} vs runtime {g.shape}.")
    diffs = [np.abs(r.astype(np.float64) - g) for r, g in zip(ref, got)]
    max_abs = float(max(d.max() for d in diffs))
    step = float(max(np.abs(r).max() for r in ref)) / 127.0
    sqnr = [_sqnr(float(np.sum(r.astype(np.float64) ** 2)), float(np.sum(d**2))) for r, d in zip(ref, diffs)]
    first_ref, first_got = ref[0], got[0]
    if first_ref.ndim >= 2:
        agreement = 100.0 * float(np.mean(first_ref.argmax(axis=1) == first_got.argmax(axis=1)))
    else:
        agreement = 100.0 * float(np.mean(np.sign(first_ref) == np.sign(first_got)))
    return VerifyResult(
        runtime=runtime,
        samples=int(first_ref.shape[0]),
        top1_agreement=agreement,
        max_abs_error=max_abs,
        max_error_steps=max_abs / step if step > 0 else (0.0 if max_abs == 0 else math.inf),
        output_step=step,
        sqnr_db=sqnr,
    )


@dataclass
class QuantizerAgreement:
    """One activation quantizer's output in PyTorch and in the engine (the graph cut after its
    DequantizeLinear), compared in steps of that quantizer: ``differing`` is the fraction of elements
    more than half a step apart (a different integer code), ``max_steps`` the largest difference."""

    name: str
    differing: float
    max_steps: float


@dataclass
class Divergence:
    """Where an engine departs from PyTorch: the quantizers compared, in graph order, up to the first
    one whose codes differ on more than ``tolerance`` of its elements (``first``, None if none did)."""

    runtime: str
    tolerance: float
    compared: list[QuantizerAgreement] = field(default_factory=list)

    @property
    def first(self) -> QuantizerAgreement | None:
        last = self.compared[-1] if self.compared else None
        return last if last is not None and last.differing > self.tolerance else None

    def __str__(self) -> str:
        first = self.first
        if first is None:
            return (f"{self.runtime}: every one of the {len(self.compared)} activation quantizers compared agrees "
                    "with PyTorch; the difference arises after the last one")  # fmt: skip
        before = self.compared[-2].name if len(self.compared) > 1 else None
        where = f"; the {len(self.compared) - 1} quantizers before it agree (the last: {before})" if before else ""
        return (
            f"{self.runtime} departs from PyTorch at {first.name}: {100 * first.differing:.1f} % of its codes "
            f"differ, by up to {first.max_steps:.0f} step(s){where}"
        )


def locate_divergence(
    model: nn.Module,
    onnx_path: str | Path,
    batch: Any,
    runtime: str = "onnxruntime",
    *,
    tolerance: float = 0.05,
    threads: int | None = None,
    **runtime_options: Any,
) -> Divergence:
    """Find the first activation quantizer where ``runtime`` computes other codes than PyTorch.

    Each activation quantizer of ``model`` whose Q/DQ pair is in the ONNX graph under its name
    (``<name>/DequantizeLinear``, as :func:`qdq.export_onnx` writes it) is compared, in graph order: the
    graph is cut after that DequantizeLinear, run on ``runtime`` for ``batch`` (a tensor or an
    ``(inputs, labels)`` pair), and the output compared with the quantizer's output in PyTorch. The scan
    stops at the first quantizer whose codes differ on more than ``tolerance`` (a fraction) of its elements:
    an int8 kernel that rounds its bias or requantizes in fixed point moves a few codes by one step (ONNX
    Runtime: up to 2 % of a quantizer's codes, measured), a departure moves many more (OpenVINO's fused
    residual Add: 22 %).
    Each cut graph is compiled separately, so this costs one engine build per quantizer compared.
    """
    import onnx
    import onnx.shape_inference
    import onnx.utils

    from qdq.runtime import load_runtime
    from qdq.workflow.calibration import named_quantizers

    if not isinstance(model, nn.Module):
        raise QdqConfigError("locate_divergence needs the PyTorch model the ONNX file was exported from.")
    host = _single_input(batch, model)
    quantizers = dict(named_quantizers(model, weights=False))
    outputs = _quantizer_outputs(model, quantizers, torch.as_tensor(host))
    proto = onnx.load(str(onnx_path))
    inputs = [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    result = Divergence(runtime, tolerance)
    extractor = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(proto))  # needs every tensor's type
    with tempfile.TemporaryDirectory(prefix="qdq-locate-") as tmp:
        for node in proto.graph.node:
            name = node.name.removesuffix("/DequantizeLinear")
            if node.op_type != "DequantizeLinear" or name not in outputs:
                continue
            cut = extractor.extract_model(inputs, [node.output[0]])
            cut.metadata_props.extend(proto.metadata_props)
            path = Path(tmp) / "cut.onnx"
            onnx.save(cut, str(path))
            with load_runtime(path, runtime, threads=threads, **runtime_options) as engine:
                got = np.asarray(engine.run(host)[0], dtype=np.float64)
            step = float(quantizers[name].step().detach().max())
            diff = np.abs(outputs[name] - got) / step
            result.compared.append(QuantizerAgreement(name, float(np.mean(diff > 0.5)), float(diff.max())))
            if result.compared[-1].differing > tolerance:
                break
    return result


def _single_input(batch: Any, model: nn.Module) -> np.ndarray:
    """The one input array of ``batch`` (labels dropped): the graph cuts are fed by position."""
    if isinstance(batch, np.ndarray) or (isinstance(batch, tuple | list) and isinstance(batch[0], np.ndarray)):
        batch = torch.as_tensor(batch if isinstance(batch, np.ndarray) else batch[0])
    tensors = [t for _, t in model_inputs(batch, model).tensors()]
    if len(tensors) != 1:
        raise QdqConfigError(f"locate_divergence feeds one-input models; this batch gives {len(tensors)} tensors.")
    return tensors[0].detach().cpu().numpy()


def _quantizer_outputs(model: nn.Module, quantizers: Mapping[str, nn.Module], x: torch.Tensor) -> dict[str, np.ndarray]:
    """Each quantizer's output for ``x`` (float64), for the quantizers called exactly once."""
    seen: dict[str, list[np.ndarray]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            seen.setdefault(name, []).append(output.detach().double().cpu().numpy())

        return hook

    handles = [q.register_forward_hook(keep(n)) for n, q in quantizers.items()]
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            model(x.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {n: outs[0] for n, outs in seen.items() if len(outs) == 1}

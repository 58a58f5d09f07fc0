"""The one ONNX Runtime session factory: every session qdq builds on ONNX Runtime's CPU provider comes from
:func:`ort_session` (calibration probes, bias correction, the float16 conversion's range measurement and fidelity
check, the ONNX Runtime backend behind ``verify``, ``tune``, ``bench`` and the demo).

A Q/DQ graph whose float part is float16 or bfloat16 (a TensorRT 11 file: a QuantizeLinear or DequantizeLinear
with a low-precision scale, or a DequantizeLinear writing a low-precision output; :func:`low_precision_qdq`) runs
**without graph optimizations** (``ORT_DISABLE_ALL``), whatever level was asked: ORT's CPU optimizer rewrites such
graphs into something they do not mean (its weight-and-bias quantization rounds a Conv's float16 bias to int32 on a
float16 product of the steps, which can underflow to zero; its QDQ fusions build kernels that reject float16
scales). Unoptimized, ORT runs each node as written, the float16 ops through its own float32 kernels between Casts:
int8 exactly, the float part in float16 storage with float32 arithmetic, as TensorRT computes it. Float32 files keep
the level asked.

``session_options`` builds the options every caller uses (threads, sequential execution, the optimization level by
name). :func:`probe_model` is the one probe of intermediate tensors. ``onnxruntime`` is imported when a session or
options are built.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdq.errors import QdqConfigError, did_you_mean
from qdq.graphs import onnx_types
from qdq.graphs.onnx import initializer_map
from qdq.graphs.onnx_types import FLOAT_TYPES, LOW_PRECISION, type_name

if TYPE_CHECKING:
    import onnx
    import onnxruntime

__all__ = [
    "OPTIMIZATION_LEVELS",
    "UNOPTIMIZED_NOTE",
    "low_precision_qdq",
    "ort_session",
    "outputs_of",
    "probe_model",
    "session_options",
]

OPTIMIZATION_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "layout": "ORT_ENABLE_LAYOUT",
    "all": "ORT_ENABLE_ALL",
}
"""``optimization_level`` names and the ``GraphOptimizationLevel`` each selects ("layout": ORT >= 1.22)."""

#: what a report says of a low-precision Q/DQ file run by a session of this factory (``{type}``: its float type)
UNOPTIMIZED_NOTE = "run on ONNX Runtime without graph optimizations: {type} as TensorRT computes it"
_PROVIDERS = ["CPUExecutionProvider"]
_ERROR_LEVEL = 3  # ORT log severity: errors only (hides the NCHWc "hardware specific" save warning)
_LOW = frozenset(LOW_PRECISION.values())
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as err:  # the runtime layer's import_backend says the same for its callers
        raise QdqConfigError("this needs onnxruntime: pip install onnxruntime") from err
    return onnxruntime


def session_options(
    *, threads: int | None = None, optimization_level: str = "all", optimized_model_path: str | None = None
) -> onnxruntime.SessionOptions:
    """Build ``SessionOptions``: ``threads`` intra-op threads (None: ORT's default), 1 inter-op thread,
    sequential execution, and the graph optimization level named by ``optimization_level``."""
    ort = _ort()
    if optimization_level not in OPTIMIZATION_LEVELS:
        raise QdqConfigError(
            f"unknown optimization_level {optimization_level!r}; choose one of "
            f"{', '.join(OPTIMIZATION_LEVELS)}." + did_you_mean(optimization_level, OPTIMIZATION_LEVELS)
        )
    level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization_level], None)
    if level is None:
        raise QdqConfigError(
            f"optimization_level {optimization_level!r} needs a newer onnxruntime than {ort.__version__}"
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = level
    options.log_severity_level = _ERROR_LEVEL
    if optimized_model_path is not None:
        options.optimized_model_filepath = optimized_model_path
    return options


def low_precision_qdq(model: onnx.ModelProto) -> str | None:
    """``"float16"`` or ``"bfloat16"`` when ``model`` is a Q/DQ graph whose float part has that type (a Q or DQ
    scale of the type, or a DQ ``output_dtype`` of it); None for a float32 Q/DQ graph or a graph without Q/DQ."""
    from onnx import helper

    types = {name: tensor.data_type for name, tensor in initializer_map(model).items()}
    for node in model.graph.node:
        if node.op_type not in _QDQ or node.domain not in ("", "ai.onnx"):
            continue
        found = types.get(node.input[1]) if len(node.input) > 1 else None
        dtype = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "output_dtype"), found)
        for kind in (found, dtype):
            if kind in _LOW:
                return type_name(kind)
    return None


def ort_session(
    model: onnx.ModelProto | str | Path | bytes,
    options: onnxruntime.SessionOptions | None = None,
    *,
    threads: int | None = None,
    folder: Path | None = None,
    disabled_optimizers: tuple[str, ...] = (),
) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session of ``model`` (a ``ModelProto``, a file, or its serialized bytes).

    Args:
        model: the graph to run. A ``ModelProto`` over protobuf's limit goes through a file with external data,
            in ``folder`` (left there for the caller to remove) or in a temporary folder removed once the session
            is built.
        options: from :func:`session_options` (default: ``threads`` and the "all" level). A low-precision Q/DQ
            graph (:func:`low_precision_qdq`) has its level set to ``ORT_DISABLE_ALL`` here, in ``options``.
        threads: intra-op threads when ``options`` is not given.
        disabled_optimizers: ORT optimizer passes to leave out (by name).

    Raises:
        The errors of ``onnxruntime.InferenceSession`` (callers translate them for their users).
    """
    ort = _ort()
    options = options or session_options(threads=threads)
    if low_precision_qdq(_graph_of(model)) is not None:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    extra = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
    if isinstance(model, str | Path | bytes):
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), sess_options=options,
                                    providers=_PROVIDERS, **extra)  # fmt: skip
    if model.ByteSize() < onnx_types.PROTOBUF_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=_PROVIDERS, **extra)
    with tempfile.TemporaryDirectory(prefix="qdq-session-") as temporary:
        path = Path(folder or temporary) / "model.onnx"
        _save_external(model, path)
        return ort.InferenceSession(str(path), sess_options=options, providers=_PROVIDERS, **extra)


def probe_model(model: onnx.ModelProto, values: Iterable[str], expose: Callable[..., Iterable[str]] | None = None
                ) -> onnx.ModelProto:  # fmt: skip
    """A copy of ``model`` also returning ``values`` (tensors it computes or reads), run once per batch through
    :func:`ort_session`; an output typed as declared when a float type, else left to ONNX Runtime. ``expose`` first
    returns some through the graph itself (``onnx_in.subgraphs.expose``: those of ``If`` branches) and names them."""
    import onnx
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    values = list(dict.fromkeys(values))
    present = {o.name for o in probe.graph.output} | set(expose(probe, values) if expose is not None else ())
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input,
                                                               *model.graph.output]}  # fmt: skip
    probe.graph.output.extend(
        helper.make_tensor_value_info(name, types[name], None) if types.get(name) in FLOAT_TYPES
        else onnx.ValueInfoProto(name=name) for name in values if name not in present
    )  # fmt: skip
    return probe


def outputs_of(session: onnxruntime.InferenceSession, feed: Mapping[str, Any]) -> dict[str, Any]:
    """Every output of ``session`` (a probe's: the model's outputs and the values it returns) on ``feed``, by name."""
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(feed)), strict=True))


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    import onnx

    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="model.data")


def _graph_of(model: onnx.ModelProto | str | Path | bytes) -> onnx.ModelProto:
    """``model`` as a ``ModelProto`` to read its nodes and constants (a file: without its external data)."""
    import onnx

    if isinstance(model, str | Path):
        return onnx.load(str(model), load_external_data=False)
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return model

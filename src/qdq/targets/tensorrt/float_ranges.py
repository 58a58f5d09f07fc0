"""Which nodes of a float32 ONNX graph may compute in FP16/BF16, measured on calibration data.

NVIDIA's ModelOpt AutoCast decides by running the float32 graph in ONNX Runtime with every intermediate
tensor as an output and keeping in FP32 the nodes whose values would not survive the low-precision type;
qdq does the same for its Q/DQ graphs (AutoCast "does not yet support quantized models"). A node stays in
FP32 when:

* ``op type``: it is in the FP32 allow-list (:data:`qdq.targets.tensorrt.check.FP32_OPS`: exponentials, powers,
  sums over many elements) or the caller names it;
* ``no low-precision form``: its operator schema does not allow the type in the graph's opset;
* ``initializer``: one of its float initializers holds a value beyond the type's largest finite value
  (AutoCast's ``init_max``; 65504 for FP16);
* ``overflow``: one of its float inputs or outputs exceeds ``data_max`` in absolute value on the calibration
  data. The default, 512, is AutoCast's: above it FP16's spacing is 0.5 or more, and it leaves a 128x margin
  below FP16's largest value for inputs larger than the calibration data;
* ``underflow``: one of its float outputs is nonzero but its largest absolute value is below the type's
  smallest normal number (FP16: 2**-14), so every value is subnormal and loses precision. (Inputs are not
  tested: a tiny input added to larger values loses its digits in the output whatever the node's type.)

Without calibration data only the first three rules apply (the report says so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqConfigError
from qdq.graphs.ir_graph import const
from qdq.graphs.onnx_session import ort_session, outputs_of, probe_model, session_options
from qdq.graphs.onnx_types import FLOAT_TYPES, TensorTypes, float_slots, type_name

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["Batch", "TensorRange", "feeds", "keep_fp32_reasons", "measure_ranges"]

_FLOAT32 = 1
_LIMITS = {10: (65504.0, 2.0**-14), 16: (3.3895313892515355e38, 1.1754943508222875e-38)}  # max, min normal

#: One calibration batch: an array (or CPU tensor) for the graph's single input, a tuple of them for several
#: inputs (in the graph's input order), or input name -> array.
Batch = Any


@dataclass
class TensorRange:
    """The largest absolute value of a tensor over the calibration data, and whether any value was nonzero."""

    absmax: float = 0.0
    nonzero: bool = False

    def update(self, values: np.ndarray) -> None:
        if values.size:
            self.absmax = max(self.absmax, float(np.max(np.abs(values))))
            self.nonzero = self.nonzero or bool(np.any(values != 0))


def feeds(names: list[str], batch: Batch) -> dict[str, np.ndarray]:
    """The feed of a graph with inputs ``names`` for one calibration batch (see :data:`Batch`).

    Raises:
        QdqConfigError: the batch does not match the graph's inputs.
    """
    if isinstance(batch, Mapping):
        missing = sorted(set(names) - set(batch))
        if missing:
            raise QdqConfigError(f"a calibration batch lacks the graph inputs {missing}.")
        return {name: _array(batch[name]) for name in names}
    values = list(batch) if isinstance(batch, tuple | list) else [batch]
    if len(values) != len(names):
        raise QdqConfigError(
            f"a calibration batch holds {len(values)} arrays but the graph has {len(names)} inputs {names}: pass "
            "the model's inputs only (for a DataLoader of (inputs, labels): [x for x, _ in loader]), or dicts "
            "input name -> array."
        )
    return {name: _array(value) for name, value in zip(names, values)}


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    return array.astype(np.float32) if array.dtype.kind == "f" else array


def measure_ranges(model: Any, batches: Iterable[Batch]) -> dict[str, TensorRange]:
    """Run ``model`` (float32) in ONNX Runtime on ``batches`` and return the range of every float tensor.

    Every float32 tensor a node produces (and every float input) becomes an output of a copy of the graph,
    run on the CPU with graph optimizations off so that each tensor is computed as written.
    """
    types = TensorTypes.of(model)
    tensors = [name for node in model.graph.node if node.op_type != "Constant" for name in node.output
               if name and types.get(name) == _FLOAT32]  # fmt: skip
    session = ort_session(probe_model(model, tensors), session_options(optimization_level="disable"))
    ranges: dict[str, TensorRange] = {}
    seen = 0
    for batch in batches:
        feed = feeds([i.name for i in session.get_inputs()], batch)
        for name, values in [*feed.items(), *outputs_of(session, feed).items()]:
            if np.issubdtype(np.asarray(values).dtype, np.floating):
                ranges.setdefault(name, TensorRange()).update(np.asarray(values))
        seen += 1
    if not seen:
        raise QdqConfigError("calibration_data gave no batch; pass a non-empty sequence of input arrays.")
    return ranges


def keep_fp32_reasons(
    model: Any,
    low: int,
    *,
    ranges: Mapping[str, TensorRange] | None,
    data_max: float,
    fp32_ops: Iterable[str],
    fp32_nodes: Iterable[str],
) -> dict[str, str]:
    """Node name -> why it must compute in FP32, for every float32 compute node that cannot move to ``low``.

    ``low`` is ``TensorProto.FLOAT16`` or ``BFLOAT16``; ``ranges`` from :func:`measure_ranges` (None: the
    range rules are skipped). Q/DQ nodes are not classified here (their types follow their neighbours).
    """
    import onnx_ir as ir

    types, graph = TensorTypes.of(model), ir.serde.deserialize_model(model).graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    fp32_ops, fp32_nodes = frozenset(fp32_ops), frozenset(fp32_nodes)
    type_max, min_normal = _LIMITS[low]
    reasons: dict[str, str] = {}
    for node in graph:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant", "Cast"):
            continue
        slots = float_slots(node, opset)
        if not slots.outputs or all(types.get(node.outputs[i].name or "") != _FLOAT32 for i in slots.outputs):
            continue
        reason = _static_reason(node, slots, low, opset, fp32_ops, fp32_nodes)
        reason = reason or _initializer_reason(node, type_max, low)
        if reason is None and ranges is not None:
            reason = _range_reason(node, types, ranges, data_max, min_normal, low)
        if reason is not None:
            reasons[node.name or ""] = reason
    return reasons


def _static_reason(
    node: ir.Node, slots: Any, low: int, opset: int, ops: frozenset[str], names: frozenset[str]
) -> str | None:
    if node.op_type in ops:
        return f"op type {node.op_type} computes in FP32 (allow-list)"
    if node.name in names:
        return "kept in FP32 on request"
    if not slots.allows(low):
        return f"{node.op_type} has no {type_name(low)} form in opset {opset}"
    return None


def _initializer_reason(node: ir.Node, type_max: float, low: int) -> str | None:
    for value in node.inputs:
        values = const(value)
        if value is not None and values is not None and values.dtype == np.float32 and values.size:
            peak = float(np.max(np.abs(values)))
            if peak > type_max:
                return f"initializer {value.name!r} holds {peak:.4g}, beyond {type_name(low)}'s largest value"
    return None


def _range_reason(
    node: ir.Node,
    types: TensorTypes,
    ranges: Mapping[str, TensorRange],
    data_max: float,
    min_normal: float,
    low: int,
) -> str | None:
    for kind, values in (("input", node.inputs), ("output", node.outputs)):
        for name in [v.name for v in values if v is not None and v.name and const(v) is None]:
            seen = ranges.get(name)
            if seen is None or types.get(name) not in FLOAT_TYPES:
                continue
            if seen.absmax > data_max:
                return f"{kind} {name!r} reaches {seen.absmax:.4g} on the calibration data (> data_max {data_max:g})"
            if kind == "output" and seen.nonzero and seen.absmax < min_normal:
                return (f"{kind} {name!r} stays below {min_normal:.3g} (largest {seen.absmax:.3g}): every value is "
                        f"subnormal in {type_name(low)}")  # fmt: skip
    return None

"""The low-precision export of a Q/DQ graph for TensorRT 11: INT8 where quantized, FP16/BF16 elsewhere.

TensorRT 11 builds every network strongly typed: INT8 exists only as Q/DQ nodes and FP16/BF16 only as the
types written in the ONNX file. :func:`convert_float_precision` turns a float32 Q/DQ graph (the
``"tensorrt"`` target's export) into one whose float part computes in ``float16`` or ``bfloat16``:

* every node that is not quantized computes in the low type; its float initializers are converted once;
* each DequantizeLinear outputs the type its readers compute in (its scale has that type: opset 19+), so no
  Cast stands between a DQ and its int8 consumer; a DQ read in two types is duplicated;
* each QuantizeLinear takes its input in the producer's type, with a scale of the same type;
* quantized weights are stored as int8 codes (a DequantizeLinear of an int8 initializer, which TensorRT takes
  as pre-quantized weights), with a weight Transpose folded into the codes;
* the graph's inputs and outputs stay float32 (Casts at the edges) unless ``keep_io_types=False``;
* nodes whose values would overflow or underflow the low type on the calibration data, and the op types of
  :data:`~qdq.export.trt_check.FP32_OPS`, stay FP32 with Casts around them (:mod:`qdq.export.float_ranges`);
  the result lists them with the reason, and the file records them (metadata ``qdq.float.fp32_nodes``) so
  that the TensorRT checker accepts exactly those FP32 nodes.

Quantization steps (``y_scale``) become numbers of the low type: a DQ that outputs FP16 has an FP16 scale.
A float32 step rounds to the nearest FP16 number (relative change up to 2**-11 for a normal step, more for a
step below 6.1e-5, which is subnormal in FP16; BF16: up to 2**-8), which moves the grid. The conversion
rounds every step first, in the float32 graph too (:func:`round_scales`), and computes the int8 weight
codes with the rounded steps, so the converted graph quantizes exactly like a PyTorch model whose ranges
are :func:`exact_amax` of its own: ``amax = 127 * step_low`` is exact in float32 and gives the same step.
``float32`` returns the graph unchanged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qdq.errors import QdqConfigError, QdqExportError
from qdq.export.float_ranges import Batch, keep_fp32_reasons, measure_ranges
from qdq.export.onnx_types import LOW_PRECISION, TensorTypes, default_opset, float_slots, input_types, type_name
from qdq.export.trt_check import FP32_OPS
from qdq.export.trt_rules import FP32_NODES_KEY
from qdq.graphs.onnx import GraphIndex, atomic_save, quantizer_names, set_metadata
from qdq.markdown import markdown_table

__all__ = ["FLOAT_KEY", "FloatConversion", "convert_float_precision", "exact_amax", "parse_float_type", "round_scales"]

_log = logging.getLogger(__name__)
_FLOAT32 = 1
_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
            "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip
_MIN_OPSET = {"float16": 19, "bfloat16": 22}  # fp16/bf16 Q/DQ scales: 19; bf16 Conv/Gemm/MatMul: 22
#: Model metadata key holding the float type the graph computes in.
FLOAT_KEY = "qdq.float"


def parse_float_type(name: str) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a name or alias (``fp16``, ``bf16``, ``half``...)."""
    canonical = _ALIASES.get(str(name).lower())
    if canonical is None:
        raise QdqConfigError(f"unknown float type {name!r}: use float32 (fp32), float16 (fp16) or bfloat16 (bf16).")
    return canonical


def _numpy_type(float_type: str) -> Any:
    import ml_dtypes

    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[float_type]


def exact_amax(amax: Any, float_type: str = "float16", max_bound: int = 127) -> Any:
    """The range whose step ``amax / max_bound`` is exactly a number of ``float_type``, nearest to ``amax``.

    ``step_low = round_to(float_type, amax / max_bound)`` has at most 11 significant bits (BF16: 8), so
    ``max_bound * step_low`` is exact in float32 and dividing it by ``max_bound`` gives ``step_low`` back: a
    PyTorch quantizer with this range quantizes exactly like the converted graph. Works on numpy arrays and
    torch tensors (returned as float32 of the same kind).
    """
    kind = _numpy_type(parse_float_type(float_type))
    if hasattr(amax, "detach"):  # a torch tensor: same values, same device and shape
        exact = exact_amax(amax.detach().float().cpu().numpy(), float_type, max_bound)
        return amax.new_tensor(exact, dtype=amax.float().dtype)
    step = (np.asarray(amax, dtype=np.float32) / np.float32(max_bound)).astype(kind).astype(np.float32)
    return (step * np.float32(max_bound)).astype(np.float32)


@dataclass
class FloatConversion:
    """What :func:`convert_float_precision` did.

    Attributes:
        model: the converted ``onnx.ModelProto``.
        float_type: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        fp32_nodes: node name -> why it stays FP32.
        converted: nodes that compute in the low type; ``casts``: Cast nodes added.
        scale_changes: quantizer -> largest relative change of its step from rounding it to the low type.
        fp32_sites: quantizers whose step has no low-precision value (their readers stay FP32).
        folded_weights: weights stored as int8 codes; ``measured``: whether calibration data was used.
    """

    model: Any
    float_type: str
    fp32_nodes: dict[str, str] = field(default_factory=dict)
    converted: int = 0
    casts: int = 0
    scale_changes: dict[str, float] = field(default_factory=dict)
    fp32_sites: list[str] = field(default_factory=list)
    folded_weights: int = 0
    measured: bool = False

    def __str__(self) -> str:
        worst = max(self.scale_changes.values(), default=0.0)
        lines = [
            f"{self.float_type} export: {self.converted} nodes compute in {self.float_type}, {len(self.fp32_nodes)} "
            f"stay FP32, {self.casts} Casts added, {self.folded_weights} weights stored as int8; quantization "
            f"steps rounded to {self.float_type}: {len(self.scale_changes)} quantizers, largest relative change "
            f"{worst:.2e}" + ("" if self.measured else "; no calibration data: value ranges not measured"),
        ]
        if self.fp32_nodes:
            rows = [[name, reason] for name, reason in self.fp32_nodes.items()]
            lines += ["", markdown_table(["node kept in FP32", "why"], rows)]
        return "\n".join(lines)


def _load(model_or_path: Any) -> Any:
    import onnx

    if isinstance(model_or_path, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model_or_path)
        return copy
    path = Path(model_or_path)
    if not path.is_file():
        raise QdqConfigError(f"{str(path)!r} is not a file.")
    return onnx.load(str(path))


def convert_float_precision(
    model_or_path: Any,
    float_type: str = "float16",
    *,
    calibration_data: Iterable[Batch] | None = None,
    keep_io_types: bool = True,
    data_max: float = 512.0,
    fp32_ops: Iterable[str] = FP32_OPS,
    fp32_nodes: Iterable[str] = (),
    path: str | Path | None = None,
) -> FloatConversion:
    """Convert a float32 (Q/DQ) ONNX graph to compute in ``float_type`` outside its quantized ops.

    Args:
        model_or_path: the graph (``onnx.ModelProto``, not modified, or a path), e.g. a ``"tensorrt"`` export.
        float_type: ``"float16"`` / ``"fp16"``, ``"bfloat16"`` / ``"bf16"``, or ``"float32"`` (unchanged).
        calibration_data: input batches (arrays, or dicts input name -> array) to measure value ranges on;
            None skips the overflow/underflow rules.
        keep_io_types: keep the graph's float inputs and outputs float32 (Casts at the edges).
        data_max: largest absolute value a node's inputs and outputs may reach to compute in the low type.
        fp32_ops: op types that always compute in FP32; ``fp32_nodes``: node names kept in FP32.
        path: write the converted graph there (atomically) when given.

    Returns:
        A :class:`FloatConversion` (``.model`` is the converted graph; ``str()`` lists what stays FP32).

    Raises:
        QdqConfigError: an unknown float type or unusable calibration data.
        QdqExportError: the opset cannot be raised to the one the type needs, or the result fails
            ``onnx.checker``.
    """
    import onnx

    kind = parse_float_type(float_type)
    model = _load(model_or_path)
    if kind == "float32":
        result = FloatConversion(model=model, float_type=kind)
    else:
        result = _convert(model, kind, calibration_data, keep_io_types, data_max, fp32_ops, fp32_nodes)
        try:
            onnx.checker.check_model(result.model, full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            raise QdqExportError(f"the {kind} graph fails onnx.checker: {err}") from err
        _log.info("%s", result)
    if path is not None:
        atomic_save(result.model, Path(path))
    return result


def _convert(model: Any, kind: str, data: Any, keep_io: bool, data_max: float, ops: Any, names: Any) -> FloatConversion:
    low = LOW_PRECISION[kind]
    model = _raise_opset(model, _MIN_OPSET[kind])
    result = FloatConversion(model=model, float_type=kind)
    result.scale_changes, result.fp32_sites = _round_scales(model, kind)
    result.folded_weights = _fold_weights(model)
    ranges = measure_ranges(model, data) if data is not None else None
    result.measured = ranges is not None
    reasons = keep_fp32_reasons(model, low, ranges=ranges, data_max=data_max, fp32_ops=ops, fp32_nodes=names)
    rewrite = _Rewrite(model, low, reasons, set(result.fp32_sites))
    rewrite.run(keep_io)
    result.fp32_nodes = dict(rewrite.reasons)
    result.converted, result.casts = rewrite.converted, rewrite.casts
    set_metadata(model, FLOAT_KEY, kind)
    set_metadata(model, FP32_NODES_KEY, json.dumps(result.fp32_nodes, sort_keys=True))
    return result


def _raise_opset(model: Any, minimum: int) -> Any:
    from onnx import version_converter

    if default_opset(model) >= minimum:
        return model
    try:
        return version_converter.convert_version(model, minimum)
    except Exception as err:
        raise QdqExportError(
            f"the graph has opset {default_opset(model)}; low-precision Q/DQ scales need opset >= {minimum} and "
            f"onnx's version converter failed ({type(err).__name__}: {err}). Export with opset={minimum}."
        ) from err


# ---------------------------------------------------------------------------------------- scales and weights
def round_scales(model: Any, float_type: str = "float16") -> Any:
    """A copy of ``model`` whose Q/DQ steps are rounded to the nearest ``float_type`` number (kept float32).

    The float32 graph then quantizes exactly like its low-precision conversion (and like a PyTorch model with
    :func:`exact_amax` ranges): compared with the conversion, what differs is low-precision arithmetic alone.
    Steps that round to 0 or infinity stay as they were.
    """
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))
    _round_scales(copy, parse_float_type(float_type))
    return copy


def _round_scales(model: Any, float_type: str) -> tuple[dict[str, float], list[str]]:
    """Round every Q/DQ scale of ``model`` in place; ``({quantizer: relative change}, [unrepresentable])``."""
    from onnx import numpy_helper

    kind = _numpy_type(float_type)
    index = GraphIndex(model)
    changes: dict[str, float] = {}
    unrepresentable: list[str] = []
    done: set[str] = set()
    for node in [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]:
        name = node.input[1]
        scale = index.array(name)
        owner = ",".join(quantizer_names(node)) or node.name
        if scale is None or name in done:
            continue
        rounded = scale.astype(np.float32).astype(kind).astype(np.float32)
        if not np.all(np.isfinite(rounded) & (rounded > 0)):
            unrepresentable.append(owner)
            continue
        done.add(name)
        change = float(np.max(np.abs(rounded.astype(np.float64) - scale) / scale))
        changes[owner] = max(change, changes.get(owner, 0.0))
        index.constants[name].CopyFrom(numpy_helper.from_array(rounded.reshape(scale.shape), name))
    return changes, unrepresentable


def _fold_weights(model: Any) -> int:
    """Store each Q/DQ-quantized constant weight as int8 codes read by its DQ; fold a Transpose after it."""
    from onnx import numpy_helper

    index = GraphIndex(model)
    doomed, folded = [], 0
    for q in list(model.graph.node):
        weight = index.array(q.input[0]) if q.op_type == "QuantizeLinear" else None
        readers = index.consumers.get(q.output[0], []) if weight is not None else []
        if weight is None or not readers or any(r.op_type != "DequantizeLinear" for r in readers):
            continue
        scale, zero = index.const_input(q, 1), index.const_input(q, 2)
        if scale is None or zero is None or zero.dtype != np.int8:
            continue
        codes = _codes(weight.astype(np.float32), scale.astype(np.float32), zero, _attr(q, "axis", 1))
        name = index.unique(f"{q.input[0]}_int8")
        model.graph.initializer.append(numpy_helper.from_array(codes, name))
        for dq in readers:
            dq.input[0] = name
            _fold_transpose(index, dq, codes, doomed)
        doomed.append(q)
        folded += 1
    index.remove(doomed)
    from qdq.graphs.onnx import tidy

    tidy(model)
    return folded


def _codes(weight: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear of ``weight`` to int8 (division, round half to even, saturate)."""
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * weight.ndim
        shape[axis % weight.ndim] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    q = np.rint(np.divide(weight, scale, dtype=np.float32)) + zero.astype(np.float32)
    return np.clip(q, -128, 127).astype(np.int8)


def _attr(node: Any, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _fold_transpose(index: GraphIndex, dq: Any, codes: np.ndarray, doomed: list[Any]) -> None:
    """DQ(int8) -> Transpose(perm) -> weighted ops becomes DQ(transposed int8), axis mapped through perm."""
    from onnx import helper, numpy_helper

    readers = index.consumers.get(dq.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Transpose" or dq.output[0] in index.outputs:
        return
    transpose = readers[0]
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    after = index.consumers.get(transpose.output[0], [])
    if perm is None or not after or any(r.op_type not in ("MatMul", "Gemm") for r in after):
        return
    name = index.unique(f"{dq.input[0]}_t")
    index.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(codes.transpose(perm)), name))
    dq.input[0] = name
    axis = _attr(dq, "axis", 1) % codes.ndim
    for attr in list(dq.attribute):
        if attr.name == "axis":
            dq.attribute.remove(attr)
    dq.attribute.append(helper.make_attribute("axis", perm.index(axis)))
    dq.output[0] = transpose.output[0]
    doomed.append(transpose)


# ------------------------------------------------------------------------------------------------ rewrite
class _Rewrite:
    """One pass over the nodes in order, giving each float tensor its final type and adding Casts."""

    def __init__(self, model: Any, low: int, reasons: dict[str, str], fp32_sites: set[str]) -> None:
        self.model, self.low = model, low
        self.reasons = dict(reasons)
        self.fp32_sites = fp32_sites
        self.index = GraphIndex(model)
        self.types = TensorTypes.of(model)
        self.opset = default_opset(model)
        self.dtype: dict[str, int] = {}
        self.variants: dict[tuple[str, int], str] = {}  # (tensor, type) -> a tensor of that type, same values
        self.nodes: list[Any] = []
        self.converted = self.casts = 0
        self._precisions: dict[int, int | None] = {}

    # --- precision of each node
    def precision(self, node: Any) -> int | None:
        """The float type ``node`` computes in after conversion; None for a node without float outputs."""
        if id(node) not in self._precisions:
            self._precisions[id(node)] = self._decide(node)
        return self._precisions[id(node)]

    def _decide(self, node: Any) -> int | None:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant"):
            return None
        if node.op_type == "Cast":
            return None if _attr(node, "to", 0) != _FLOAT32 else self._cast_target(node)
        slots = float_slots(node, self.opset)
        if not slots.outputs or all(self.types.get(node.output[i]) != _FLOAT32 for i in slots.outputs):
            return None
        if node.name in self.reasons or self._reads_fp32_site(node):
            return _FLOAT32
        return self.low

    def _reads_fp32_site(self, node: Any) -> bool:
        for name in node.input:
            producer = self.index.producer.get(name)
            owner = ",".join(quantizer_names(producer)) if producer is not None else ""
            if producer is not None and producer.op_type == "DequantizeLinear" and owner in self.fp32_sites:
                self.reasons[node.name] = f"reads quantizer {owner}, whose step has no {type_name(self.low)} value"
                return True
        return False

    def _cast_target(self, node: Any) -> int:
        readers = self.index.consumers.get(node.output[0], [])
        wanted = {self.precision(r) for r in readers} - {None}
        return self.low if wanted == {self.low} and node.output[0] not in self.index.outputs else _FLOAT32

    # --- tensors of the right type
    def as_type(self, tensor: str, wanted: int) -> str:
        if not tensor or (tensor, wanted) in self.variants:
            return self.variants.get((tensor, wanted), tensor)
        constant = self.index.array(tensor) if self.types.get(tensor) == _FLOAT32 else None
        if constant is not None:
            return self._constant(tensor, constant, wanted)
        current = self.dtype.get(tensor, self.types.get(tensor))
        if current is None or current == wanted or current not in (_FLOAT32, self.low):
            return tensor
        from onnx import helper

        name = self.index.unique(f"{tensor}_{type_name(wanted)}")
        self.nodes.append(helper.make_node("Cast", [tensor], [name], to=wanted, name=f"{name}/Cast"))
        self.casts += 1
        self.dtype[name] = wanted
        self.variants[(tensor, wanted)] = name
        return name

    def _constant(self, tensor: str, values: np.ndarray, wanted: int) -> str:
        if wanted == _FLOAT32:
            return tensor
        name = self.index.add_const(f"{tensor}_{type_name(wanted)}", _to_type(values, wanted))
        self.variants[(tensor, wanted)] = name
        return name

    # --- the pass
    def run(self, keep_io: bool) -> None:
        for value in self.model.graph.input:
            if value.type.tensor_type.elem_type == _FLOAT32 and not keep_io:
                value.type.tensor_type.elem_type = self.low
            self.dtype[value.name] = value.type.tensor_type.elem_type
        for node in list(self.model.graph.node):
            handler = {"QuantizeLinear": self._quantize, "DequantizeLinear": self._dequantize}.get(node.op_type)
            (handler or self._compute)(node)
        self._finish_outputs(keep_io)
        del self.model.graph.node[:]
        self.model.graph.node.extend(self.nodes)
        del self.model.graph.value_info[:]
        from qdq.graphs.onnx import tidy

        tidy(self.model)

    def _quantize(self, node: Any) -> None:
        x = node.input[0]
        owner = ",".join(quantizer_names(node))
        wanted = _FLOAT32 if owner in self.fp32_sites else self.dtype.get(x, self.types.get(x) or _FLOAT32)
        node.input[0] = self.as_type(x, wanted)
        node.input[1] = self._scale(node.input[1], wanted)
        self.nodes.append(node)

    def _scale(self, name: str, wanted: int) -> str:
        values = self.index.array(name)
        return name if values is None else self._constant(name, values.astype(np.float32), wanted)

    def _dequantize(self, node: Any) -> None:
        import onnx

        owner = ",".join(quantizer_names(node))
        wanted = [self._wanted_by(r, node.output[0]) for r in self.index.consumers.get(node.output[0], [])]
        kinds = {_FLOAT32} if owner in self.fp32_sites else ({w for w in wanted if w is not None} or {self.low})
        if node.output[0] in self.index.outputs:
            kinds.add(self.low if owner not in self.fp32_sites else _FLOAT32)
        first = self.low if self.low in kinds else _FLOAT32
        scale = node.input[1]
        for kind in sorted(kinds, key=lambda k: k != first):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[1] = self._scale(scale, kind)
            if kind != first:
                copy.name = f"{node.name}_{type_name(kind)}"
                copy.output[0] = self.index.unique(f"{node.output[0]}_{type_name(kind)}")
                self.variants[(node.output[0], kind)] = copy.output[0]
            self.dtype[copy.output[0]] = kind
            self.nodes.append(copy)

    def _wanted_by(self, reader: Any, tensor: str) -> int | None:
        precision = self.precision(reader)
        if precision is not None:
            return precision
        if reader.op_type == "QuantizeLinear":
            return None
        slots = float_slots(reader, self.opset)
        return None if slots.allows(self.low) else _FLOAT32

    def _compute(self, node: Any) -> None:
        precision = self.precision(node)
        slots = float_slots(node, self.opset)
        options = input_types(node, self.opset)
        for i, name in enumerate(node.input):
            if not name:
                continue
            if precision is not None and i in slots.inputs:
                node.input[i] = self.as_type(name, precision)
            elif precision == self.low and self.low in options[i] and self.index.array(name) is not None:
                node.input[i] = self.as_type(name, self.low)  # a constant of another parameter (BN's scale...)
            elif i in slots.inputs and slots.allows(self.dtype.get(name, self.types.get(name) or 0)):
                continue
            elif self.types.get(name) is not None:
                node.input[i] = self.as_type(name, self.types.get(name) or _FLOAT32)
        if node.op_type == "Cast" and precision is not None:
            for attr in node.attribute:
                if attr.name == "to":
                    attr.i = precision
        for i, name in enumerate(node.output):
            original = self.types.get(name)
            self.dtype[name] = precision if precision is not None and i in slots.outputs else (original or 0)
        if node.op_type == "Cast" and precision is not None:
            self.dtype[node.output[0]] = precision
        self.converted += precision == self.low and node.op_type != "Cast"
        self.nodes.append(node)

    def _finish_outputs(self, keep_io: bool) -> None:
        from onnx import helper

        for value in self.model.graph.output:
            current = self.dtype.get(value.name)
            if value.type.tensor_type.elem_type != _FLOAT32 or current in (None, _FLOAT32):
                continue
            if not keep_io:
                value.type.tensor_type.elem_type = current
                continue
            inner = self.index.unique(f"{value.name}_{type_name(current)}")
            for node in self.nodes:
                node.output[:] = [inner if o == value.name else o for o in node.output]
                node.input[:] = [inner if i == value.name else i for i in node.input]
            self.nodes.append(helper.make_node("Cast", [inner], [value.name], to=_FLOAT32, name=f"{value.name}/Cast"))
            self.casts += 1


def _to_type(values: np.ndarray, elem_type: int) -> np.ndarray:
    kind = _numpy_type("float16" if elem_type == LOW_PRECISION["float16"] else "bfloat16")
    return values.astype(np.float32).astype(kind)

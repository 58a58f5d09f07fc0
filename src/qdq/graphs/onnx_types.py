"""Element types of an ONNX graph's tensors, and which inputs and outputs of a node share its float type.

Strongly typed runtimes (TensorRT 10 with ``STRONGLY_TYPED``, TensorRT 11 always) take every tensor's type
from the graph, so both the TensorRT rule checker (:mod:`qdq.targets.tensorrt.check`) and the low-precision
export (:mod:`qdq.targets.tensorrt.float_types`) need the same facts:

* :class:`TensorTypes`: the element type (``onnx.TensorProto`` enum) of each tensor, from the graph's
  inputs, initializers, ``Constant`` nodes and ONNX shape inference;
* :func:`float_slots`: for one node, the inputs and outputs bound to the schema's type parameter that
  carries its float type (``T`` of ``Conv``, ``T1`` of ``QuantizeLinear``...), read from the operator schema
  of the model's opset; the other inputs (``Resize``'s ``scales``, shapes, indices) keep their own types;
* the names of the float types (:func:`parse_float_type`: ``"fp16"`` -> ``"float16"``...) and their numpy
  types (:func:`numpy_float_type`).
The one float-type set (:data:`FLOAT_TYPES`) and protobuf size limit (:data:`PROTOBUF_LIMIT`) are here.

Imports onnx when a function is called, not at import time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqConfigError

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "FLOAT_TYPES",
    "LOW_PRECISION",
    "PROTOBUF_LIMIT",
    "FloatSlots",
    "TensorTypes",
    "default_opset",
    "dim_size",
    "float_slots",
    "input_types",
    "numpy_float_type",
    "parse_float_type",
    "recorded_dims",
    "type_name",
    "value_dims",
]

# onnx.TensorProto enum values (stable across onnx releases).
_FLOAT, _FLOAT16, _DOUBLE, _BFLOAT16 = 1, 10, 11, 16
#: Element types that hold floating-point values computed by a network (FP8 types are quantized types).
FLOAT_TYPES = frozenset({_FLOAT, _FLOAT16, _DOUBLE, _BFLOAT16})
#: Serialized size from which a model goes to a file with its tensors in an external-data file, written so or handed
#: so to ONNX Runtime (protobuf's limit is 2 GiB for one message; read at call time, so a test can lower it).
PROTOBUF_LIMIT = 2**31 - 2**26
#: The low-precision float types a TensorRT 11 graph computes in, by the names qdq's options use.
LOW_PRECISION = {"float16": _FLOAT16, "bfloat16": _BFLOAT16}
_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
            "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip


def parse_float_type(name: str) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a name or alias (``fp16``, ``bf16``, ``half``...).

    Raises:
        QdqConfigError: an unknown name.
    """
    canonical = _ALIASES.get(str(name).lower())
    if canonical is None:
        raise QdqConfigError(f"unknown float type {name!r}: use float32 (fp32), float16 (fp16) or bfloat16 (bf16).")
    return canonical


def numpy_float_type(name: str) -> Any:
    """The numpy type of a float type name (``bfloat16``: ``ml_dtypes.bfloat16``, which onnx depends on)."""
    import ml_dtypes

    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[parse_float_type(name)]


def type_name(elem_type: int) -> str:
    """``"float16"`` for ``TensorProto.FLOAT16`` and so on (``"float32"`` for ``FLOAT``)."""
    from onnx import TensorProto

    return "float32" if elem_type == _FLOAT else TensorProto.DataType.Name(elem_type).lower()


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default ONNX domain the model imports."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def value_dims(value: Any) -> list[int | None] | None:
    """The dimensions a ``ValueInfoProto`` records (None where one is symbolic or unknown); None without a shape."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [dim_size(d) for d in tensor_type.shape.dim]


def dim_size(dim: Any) -> int | None:
    """A shape dimension's fixed size (``TensorShapeProto.Dimension``), or None where it is symbolic or unknown. A
    negative size is unknown too: Paddle's exporter writes ``-1`` for a dynamic axis, and ONNX Runtime reads it so."""
    return int(dim.dim_value) if dim.HasField("dim_value") and dim.dim_value >= 0 else None


def recorded_dims(values: Iterable[Any]) -> dict[str, list[int | None]]:
    """Tensor name -> :func:`value_dims` of each of ``values`` (``ValueInfoProto``) that records a shape; where a
    name comes twice, the later one."""
    found = {}
    for value in values:
        dims = value_dims(value)
        if dims is not None:
            found[value.name] = dims
    return found


@dataclass
class TensorTypes:
    """Tensor name -> element type (and rank where known) of a model's top-level graph.

    Attributes:
        types: tensor name -> ``TensorProto`` element type.
        ranks: tensor name -> rank, where shape inference or the graph knows it.
        inference_error: the message of ONNX shape inference when it failed (types are then partial).
    """

    types: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    dims: dict[str, list[int | None]] = field(default_factory=dict)
    inference_error: str | None = None

    @classmethod
    def of(cls, model: onnx.ModelProto) -> TensorTypes:
        """Types of every tensor of ``model``: declared ones, constants, then ONNX shape inference."""
        import onnx

        table = cls()
        try:
            inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
        except Exception as err:  # inference is best effort here; the checker reports the failure
            table.inference_error = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            inferred = model
        graph = inferred.graph
        for value in [*graph.input, *graph.value_info, *graph.output]:
            table._add_value(value)
        for tensor in graph.initializer:
            table.types[tensor.name] = tensor.data_type
            table._set_dims(tensor.name, list(tensor.dims))
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                table.types[node.output[0]] = node.attribute[0].t.data_type
                table._set_dims(node.output[0], list(node.attribute[0].t.dims))
        return table

    def get(self, name: str) -> int | None:
        """The element type of tensor ``name``; None when unknown."""
        return self.types.get(name)

    def _add_value(self, value: Any) -> None:
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type:
            self.types[value.name] = tensor_type.elem_type
        dims = value_dims(value)
        if dims is not None:
            self._set_dims(value.name, dims)

    def _set_dims(self, name: str, dims: list[int | None]) -> None:
        self.ranks[name] = len(dims)
        self.dims[name] = dims


@dataclass(frozen=True)
class FloatSlots:
    """The inputs and outputs of one node bound to its float type parameter.

    Attributes:
        param: the schema's type parameter (``"T"``...), None when the node has no float-typed output.
        inputs: indices of the inputs bound to ``param``.
        outputs: indices of the outputs bound to ``param``.
        allowed: the element types ``param`` allows in the model's opset.
    """

    param: str | None
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    allowed: frozenset[int] = frozenset()

    def allows(self, elem_type: int) -> bool:
        return elem_type in self.allowed


_NO_SLOTS = FloatSlots(param=None)


def _bound(formals: Any, count: int, param: str) -> tuple[int, ...]:
    """Indices of the ``count`` actual arguments bound to formal parameters of type ``param``."""
    from onnx.defs import OpSchema

    found: list[int] = []
    for index in range(count):
        formal = formals[min(index, len(formals) - 1)] if formals else None
        if formal is None:
            break
        if index >= len(formals) and formal.option != OpSchema.FormalParameterOption.Variadic:
            break
        if formal.type_str == param:
            found.append(index)
    return tuple(found)


def _type_enum(type_str: str) -> int | None:
    """``TensorProto`` enum of ``"tensor(float16)"``; None for sequences, maps and unknown names."""
    from onnx import TensorProto

    if not type_str.startswith("tensor(") or not type_str.endswith(")"):
        return None
    name = type_str[len("tensor(") : -1]
    name = {"float": "FLOAT", "double": "DOUBLE"}.get(name, name.upper())
    return TensorProto.DataType.Value(name) if name in TensorProto.DataType.keys() else None  # noqa: SIM118 (a protobuf enum)


def float_slots(node: ir.Node, opset: int) -> FloatSlots:
    """The float type parameter of ``node`` in ``opset`` and the inputs and outputs bound to it.

    The parameter is the first type parameter of the schema's outputs that allows a float type (for
    ``QuantizeLinear``, whose output is an integer, the parameter of its input ``x``). Nodes outside the
    default domain, or whose schema ONNX does not know, have no slots.
    """
    from onnx import defs

    if node.domain not in ("", "ai.onnx"):
        return _NO_SLOTS
    try:
        schema = defs.get_schema(node.op_type, opset, "")
    except Exception:  # an unknown op or one newer than the opset: not ours to reason about
        return _NO_SLOTS
    allowed = {c.type_param_str: frozenset(filter(None, map(_type_enum, c.allowed_type_strs)))
               for c in schema.type_constraints}  # fmt: skip
    formals = [*schema.outputs, *schema.inputs] if node.op_type != "QuantizeLinear" else list(schema.inputs)
    param = next((f.type_str for f in formals if allowed.get(f.type_str, frozenset()) & FLOAT_TYPES), None)
    if param is None:
        return _NO_SLOTS
    inputs, outputs = node.inputs, node.outputs
    return FloatSlots(
        param=param,
        inputs=tuple(i for i in _bound(schema.inputs, len(inputs), param) if (v := inputs[i]) is not None and v.name),
        outputs=tuple(i for i in _bound(schema.outputs, len(outputs), param) if outputs[i].name),
        allowed=allowed[param],
    )


def input_types(node: ir.Node, opset: int) -> list[frozenset[int]]:
    """For each actual input of ``node``, the element types its schema allows in ``opset`` (empty if unknown)."""
    from onnx import defs
    from onnx.defs import OpSchema

    try:
        schema = defs.get_schema(node.op_type, opset, "") if node.domain in ("", "ai.onnx") else None
    except Exception:  # an unknown op: nothing is known about its inputs
        schema = None
    count = len(node.inputs)
    if schema is None or not schema.inputs:
        return [frozenset()] * count
    allowed = {c.type_param_str: frozenset(filter(None, map(_type_enum, c.allowed_type_strs)))
               for c in schema.type_constraints}  # fmt: skip
    found: list[frozenset[int]] = []
    for index in range(count):
        formal = schema.inputs[min(index, len(schema.inputs) - 1)]
        if index >= len(schema.inputs) and formal.option != OpSchema.FormalParameterOption.Variadic:
            found.append(frozenset())
            continue
        fixed = _type_enum(formal.type_str)
        found.append(frozenset({fixed}) if fixed is not None else allowed.get(formal.type_str, frozenset()))
    return found

"""An FP32 ONNX file as the ONNX front end takes it: loaded, checked, and prepared for placement.

:func:`load_float_model` reads a path (external data included, so files over 2 GB load) or takes a
``ModelProto``, and refuses, with one clear error, what cannot be quantized again: a file that already holds Q/DQ
or QOperator nodes. :func:`prepare` then makes the graph the view reads:

* weights held in ``Constant`` nodes (Paddle2ONNX writes every weight that way) become initializers, and an
  ``Identity`` of an initializer (TorchScript's shared constants) is bypassed, so that a weight is a constant input
  of its op whatever the exporter did;
* a ``BatchNormalization`` reading a ``Conv`` (read only by it) is folded into the conv's weight and bias, as every
  runtime folds it (per-channel weights are then quantized after the fold, as the runtime multiplies them);
* so is a constant scale and shift after a ``Conv`` (``Mul`` by a constant, then ``Add`` of one, either alone,
  per tensor or per output channel: the learnt affine layers of PP-LCNetV3): otherwise they run as float
  elementwise ops between the conv's int8 output and its reader;
* a hard-swish written out as ``x * Clip(x + 3, 0, 6) / 6`` (Paddle2ONNX, older exporters) becomes one
  ``HardSwish`` (the opset raised to 14 for it): ONNX Runtime runs it as two ops instead of four, and reads its
  input once, so the quantized conv output before it needs one ``DequantizeLinear`` instead of two;
* the opset is raised to 13 when it is lower (per-channel ``DequantizeLinear`` needs an ``axis``);
* shapes are inferred where ONNX can (dynamic axes stay symbolic).

Old exports are read as new ones: initializers listed among the graph inputs (IR version 3) are constants, not
inputs, and every node gets a name of its own. The branches of ``If`` nodes are part of the graph
(:mod:`qdq.onnx_in.subgraphs`): every tensor name is made unique in the model and their weights move to the main
graph's initializers. ``Loop`` / ``Scan`` bodies and operators of custom domains are left as they are: the view
sees them as ops no rule knows, so they stay float, and the report lists them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from qdq.errors import QdqConfigError
from qdq.graphs.onnx import all_nodes, consumers, initializer_map, name_nodes, tidy, unique_value_names
from qdq.onnx_in.subgraphs import hoist_constants, if_branches

__all__ = ["QUANTIZED_OPS", "load_float_model", "prepare"]

#: ops that mean a graph is quantized already (Q/DQ, or ONNX Runtime's QOperator form)
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                           "QLinearMatMul", "ConvInteger", "MatMulInteger", "QGemm", "QLinearAdd", "QLinearMul",
                           "QLinearConcat", "QLinearSigmoid", "QAttention", "DynamicQuantizeMatMul"})  # fmt: skip
_MIN_OPSET = 13


def load_float_model(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """The model at ``model`` (with its external data) or ``model`` itself (a copy), checked to be float, without
    the metadata qdq's export wrote into it (``qdq.*``: the target and weight encoding of that export, which the
    quantized file must not inherit: a ``qdq.weights`` record of an FP32 export would tell the runtimes its int8
    weights were stored as uint8).

    Raises:
        QdqConfigError: no such file, not an ONNX file, or a graph that already holds quantized nodes.
    """
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        path = Path(model)
        if not path.is_file():
            raise QdqConfigError(f"no ONNX file at {path}: give the path of the FP32 model to quantize.")
        try:
            proto = onnx.load(str(path), load_external_data=True)
        except Exception as err:  # protobuf's DecodeError and friends
            raise QdqConfigError(f"{path} is not an ONNX model ({type(err).__name__}: {err}).") from err
    found = Counter(n.op_type for n in all_nodes(proto.graph) if n.op_type in QUANTIZED_OPS)
    if found:
        listed = ", ".join(f"{count} {op}" for op, count in found.most_common())
        raise QdqConfigError(
            f"this ONNX model is quantized already: it holds {listed}. quantize_onnx takes the FP32 model: "
            "give the file before quantization (quantizing twice would stack a second grid on the first)."
        )
    kept = [prop for prop in proto.metadata_props if not prop.key.startswith("qdq.")]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    return proto


def prepare(model: onnx.ModelProto) -> dict[str, int]:
    """Prepare ``model`` in place for placement (module doc); counts of what was changed."""
    opset = _opset(model)
    counts = {"initializer_inputs": _initializers_not_inputs(model), "named_nodes": name_nodes(model),
              "renamed_tensors": unique_value_names(model), "constant_weights": _constants_to_initializers(model),
              "branch_constants": hoist_constants(model), "opset": _raise_opset(model)}  # fmt: skip
    counts["constants_folded"] = _fold_constant_moves(model)
    tidy(model)  # an Identity of an initializer (TorchScript's shared constants) is bypassed
    counts["batchnorms_folded"] = _fold_batchnorms(model)
    counts["scale_shifts_folded"] = _fold_scale_shifts(model)
    counts["hard_swishes"] = _fuse_hard_swishes(model)
    if _opset(model) != opset:
        counts["opset"] = _opset(model) or 0
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        pairs = zip([model.graph, *(g for _, g in if_branches(model.graph))],
                    [inferred.graph, *(g for _, g in if_branches(inferred.graph))], strict=True)  # fmt: skip
        for mine, theirs in pairs:
            del mine.value_info[:]
            mine.value_info.extend(theirs.value_info)
    except Exception:  # shape inference is a convenience: a model it cannot read still quantizes
        counts["shapes_unknown"] = 1
    return counts


def _initializers_not_inputs(model: onnx.ModelProto) -> int:
    """Graph inputs that name an initializer are dropped (IR version 3 listed every initializer among the inputs):
    they are constants, not data a caller feeds, and ONNX Runtime folds no constant it could be fed. The IR version
    is raised to 4, the first that allows it. Returns how many inputs were dropped."""
    constants = {t.name for t in model.graph.initializer}
    kept = [value for value in model.graph.input if value.name not in constants]
    dropped = len(model.graph.input) - len(kept)
    if dropped:
        del model.graph.input[:]
        model.graph.input.extend(kept)
    model.ir_version = max(model.ir_version, 4)
    return dropped


def _constants_to_initializers(model: onnx.ModelProto) -> int:
    """Every ``Constant`` node of the main graph holding a tensor becomes an initializer of the same name."""
    graph, moved = model.graph, []
    for node in graph.node:
        if node.op_type != "Constant" or len(node.output) != 1:
            continue
        value = next((a for a in node.attribute if a.name == "value"), None)
        if value is None or value.type != onnx.AttributeProto.TENSOR:
            continue
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value.t)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        moved.append(node)
    for node in moved:
        graph.node.remove(node)
    return len(moved)


#: ops that only move, select or retype data: one whose inputs are all constants is folded into its result
_MOVES = frozenset({"Slice", "Concat", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast",
                    "Gather", "Split"})  # fmt: skip


def _fold_constant_moves(model: onnx.ModelProto) -> int:
    """Each op that only moves data (:data:`_MOVES`) and reads constants alone, in the main graph or an ``If``
    branch, becomes its result, an initializer of the main graph (silero-vad slices and concatenates its LSTM
    weights at run time): a weight computed so is a constant, not an activation to calibrate. Never a result
    larger than its inputs. Returns how many ops were folded."""
    inits = {t.name: t for t in model.graph.initializer}
    folded, found = 0, True
    while found:
        found = False
        for graph in reversed([model.graph, *(g for _, g in if_branches(model.graph))]):  # inner graphs first
            for node in [n for n in graph.node if _foldable(n, inits)]:
                values = {name: numpy_helper.to_array(inits[name]) for name in node.input if name}
                results = _evaluate(node, values, model.opset_import)
                if results is None or sum(r.size for r in results) > sum(v.size for v in values.values()):
                    continue
                for name, result in zip(node.output, results, strict=True):
                    inits[name] = numpy_helper.from_array(np.asarray(result), name)
                    model.graph.initializer.append(inits[name])
                graph.node.remove(node)
                folded, found = folded + 1, True
    return folded


def _foldable(node: Any, inits: dict[str, Any]) -> bool:
    present = [name for name in node.input if name]
    return node.op_type in _MOVES and node.domain in ("", "ai.onnx") and bool(present) and all(
        name in inits for name in present)  # fmt: skip


def _evaluate(node: Any, values: dict[str, np.ndarray], opsets: Any) -> list[np.ndarray] | None:
    """``node``'s outputs on ``values`` (ONNX's reference evaluator), or None when it cannot compute them."""
    from onnx.reference import ReferenceEvaluator

    inputs = [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype),
                                                 value.shape) for name, value in values.items()]  # fmt: skip
    outputs = [onnx.ValueInfoProto(name=name) for name in node.output]
    graph = onnx.helper.make_graph([node], "fold", inputs, outputs)
    try:
        return list(ReferenceEvaluator(onnx.helper.make_model(graph, opset_imports=list(opsets))).run(None, values))
    except Exception:  # an op the evaluator cannot run stays in the graph
        return None


def _opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain opset (None when it imports none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _raise_opset(model: onnx.ModelProto, minimum: int = _MIN_OPSET) -> int:
    """Raise the default-domain opset to ``minimum`` when lower (per-channel Q/DQ need 13); the new opset, else 0."""
    current = _opset(model)
    if current is None or current >= minimum:
        return 0
    converted = onnx.version_converter.convert_version(model, minimum)
    converted.ir_version = max(converted.ir_version, onnx.helper.find_min_ir_version_for(list(converted.opset_import)))
    model.CopyFrom(converted)
    return minimum


def _fold_batchnorms(model: onnx.ModelProto) -> int:
    """``Conv -> BatchNormalization`` (the conv read only by the BN, constant weights) becomes one Conv."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: Counter[str] = Counter(name for node in graph.node for name in node.input)
    outputs = {o.name for o in graph.output}
    producer = {out: node for node in graph.node for out in node.output}
    folded = []
    for bn in graph.node:
        conv = producer.get(bn.input[0]) if bn.op_type == "BatchNormalization" else None
        if conv is None or conv.op_type != "Conv" or readers[conv.output[0]] != 1 or conv.output[0] in outputs:
            continue
        if len(bn.output) != 1 or any(name not in inits for name in bn.input[1:5]):
            continue
        if not _constant_weights(conv, inits):
            continue
        _fold_one(graph, inits, conv, bn)
        folded.append(bn)
    for bn in folded:
        graph.node.remove(bn)
    return len(folded)


def _fold_one(graph: onnx.GraphProto, inits: dict[str, Any], conv: Any, bn: Any) -> None:
    scale, bias, mean, var = (numpy_helper.to_array(inits[name]).astype(np.float64) for name in bn.input[1:5])
    eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    factor = scale / np.sqrt(var + eps)
    weight = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
    old_bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 and \
        conv.input[2] in inits else np.zeros_like(mean)  # fmt: skip
    weight = weight * factor.reshape(-1, *([1] * (weight.ndim - 1)))
    new_bias = (old_bias - mean) * factor + bias
    dtype = numpy_helper.to_array(inits[conv.input[1]]).dtype
    names = (f"{conv.output[0]}_folded_weight", f"{conv.output[0]}_folded_bias")
    graph.initializer.extend([numpy_helper.from_array(weight.astype(dtype), names[0]),
                              numpy_helper.from_array(new_bias.astype(dtype), names[1])])  # fmt: skip
    del conv.input[1:]
    conv.input.extend(names)
    conv.output[0] = bn.output[0]


def _per_channel(value: np.ndarray | None, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per output channel of a conv whose output has ``rank`` axes (a constant of one
    element, or of ``channels`` elements along axis 1 of the output, broadcast right-aligned), else None."""
    if value is None or value.ndim > rank:
        return None
    if value.size == 1:
        return np.full(channels, value.reshape(()), np.float64)
    shape = (1,) * (rank - value.ndim) + value.shape
    if shape[1] != channels or any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    return value.reshape(channels).astype(np.float64)


def _constant_operand(node: Any, tensor: str, inits: dict[str, Any]) -> np.ndarray | None:
    """The constant operand of a binary ``node`` whose other operand is ``tensor``, or None."""
    if len(node.input) != 2 or tensor not in node.input:
        return None
    other = node.input[1] if node.input[0] == tensor else node.input[0]
    return numpy_helper.to_array(inits[other]) if other in inits and other != tensor else None


def _fold_scale_shifts(model: onnx.ModelProto) -> int:
    """``Conv -> Mul(c)``, ``Conv -> Add(d)`` and ``Conv -> Mul(c) -> Add(d)``, with ``c`` and ``d`` constants per
    tensor or per output channel and each tensor on the way read once, become one Conv (weight ``W * c``, bias
    ``b * c + d``); returns how many ops were folded."""
    graph, inits, readers = model.graph, initializer_map(model), consumers(model)
    outputs = {o.name for o in graph.output}
    folded: list[Any] = []
    for conv in list(graph.node):
        if conv.op_type != "Conv" or not _constant_weights(conv, inits):
            continue
        tail, scale, shift = _scale_shift_tail(conv, numpy_helper.to_array(inits[conv.input[1]]).shape, readers,
                                               inits, outputs)  # fmt: skip
        if tail:
            _fold_affine(graph, inits, conv, scale, shift, tail[-1].output[0])
            folded += tail
    for node in folded:
        graph.node.remove(node)
    return len(folded)


def _constant_weights(conv: Any, inits: dict[str, Any]) -> bool:
    """Are the conv's weight and bias (when it has one) constants?"""
    bias = conv.input[2] if len(conv.input) > 2 else ""
    return conv.input[1] in inits and (not bias or bias in inits)


def _scale_shift_tail(
    conv: Any, weight_shape: tuple[int, ...], readers: dict[str, list[Any]], inits: dict[str, Any], outputs: set[str]
) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """The ``Mul`` then ``Add`` after ``conv`` that fold into it, with the scale and shift per output channel."""
    channels, rank = weight_shape[0], len(weight_shape)
    scale, shift, tail, tensor = np.ones(channels), np.zeros(channels), [], conv.output[0]
    for op_type in ("Mul", "Add"):
        users = readers.get(tensor, [])
        if len(users) != 1 or users[0].op_type != op_type or tensor in outputs:
            continue
        value = _per_channel(_constant_operand(users[0], tensor, inits), rank, channels)
        if value is None:
            break
        scale, shift = (value, shift) if op_type == "Mul" else (scale, value)
        tail.append(users[0])
        tensor = users[0].output[0]
    return tail, scale, shift


def _fold_affine(graph: onnx.GraphProto, inits: dict[str, Any], conv: Any, scale: np.ndarray, shift: np.ndarray,
                 output: str) -> None:  # fmt: skip
    weight = numpy_helper.to_array(inits[conv.input[1]])
    has_bias = len(conv.input) > 2 and conv.input[2]
    bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if has_bias else np.zeros(weight.shape[0])
    new_weight = weight.astype(np.float64) * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    new_bias = (bias * scale + shift).astype(weight.dtype)
    names = (f"{output}_folded_weight", f"{output}_folded_bias")
    graph.initializer.extend([numpy_helper.from_array(new_weight.astype(weight.dtype), names[0]),
                              numpy_helper.from_array(new_bias, names[1])])  # fmt: skip
    del conv.input[1:]
    conv.input.extend(names)
    conv.output[0] = output


def _scalar(tensor: str, inits: dict[str, Any]) -> float | None:
    """The value of ``tensor`` when it is a constant of one element, else None."""
    proto = inits.get(tensor)
    value = numpy_helper.to_array(proto) if proto is not None else None
    return float(value.reshape(())) if value is not None and value.size == 1 else None


def _hard_swish_chain(add: Any, readers: dict[str, list[Any]], inits: dict[str, Any]) -> tuple[str, list[Any]] | None:
    """``x`` and the four nodes of ``Add(x, 3) -> Clip(0, 6) -> Mul(x, .) -> Div(., 6)`` (or ``Mul(., 1/6)``)
    starting at ``add``, each intermediate read once; else None."""
    values = [_scalar(name, inits) for name in add.input]
    if add.op_type != "Add" or len(add.input) != 2 or 3.0 not in values or None not in values:
        return None
    x: str = add.input[values.index(None)]
    chain, tensor = [add], add.output[0]
    for op_type in ("Clip", "Mul", "Div"):
        users = readers.get(tensor, [])
        if len(users) != 1:
            return None
        node = users[0]
        if not _hard_swish_step(node, op_type, x, tensor, inits):
            return None
        chain.append(node)
        tensor = node.output[0]
    return x, chain


def _hard_swish_step(node: Any, op_type: str, x: str, tensor: str, inits: dict[str, Any]) -> bool:
    if op_type == "Clip":
        bounds = [_scalar(name, inits) for name in node.input[1:3]]
        return node.op_type == "Clip" and bounds == [0.0, 6.0]
    if op_type == "Mul":
        return node.op_type == "Mul" and sorted(node.input) == sorted([x, tensor])
    if node.op_type == "Div":
        return node.input[0] == tensor and _scalar(node.input[1], inits) == 6.0
    other = [_scalar(name, inits) for name in node.input if name != tensor]
    return node.op_type == "Mul" and len(other) == 1 and other[0] is not None and abs(other[0] * 6.0 - 1.0) < 1e-6


def _fuse_hard_swishes(model: onnx.ModelProto) -> int:
    """Every written-out hard-swish becomes one ``HardSwish`` node (opset 14); returns how many."""
    graph, inits, readers = model.graph, initializer_map(model), consumers(model)
    outputs = {o.name for o in graph.output}
    chains = [c for c in (_hard_swish_chain(n, readers, inits) for n in graph.node) if c is not None]
    chains = [(x, nodes) for x, nodes in chains if not any(n.output[0] in outputs for n in nodes[:-1])]
    if not chains or _opset(model) is None:
        return 0
    try:
        _raise_opset(model, 14)
    except Exception:  # a graph ONNX's converter cannot take keeps its written-out hard-swishes
        return 0
    graph = model.graph  # the conversion rebuilt the graph: its nodes are found again by their outputs
    for x, nodes in chains:
        last = nodes[-1].output[0]
        found = [n for n in graph.node if n.output and n.output[0] in {m.output[0] for m in nodes}]
        at = list(graph.node).index(found[-1])
        graph.node.insert(at, onnx.helper.make_node("HardSwish", [x], [last], name=f"{last}/HardSwish"))
        for node in found:
            graph.node.remove(node)
    return len(chains)

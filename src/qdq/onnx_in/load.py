"""An FP32 ONNX file as the ONNX front end takes it: loaded, checked, and prepared for placement.

:func:`load_float_model` reads a path (external data included, so files over 2 GB load) or takes a
``ModelProto``, and refuses, with one clear error, what cannot be quantized again: a file that already holds Q/DQ
or QOperator nodes. :func:`prepare` then makes the graph the view reads:

* weights held in ``Constant`` nodes (Paddle2ONNX writes every weight that way) become initializers, and an
  ``Identity`` of an initializer (TorchScript's shared constants) is bypassed, so that a weight is a constant input
  of its op whatever the exporter did;
* a ``BatchNormalization`` reading a ``Conv`` (read only by it) is folded into the conv's weight and bias, as every
  runtime folds it (per-channel weights are then quantized after the fold, as the runtime multiplies them);
* the opset is raised to 13 when it is lower (per-channel ``DequantizeLinear`` needs an ``axis``);
* shapes are inferred where ONNX can (dynamic axes stay symbolic).

Control flow (``If``, ``Loop``, ``Scan``) and operators of custom domains are left as they are: the view sees
them as ops no rule knows, so they stay float, and the report lists them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from qdq.errors import QdqConfigError
from qdq.graphs.onnx import tidy

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
    found = Counter(n.op_type for n in _all_nodes(proto.graph) if n.op_type in QUANTIZED_OPS)
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
    counts = {"constant_weights": _constants_to_initializers(model), "opset": _raise_opset(model)}
    tidy(model)  # an Identity of an initializer (TorchScript's shared constants) is bypassed
    counts["batchnorms_folded"] = _fold_batchnorms(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        del model.graph.value_info[:]
        model.graph.value_info.extend(inferred.graph.value_info)
    except Exception:  # shape inference is a convenience: a model it cannot read still quantizes
        counts["shapes_unknown"] = 1
    return counts


def _all_nodes(graph: onnx.GraphProto) -> list[Any]:
    """Every node of ``graph`` and of its subgraphs (the branches of ``If``, the bodies of ``Loop``)."""
    nodes = list(graph.node)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                nodes += _all_nodes(attribute.g)
            for sub in attribute.graphs:
                nodes += _all_nodes(sub)
    return nodes


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


def _raise_opset(model: onnx.ModelProto) -> int:
    """Raise the default-domain opset to 13 when lower (per-channel Q/DQ need it); the new opset, or 0."""
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current is None or current >= _MIN_OPSET:
        return 0
    converted = onnx.version_converter.convert_version(model, _MIN_OPSET)
    model.CopyFrom(converted)
    return _MIN_OPSET


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
        if len(bn.output) != 1 or any(name not in inits for name in bn.input[1:5]) or conv.input[1] not in inits:
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

"""The Q/DQ nodes qdq exported, read back: each tagged with the quantizer it comes from.

After export each ``QuantizeLinear`` / ``DequantizeLinear`` node qdq emitted carries the name of the quantizer it
comes from, as node metadata ``qdq.quantizer`` (and in its node name). :func:`qdq_sites` lists them; the
calibration cache writer, the onnxruntime rewrite and the tests read that list.

Imports neither torch nor (at import time) onnx or onnx_ir.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.graphs.ir_graph import attr, const, name_of, remove, run_on_graph, source, take_place
from qdq.graphs.onnx import on_ir

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = [
    "INPUT_SCALE_KEY",
    "MERGED_KEY",
    "QUANTIZER_KEY",
    "TAG_DOMAIN",
    "TAG_OP",
    "QdqSite",
    "add_quantizer_names",
    "annotate_quantizers",
    "qdq_sites",
    "quantizer_names",
    "record_merged",
]

#: Node metadata key holding the quantizer's module name.
QUANTIZER_KEY = "qdq.quantizer"
#: Node metadata key listing every quantizer a Q/DQ pair stands for (comma-separated), when several
#: identical quantizers of one tensor were merged into it.
MERGED_KEY = "qdq.quantizers"
#: QuantizeLinear metadata: the constant factor the node applies to its input before quantizing (a power-of-two
#: ``Mul`` folded into its scale by a rewrite): the quantizer's input is ``input * factor``.
INPUT_SCALE_KEY = "qdq.input_scale"
#: Domain and op of the marker node the TorchScript exporter path emits after each Q/DQ pair
#: (``qdq::QuantizerTag``, removed by :func:`annotate_quantizers`).
TAG_DOMAIN = "qdq"
TAG_OP = f"{TAG_DOMAIN}::QuantizerTag"


@dataclass
class QdqSite:
    """One quantizer in the graph.

    Attributes:
        quantizer: module name of the quantizer in the PyTorch model.
        input: name of the float tensor that is quantized (for a weight folded to int8, the int8 initializer).
        output: name of the dequantized float tensor.
        quantize: the QuantizeLinear node (an ``onnx_ir.Node``), or None when the input is a pre-quantized
            initializer.
        dequantize: the DequantizeLinear node (an ``onnx_ir.Node``).
        step: float32 step, ONNX's ``y_scale`` (0-d or ``[C]``).
        zero_point: zero point (int8/uint8, same shape as ``step``).
        axis: channel axis of a per-channel scale, None per tensor.
        quantizers: every quantizer this pair stands for (``quantizer`` first; more when identical
            quantizers of one tensor were merged).
        input_scale: the factor the QuantizeLinear applies to ``input`` before quantizing (a power-of-two
            ``Mul`` a rewrite folded into its scale, :data:`INPUT_SCALE_KEY`): the quantizer's input is
            ``input * input_scale``; 1.0 otherwise.
    """

    quantizer: str
    input: str
    output: str
    quantize: Any
    dequantize: Any
    step: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    quantizers: tuple[str, ...] = ()
    input_scale: float = 1.0


def _array(value: ir.Value | None) -> np.ndarray:
    found = const(value)
    if found is None:
        raise KeyError(f"Q/DQ parameter {name_of(value, '')!r} is not a constant")
    return found


def _meta(node: Any, key: str) -> str | None:
    if isinstance(node.metadata_props, dict):  # an onnx_ir node
        return node.metadata_props.get(key)
    for prop in node.metadata_props:  # an onnx.NodeProto
        if prop.key == key:
            return prop.value
    return None


def _take_tags(model: ir.Model) -> None:
    """Turn the TorchScript path's ``qdq::QuantizerTag`` marker nodes into metadata on their Q/DQ pair."""
    markers = [n for n in model.graph if n.domain == TAG_DOMAIN]
    for marker in markers:
        tag, tagged = attr(marker, "quantizer"), marker.outputs[0]
        dq = source(marker.inputs[0])
        assert dq is not None  # the exporter writes each marker after the DequantizeLinear it tags
        out = dq.outputs[0]
        take_place(tagged, out)  # the DQ writes the marker's tensor
        remove(model.graph, [marker])
        dq.metadata_props[QUANTIZER_KEY] = tag
        q = source(dq.inputs[0])
        if q is not None and q.op_type == "QuantizeLinear":
            q.metadata_props[QUANTIZER_KEY] = tag
    model.opset_imports.pop(TAG_DOMAIN, None)


def _annotate(model: ir.Model) -> None:
    _take_tags(model)
    count: Counter[tuple[str, str]] = Counter()
    for node in model.graph:
        owner = node.metadata_props.get(QUANTIZER_KEY)
        if owner is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        key = (owner, node.op_type)
        node.name = f"{owner}/{node.op_type}" + (f"_{count[key]}" if count[key] else "")
        count[key] += 1


def annotate_quantizers(model: onnx.ModelProto) -> None:
    """Tag each Q/DQ node with its quantizer (metadata ``qdq.quantizer``) and name it after the quantizer.

    Nodes are named ``<quantizer>/QuantizeLinear`` and ``<quantizer>/DequantizeLinear`` (``_1``, ``_2``...
    for a quantizer called more than once).
    """
    on_ir(model, _annotate)


def quantizer_names(node: Any) -> list[str]:
    """Every quantizer a tagged Q or DQ node (onnx_ir or protobuf) stands for (empty for an untagged node)."""
    raw = _meta(node, MERGED_KEY) or _meta(node, QUANTIZER_KEY)
    return raw.split(",") if raw else []


def add_quantizer_names(node: ir.Node, names: Iterable[str]) -> None:
    """Append ``names`` to the quantizers a tagged onnx_ir node stands for."""
    merged = list(dict.fromkeys([*quantizer_names(node), *names]))
    if merged:
        node.metadata_props[MERGED_KEY] = ",".join(merged)


def record_merged(model: onnx.ModelProto, merged: Mapping[str, Iterable[str]]) -> None:
    """Add quantizer names to the ``qdq.quantizers`` list of the pairs tagged with each key of ``merged``."""

    def record(graph: ir.Graph) -> None:
        for node in graph:
            owner = node.metadata_props.get(QUANTIZER_KEY)
            if owner is not None and owner in merged:
                add_quantizer_names(node, merged[owner])

    if merged:
        run_on_graph(model, record)


def qdq_sites(model: onnx.ModelProto) -> list[QdqSite]:
    """Every quantizer occurrence in a graph exported by qdq, in graph order. The sites' nodes are those of an
    onnx_ir copy of ``model`` (its tensors shared, not copied)."""
    import onnx_ir as ir

    sites = []
    for node in ir.serde.deserialize_model(model).graph:
        quantizer = node.metadata_props.get(QUANTIZER_KEY)
        if node.op_type != "DequantizeLinear" or quantizer is None:
            continue
        q = source(node.inputs[0])
        q = q if q is not None and q.op_type == "QuantizeLinear" else None
        scale = _array(node.inputs[1])
        sites.append(
            QdqSite(
                quantizer=quantizer,
                input=name_of((q or node).inputs[0], ""),
                output=name_of(node.outputs[0], ""),
                quantize=q,
                dequantize=node,
                step=scale,
                zero_point=_array(node.inputs[2]),
                axis=attr(node, "axis") if scale.ndim == 1 else None,
                quantizers=tuple(quantizer_names(node)),
                input_scale=float(q.metadata_props.get(INPUT_SCALE_KEY) or 1.0) if q is not None else 1.0,
            )
        )
    return sites

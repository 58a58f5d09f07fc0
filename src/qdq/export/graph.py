"""Reading and tidying the Q/DQ nodes of an exported ONNX graph.

After export each ``QuantizeLinear`` / ``DequantizeLinear`` node qdq emitted carries the name of the
quantizer it comes from, as node metadata ``qdq.quantizer`` (and in its node name). :func:`qdq_sites`
lists them; the calibration cache writer, the onnxruntime rewrite and the tests read that list.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdq.atomic import write_bytes_atomic

if TYPE_CHECKING:
    import numpy as np
    import onnx

__all__ = [
    "MERGED_KEY",
    "QUANTIZER_KEY",
    "QdqSite",
    "add_quantizer_names",
    "annotate_quantizers",
    "atomic_save",
    "consumers",
    "initializer_map",
    "qdq_sites",
    "quantizer_names",
    "record_merged",
    "rename_io",
    "tidy",
]

#: Node metadata key holding the quantizer's module name.
QUANTIZER_KEY = "qdq.quantizer"
#: Node metadata key listing every quantizer a Q/DQ pair stands for (comma-separated), when several
#: identical quantizers of one tensor were merged into it.
MERGED_KEY = "qdq.quantizers"


@dataclass
class QdqSite:
    """One quantizer in the graph.

    Attributes:
        quantizer: module name of the quantizer in the PyTorch model.
        input: name of the float tensor that is quantized (for a weight folded to int8, the int8 initializer).
        output: name of the dequantized float tensor.
        quantize: the QuantizeLinear node, or None when the input is a pre-quantized initializer.
        dequantize: the DequantizeLinear node.
        scale: float32 step (0-d or ``[C]``).
        zero_point: zero point (int8/uint8, same shape as ``scale``).
        axis: channel axis of a per-channel scale, None per tensor.
        quantizers: every quantizer this pair stands for (``quantizer`` first; more when identical
            quantizers of one tensor were merged).
    """

    quantizer: str
    input: str
    output: str
    quantize: Any
    dequantize: Any
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    quantizers: tuple[str, ...] = ()


def initializer_map(model: onnx.ModelProto) -> dict[str, Any]:
    """Name -> TensorProto of initializers and of the outputs of Constant nodes."""
    table: dict[str, Any] = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            table[node.output[0]] = node.attribute[0].t
    return table


def consumers(model: onnx.ModelProto) -> dict[str, list[Any]]:
    """Tensor name -> nodes that read it."""
    table: dict[str, list[Any]] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            if name:
                table[name].append(node)
    return table


def _array(tables: Mapping[str, Any], name: str) -> np.ndarray:
    from onnx import numpy_helper

    if name not in tables:
        raise KeyError(f"Q/DQ parameter {name!r} is not a constant")
    return numpy_helper.to_array(tables[name])


def _axis(node: Any) -> int | None:
    for attr in node.attribute:
        if attr.name == "axis":
            return int(attr.i)
    return None


def _meta(node: Any, key: str) -> str | None:
    for prop in node.metadata_props:
        if prop.key == key:
            return prop.value
    return None


def _set_meta(node: Any, key: str, value: str) -> None:
    for prop in node.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    prop = node.metadata_props.add()
    prop.key, prop.value = key, value


def _take_tags(model: onnx.ModelProto) -> None:
    """Turn the TorchScript path's ``qdq::QuantizerTag`` marker nodes into metadata on their Q/DQ pair."""
    from qdq.export._ops import TAG_DOMAIN

    producers = {out: node for node in model.graph.node for out in node.output}
    markers = [n for n in model.graph.node if n.domain == TAG_DOMAIN]
    for marker in markers:
        tag = next(a.s.decode() for a in marker.attribute if a.name == "quantizer")
        dq = producers[marker.input[0]]
        dq.output[0] = marker.output[0]  # the marker was the DQ output's only reader
        _set_meta(dq, QUANTIZER_KEY, tag)
        q = producers.get(dq.input[0])
        if q is not None and q.op_type == "QuantizeLinear":
            _set_meta(q, QUANTIZER_KEY, tag)
    doomed = {id(m) for m in markers}
    kept = [n for n in model.graph.node if id(n) not in doomed]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    imports = [o for o in model.opset_import if o.domain != TAG_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)


def annotate_quantizers(model: onnx.ModelProto) -> None:
    """Tag each Q/DQ node with its quantizer (metadata ``qdq.quantizer``) and name it after the quantizer.

    Nodes are named ``<quantizer>/QuantizeLinear`` and ``<quantizer>/DequantizeLinear`` (``_1``, ``_2``...
    for a quantizer called more than once).
    """
    _take_tags(model)
    count: Counter[tuple[str, str]] = Counter()
    for node in model.graph.node:
        owner = _meta(node, QUANTIZER_KEY)
        if owner is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        key = (owner, node.op_type)
        node.name = f"{owner}/{node.op_type}" + (f"_{count[key]}" if count[key] else "")
        count[key] += 1


def quantizer_names(node: Any) -> list[str]:
    """Every quantizer a tagged Q or DQ node stands for (empty for an untagged node)."""
    raw = _meta(node, MERGED_KEY) or _meta(node, QUANTIZER_KEY)
    return raw.split(",") if raw else []


def add_quantizer_names(node: Any, names: Iterable[str]) -> None:
    """Append ``names`` to the quantizers a tagged node stands for."""
    merged = list(dict.fromkeys([*quantizer_names(node), *names]))
    if merged:
        _set_meta(node, MERGED_KEY, ",".join(merged))


def record_merged(model: onnx.ModelProto, merged: Mapping[str, Iterable[str]]) -> None:
    """Add quantizer names to the ``qdq.quantizers`` list of the pairs tagged with each key of ``merged``."""
    for node in model.graph.node:
        owner = _meta(node, QUANTIZER_KEY)
        if owner in merged:
            add_quantizer_names(node, merged[owner])


def qdq_sites(model: onnx.ModelProto) -> list[QdqSite]:
    """Every quantizer occurrence in a graph exported by qdq, in graph order."""
    tables = initializer_map(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    sites = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or _meta(node, QUANTIZER_KEY) is None:
            continue
        q = producers.get(node.input[0])
        q = q if q is not None and q.op_type == "QuantizeLinear" else None
        scale = _array(tables, node.input[1])
        sites.append(
            QdqSite(
                quantizer=_meta(node, QUANTIZER_KEY) or "",
                input=q.input[0] if q is not None else node.input[0],
                output=node.output[0],
                quantize=q,
                dequantize=node,
                scale=scale,
                zero_point=_array(tables, node.input[2]),
                axis=_axis(node) if scale.ndim == 1 else None,
                quantizers=tuple(quantizer_names(node)),
            )
        )
    return sites


def tidy(model: onnx.ModelProto) -> None:
    """Exact clean-ups: ``Identity`` of an initializer is bypassed; unused Constants and initializers go."""
    constants = {t.name for t in model.graph.initializer}
    outputs = {v.name for v in model.graph.output}
    rename = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Identity" and n.input[0] in constants and n.output[0] not in outputs
    }
    kept = [n for n in model.graph.node if not (n.op_type == "Identity" and n.output[0] in rename)]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    used = {name for node in kept for name in node.input} | outputs
    kept = [n for n in kept if n.op_type != "Constant" or n.output[0] in used]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    initializers = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)


def rename_io(model: onnx.ModelProto, inputs: Iterable[str], outputs: Iterable[str]) -> None:
    """Rename the graph's inputs and outputs (in order) and every reference to them."""
    mapping: dict[str, str] = {}
    for value, new in zip(model.graph.input, inputs):
        mapping[value.name] = new
    for value, new in zip(model.graph.output, outputs):
        mapping[value.name] = new
    mapping = {old: new for old, new in mapping.items() if old != new}
    if not mapping:
        return
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        value.name = mapping.get(value.name, value.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = mapping.get(name, name)


def atomic_save(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` as one self-contained file: a temporary file in the same folder, then ``os.replace``."""
    write_bytes_atomic(path, model.SerializeToString())

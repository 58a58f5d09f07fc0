"""``method="auto"`` for ONNX files: per quantizer, the candidate range whose reading ops compute closest to float.

The PyTorch path's ``auto`` (:mod:`qdq.workflow.auto_calibration`) on an ONNX graph, label-free:

1. the candidates are the ranges of :data:`~qdq.workflow.auto_calibration.CANDIDATES` (max, mse, entropy,
   percentiles), from the histograms calibration collected;
2. each op that reads a quantized activation is run alone on ONNX Runtime (a one-node graph), on the first
   calibration batches' tensors, its weights quantized as in the file, that input fake-quantized with each
   candidate in turn (its other inputs float); the candidate with the smallest squared error of the op's output
   against the float op's wins (summed over the quantizer's reading ops; a tie keeps the earlier candidate, max
   first);
3. a model check: the whole Q/DQ graph with the chosen ranges and with every range at max is run on the same
   batches; the ranges whose model output is closer to the float model's are kept (as the PyTorch path does).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qdq.graphs.view import GraphView, Quantizer
from qdq.onnx_in.calibrate import Statistics, ort_session, weight_ranges
from qdq.onnx_in.materialize import write_qdq
from qdq.workflow.auto_calibration import CANDIDATES
from qdq.workflow.progress import Progress, counter

__all__ = ["select"]


def select(
    model: onnx.ModelProto,
    view: GraphView,
    statistics: Statistics,
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int | None = None,
    progress: Progress = True,
) -> dict[int, np.ndarray]:
    """The ``auto`` range of every activation quantizer of ``view`` (by ``id``), scored on ``batches``."""
    candidates = [statistics.ranges(method, **options) for method, options in CANDIDATES]
    chosen = {key: candidates[0][key] for key in statistics.calibrators}  # max until scored
    if not batches:
        return chosen
    with tempfile.TemporaryDirectory(prefix="qdq-auto-") as folder:
        work = Path(folder)
        tensors = _probe(model, view, statistics, batches, work, threads)
        weights = _dequantized_weights(model, view)
        bar = counter(progress, "auto: scoring ranges", len(chosen))
        for key, quantizer in statistics.quantizers.items():
            chosen[key] = _best(quantizer, [c[key] for c in candidates], tensors, weights, model, work, threads)
            bar.update()
        bar.close()
        return _model_check(model, view, chosen, candidates[0], batches, work, threads)


def _readers(quantizer: Quantizer, nodes: Sequence[Any]) -> list[tuple[Any, int]]:
    """``(node, view input index)`` of the ops reading the quantizer's sites that can run alone (not a SiLU's
    pair, no subgraph)."""
    found = []
    for site in quantizer.sites:
        found += [(site.reader, site.index)] if site.reader is not None else list(site.value.readers)
    return [(nodes[op.ref], i) for op, i in found if not isinstance(op.ref, tuple) and _scorable(nodes[op.ref])]


def _scorable(node: Any) -> bool:
    return not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _probe(model: onnx.ModelProto, view: GraphView, statistics: Statistics, batches: Sequence[Mapping[str, Any]],
           work: Path, threads: int | None) -> list[dict[str, np.ndarray]]:  # fmt: skip
    """The float model's tensors every scored op reads, per batch."""
    constants = {t.name for t in model.graph.initializer}
    nodes = list(model.graph.node)
    readers = [node for q in statistics.quantizers.values() for node, _ in _readers(q, nodes)]
    wanted = sorted({name for node in readers for name in node.input if name and name not in constants})
    wanted += sorted({name for node in readers for name in node.output})
    wanted = list(dict.fromkeys(wanted))
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output} | {i.name for i in probe.graph.input}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in wanted if n not in present)  # typed by ORT
    session = ort_session(probe, work, threads)
    inputs = [i.name for i in model.graph.input if i.name not in constants]
    found = []
    for batch in batches:
        feed = {name: np.asarray(batch[name]) for name in inputs} if isinstance(batch, Mapping) else \
            {inputs[0]: np.asarray(batch)}  # fmt: skip
        available = [n for n in wanted if n not in feed]
        found.append({**feed, **dict(zip(available, session.run(available, feed)))})
    return found


def _dequantized_weights(model: onnx.ModelProto, view: GraphView) -> dict[str, np.ndarray]:
    """Every quantized weight as the file will hold it (max per channel, quantized and dequantized)."""
    ranges = weight_ranges(model, view, "max")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found = {}
    for quantizer in view.quantizers():
        if quantizer.per_channel and id(quantizer) in ranges:
            site = quantizer.sites[0]
            found[site.value.name] = _fake_weight(inits[site.value.name], ranges[id(quantizer)], site)
    return found


def _fake_weight(weight: np.ndarray, amax: np.ndarray, site: Any) -> np.ndarray:
    from qdq.onnx_in.view import weight_axis

    weight = weight.astype(np.float32)
    axis = weight_axis(site.reader, site.index) % weight.ndim
    shape = [1] * weight.ndim
    shape[axis] = -1
    step = np.where(amax <= 2.0**-24, np.float32(1), amax / np.float32(127)).astype(np.float32).reshape(shape)
    return (np.clip(np.rint(weight / step), -128, 127) * step).astype(np.float32)


def _fake(x: np.ndarray, amax: np.ndarray, unsigned: bool) -> np.ndarray:
    amax = np.float32(amax)
    step = np.float32(1) if amax <= 2.0**-24 else amax / np.float32(255 if unsigned else 127)
    low, high = (0, 255) if unsigned else (-128, 127)
    return (np.clip(np.rint(x.astype(np.float32) / step), low, high) * step).astype(np.float32)


def _best(
    quantizer: Quantizer,
    candidates: list[np.ndarray],
    tensors: list[dict[str, np.ndarray]],
    weights: dict[str, np.ndarray],
    model: onnx.ModelProto,
    work: Path,
    threads: int | None,
) -> np.ndarray:
    """The candidate with the smallest output error, summed over the quantizer's reading ops."""
    readers = _readers(quantizer, list(model.graph.node))
    if not readers:
        return candidates[0]
    errors = np.zeros(len(candidates))
    inits = {t.name: t for t in model.graph.initializer}
    for node, index in readers:
        single = _single_node(node, inits, weights, tensors[0], model.opset_import)
        session = ort_session(single, work, threads)
        name = node.input[_position(node, index)]
        for batch in tensors:
            feed = {n: batch[n] for n in node.input if n and n not in inits}
            reference = session.run(None, feed)[0]
            scale = float(np.mean(np.square(reference))) or 1.0
            for c, amax in enumerate(candidates):
                out = session.run(None, {**feed, name: _fake(batch[name], amax, quantizer.unsigned)})[0]
                errors[c] += float(np.mean(np.square(out - reference))) / scale
    return candidates[int(np.argmin(errors))]


def _position(node: Any, index: int) -> int:
    present = [i for i, name in enumerate(node.input) if name]
    return present[index]


def _single_node(node: Any, inits: Mapping[str, Any], weights: Mapping[str, np.ndarray], example: Mapping[str, Any],
                 opsets: Sequence[Any]) -> onnx.ModelProto:  # fmt: skip
    """A graph of ``node`` alone: its activations graph inputs (typed after ``example``'s arrays), its constants
    initializers (quantized weights as the file holds them)."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    graph_inputs, constants = [], []
    for name in dict.fromkeys(n for n in node.input if n):
        if name in inits:
            constants.append(numpy_helper.from_array(weights[name], name) if name in weights else inits[name])
        else:
            elem = helper.np_dtype_to_tensor_dtype(np.asarray(example[name]).dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, None))
    graph = helper.make_graph([copy], "single", graph_inputs, [onnx.ValueInfoProto(name=node.output[0])], constants)
    return helper.make_model(graph, opset_imports=list(opsets))


def _model_check(
    model: onnx.ModelProto,
    view: GraphView,
    chosen: dict[int, np.ndarray],
    at_max: dict[int, np.ndarray],
    batches: Sequence[Mapping[str, Any]],
    work: Path,
    threads: int | None,
) -> dict[int, np.ndarray]:
    """``chosen`` or all at max: the ranges whose whole Q/DQ graph computes closer to the float model."""
    if all(np.array_equal(chosen[k], at_max[k]) for k in chosen):
        return chosen
    weights = weight_ranges(model, view, "max")
    reference = _run(model, batches, work, threads)
    errors = []
    for ranges in (chosen, at_max):
        quantized = onnx.ModelProto()
        quantized.CopyFrom(model)
        write_qdq(quantized, view, {**ranges, **weights})
        outputs = _run(quantized, batches, work, threads)
        errors.append(sum(float(np.mean(np.square(o - r))) / (float(np.mean(np.square(r))) or 1.0)
                          for o, r in zip(outputs, reference)))  # fmt: skip
    return chosen if errors[0] <= errors[1] else dict(at_max)


def _run(model: onnx.ModelProto, batches: Sequence[Mapping[str, Any]], work: Path, threads: int | None) -> list:
    session = ort_session(model, work, threads)
    names = [i.name for i in session.get_inputs()]
    found = []
    for batch in batches:
        feed = {n: np.asarray(batch[n]) for n in names} if isinstance(batch, Mapping) else {names[0]: np.asarray(batch)}
        found += [np.asarray(o, np.float32) for o in session.run(None, feed)]
    return found

"""Cross-layer equalization in the ONNX front end (:mod:`qdq.workflow.equalization`): the pairs of the placed view
measured on the first calibration batches in one float run of the graph, and each scaling written into the
initializers of the two convolutions, in place, before their ranges are calibrated."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from qdq.graphs.onnx import feed_inputs
from qdq.graphs.view import GraphView
from qdq.onnx_in.auto import Quantized
from qdq.onnx_in.calibrate import WeightCache, batch_feed, ort_session, probe_model, weight_ranges
from qdq.workflow.auto_calibration import candidate
from qdq.workflow.equalization import (
    ChannelStats,
    Pair,
    Scaling,
    equalization_pairs,
    kept,
    levels_of,
    plan_scaling,
    scaled_first,
    scaled_second,
    stats_of,
)
from qdq.workflow.progress import Progress, counter

__all__ = ["equalize", "settle"]


def equalize(model: onnx.ModelProto, view: GraphView, batches: Sequence[Any], *, threads: int | None = None,
             progress: Progress = True, known: Sequence[Scaling] | None = None) -> list[Scaling]:  # fmt: skip
    """Equalize every pair of ``view`` (the placed view of ``model``) whose scaling predicts a gain, measured on
    ``batches``; ``model``'s initializers are rescaled in place. ``known``: the scalings of an earlier call on the
    same file (``result.equalized``), written again to the pairs still found, without measuring. Returns the
    scalings written."""
    inits = {t.name: t for t in model.graph.initializer}
    pairs = [pair for pair in equalization_pairs(view, placed=known is None) if _weights_in(pair, inits)]
    if known is not None:
        by_ops = {(s.first, s.second): s for s in known}
        return [_write(model, pair, by_ops[key], inits) for pair in pairs
                if (key := (pair.first.name, pair.second.name)) in by_ops]  # fmt: skip
    if not pairs or not batches:
        return []
    stats = _measure(model, view, pairs, batches, threads, progress)
    scalings = []
    for pair in pairs:
        weight = numpy_helper.to_array(inits[pair.second.inputs[1].name])
        scaling = plan_scaling(pair, stats[pair.value], weight, int(pair.second.attrs.get("group", 1)),
                               levels_of(view, pair))  # fmt: skip
        if scaling is not None:
            scaling.histogram = stats[pair.value].histogram
            scaling.originals = {name: numpy_helper.to_array(inits[name]).copy() for name in _weights(pair)}
            scalings.append(_write(model, pair, scaling, inits))
    return scalings


def settle(model: onnx.ModelProto, view: GraphView, scalings: list[Scaling], ranges: dict[int, np.ndarray],
           weights: dict[int, np.ndarray], scored: Sequence[Any], chosen: str, weight_method: str,
           threads: int | None = None, cache: WeightCache | None = None
           ) -> tuple[list[Scaling], dict[int, np.ndarray], dict[int, np.ndarray],
                      tuple[float, float] | None]:  # fmt: skip
    """Equalization kept unless the held-out samples clearly score it lower (:func:`qdq.workflow.equalization.kept`):
    ``model`` at its ``ranges`` (activations) and ``weights`` against its weights as they were, each pair's
    activation at the range the ``chosen`` method gives its own statistics. Where it is not kept, ``model``'s weights
    are put back in place (``cache``: the call's weight ranges, :data:`qdq.onnx_in.calibrate.WeightCache`). Returns
    the scalings kept, the activation and weight ranges to write, and both scores (None: not scored)."""
    read = [(q, s.histogram) for s in scalings if (q := _reader(view, s)) is not None and s.histogram is not None]
    if not read or not scored:  # every pair's reader left float by the stem: nothing int8 to score
        return scalings, ranges, weights, None
    method, options = candidate(chosen)
    amaxes = [method.compute_amax(histogram, **method.resolve_options(options)) for _, histogram in read]
    if any(amax is None for amax in amaxes):
        return scalings, ranges, weights, None
    quantizers = [q for q, _ in read]
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    _restore(plain, scalings)
    plain_ranges = {**ranges, **{id(q): np.asarray(amax, np.float32) for q, amax in zip(quantizers, amaxes)}}
    scores = (Quantized(model, view, {**ranges, **weights}, threads).meter(list(scored)).score(),
              Quantized(plain, view, {**plain_ranges, **weight_ranges(plain, view, weight_method, cache)},
                        threads).meter(list(scored)).score())  # fmt: skip
    if kept(*scores):
        return scalings, ranges, weights, scores
    _restore(model, scalings)
    return [], plain_ranges, weight_ranges(model, view, weight_method, cache), scores


def _reader(view: GraphView, scaling: Scaling) -> Any:
    """The quantizer through which ``scaling``'s second conv reads the activation (None: not in ``view``)."""
    op = next((op for op in view.ops if op.name == scaling.second), None)
    return None if op is None else view.quantizer_at(op, 0)


def _weights(pair: Pair) -> list[str]:
    return [pair.first.inputs[1].name, pair.second.inputs[1].name, *(v.name for v in pair.first.inputs[2:3])]


def _restore(model: onnx.ModelProto, scalings: Sequence[Scaling]) -> None:
    """The scalings' weights as they were, in ``model``'s initializers."""
    inits = {t.name: t for t in model.graph.initializer}
    for scaling in reversed(scalings):  # a conv of two pairs (one's second, the next's first): the earliest original
        for name, array in scaling.originals.items():
            _replace(inits[name], array)


def _weights_in(pair: Pair, inits: Mapping[str, onnx.TensorProto]) -> bool:
    """Are both weights (and ``first``'s bias) float32 initializers of the main graph (a branch's are, once
    prepared)?"""
    return all(name in inits and inits[name].data_type == onnx.TensorProto.FLOAT for name in _weights(pair))


def _measure(model: onnx.ModelProto, view: GraphView, pairs: Sequence[Pair], batches: Sequence[Any],
             threads: int | None, progress: Progress) -> dict[str, ChannelStats]:  # fmt: skip
    """Each pair's activation, per channel (axis 1: ONNX's ``[N, C, ...]``), over ``batches`` of the float graph."""
    stats = {pair.value: stats_of(view, pair) for pair in pairs}
    declared = feed_inputs(model)
    names = sorted(stats)
    bar = counter(progress, "equalization", len(batches))
    with tempfile.TemporaryDirectory(prefix="qdq-equalize-") as folder:
        session = ort_session(probe_model(model, names), Path(folder), threads)
        for number, batch in enumerate(batches):
            for name, tensor in zip(names, session.run(names, batch_feed(batch, declared, number)), strict=True):
                stats[name].update(np.asarray(tensor))
            bar.update()
    bar.close()
    return stats


def _write(model: onnx.ModelProto, pair: Pair, scaling: Scaling, inits: Mapping[str, onnx.TensorProto]) -> Scaling:
    """``scaling`` written into the pair's initializers; returns it."""
    weight = numpy_helper.to_array(inits[pair.first.inputs[1].name])
    bias = numpy_helper.to_array(inits[pair.first.inputs[2].name]) if len(pair.first.inputs) > 2 else None
    weight, bias = scaled_first(weight, bias, scaling.scales)
    _replace(inits[pair.first.inputs[1].name], weight)
    if bias is not None:
        _replace(inits[pair.first.inputs[2].name], bias)
    second = inits[pair.second.inputs[1].name]
    groups = int(pair.second.attrs.get("group", 1))
    _replace(second, scaled_second(numpy_helper.to_array(second), groups, scaling.scales))
    return scaling


def _replace(tensor: onnx.TensorProto, array: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), tensor.name))

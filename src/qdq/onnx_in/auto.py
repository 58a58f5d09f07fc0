"""``method="auto"`` for ONNX files: the calibration method chosen for the whole model by the fidelity of its outputs.

The PyTorch front end's ``auto`` (:mod:`qdq.workflow.auto_calibration`: the candidates, the fidelity, the choice and
the result are that module's) on an ONNX graph. :func:`qdq.onnx_in.calibrate.collect` holds one batch in four out
(their statistics apart, their feeds and the float outputs kept); here each candidate's ranges are written as Q/DQ
nodes into a copy of the prepared graph (the target's rewrite is not needed to compare ranges), which runs on ONNX
Runtime with its graph optimizations off (each Q and DQ computed as written: what the int8 kernels compute, on any
CPU) over the held-out batches; the chosen method's ranges then come from every batch's statistics. Bias correction
(on by default in :func:`qdq.quantize_onnx`) is measured last, on the placement and ranges the file will have (the
stem's too), and kept only where the held-out score rises with it (:func:`bias_corrected`); the file then takes the
shifts measured for that score (``AutoResult.bias_shifts``), not measured a second time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_session import ort_session, session_options
from qdq.graphs.onnx_tags import quantizer_names as tag_names
from qdq.graphs.view import GraphView, Quantizer
from qdq.onnx_in.bias_correction import correct_biases
from qdq.onnx_in.calibrate import Statistics
from qdq.onnx_in.materialize import activation_step, quantizer_names, write_qdq
from qdq.onnx_in.samples import pair_samples
from qdq.workflow.auto_calibration import (
    BIAS_CORRECTION,
    TIE_DB,
    AutoResult,
    FidelityMeter,
    candidate,
    candidates,
    choose,
    destructive,
)
from qdq.workflow.progress import Progress, counter
from qdq.workflow.refinement import Halves, Refinement, candidate_score, halves, refine

__all__ = ["Meter", "Quantized", "Scored", "bias_corrected", "held_out_halves", "select"]

Scored = list[tuple[dict[str, np.ndarray], list[np.ndarray]]]  # (held-out feed, the float model's outputs) pairs
Meter = Callable[[Mapping[int, np.ndarray], Scored], FidelityMeter]  # (activation ranges, pairs) -> fidelity


def select(
    model: onnx.ModelProto,
    view: GraphView,
    statistics: Statistics,
    weights: Mapping[int, np.ndarray],
    *,
    threads: int | None = None,
    progress: Progress = True,
) -> tuple[dict[int, np.ndarray], AutoResult, Meter | None]:
    """The ``auto`` activation ranges of ``view`` (by quantizer ``id``), what every candidate scored, and a meter of
    ``view`` at any activation ranges (``meter(ranges, scored)``: the one session that scored the candidates; None
    where it does not feed every quantizer's step).

    Args:
        model: the prepared float model ``view`` was built on (not modified).
        statistics: from :func:`qdq.onnx_in.calibrate.collect` with ``held_out``; its held-out statistics are merged
            into the others here.
        weights: the weight ranges the file will have (by quantizer ``id``).
    """
    started = time.perf_counter()
    names = quantizer_names(view)
    named = {names[key]: calibrator for key, calibrator in statistics.calibrators.items()}
    grid = candidates()
    scores: dict[str, float] = {}
    clipping: dict[str, list[str]] = {}
    bar = counter(progress, f"auto: scoring {len(grid)} methods", len(grid))
    kept: dict[str, dict[int, np.ndarray]] = {}
    by_half: dict[str, Halves | None] = {}  # the refinement starts from the chosen one's
    parts = held_out_halves(statistics)
    fed: _StepFed | None = None
    for method, options in grid:
        label = method.label(options)
        ranges = kept[label] = statistics.ranges(method.name, **options)
        clipping[label] = destructive(named, {names[key]: amax for key, amax in ranges.items()}, label)
        fed = fed or _StepFed(model, view, ranges, weights, threads)
        if fed.steps.keys() >= ranges.keys():  # every step fed: one session scores every candidate
            scores[label], by_half[label] = candidate_score(partial(fed.meter, ranges), parts, statistics.scored)
        else:
            scores[label] = _score(model, view, {**ranges, **weights}, statistics.scored, threads)
        bar.update()
    bar.close()
    chosen = choose(scores, clipping)
    selection, refinement = _refine(fed, kept, chosen, names, clipping, parts, by_half.get(chosen))
    held_out = bool(statistics.held_out)
    statistics.merge_held_out()
    result = AutoResult(chosen, scores, clipping, len(statistics.scored), held_out,
                        {"scoring": time.perf_counter() - started}, None, refinement)  # fmt: skip
    method, options = candidate(chosen)
    final = statistics.ranges(method.name, **options)
    for key, label in selection.items():
        if label != chosen:
            method, options = candidate(label)
            final.update(statistics.ranges(method.name, keys={key}, **options))
    return final, result, (fed.meter if fed is not None and fed.steps.keys() >= final.keys() else None)


def bias_corrected(model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray],
                   batches: Sequence[Mapping[str, np.ndarray]], scored: Scored, result: AutoResult,
                   threads: int | None = None) -> None:  # fmt: skip
    """Score ``model`` placed as ``view`` at ``ranges`` (activations and weights, the file's) with its biases corrected
    on ``batches`` (calibration samples not held out) against its score without (the stem's, where it was scored):
    the row ``"<chosen> + bias correction"`` of ``result.scores``, ``result.bias_correction`` (kept where it scores
    :data:`TIE_DB` higher), ``result.bias_base`` (the score without) and ``result.bias_shifts`` (the shifts the file
    then applies). ``model`` is not modified."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    result.bias_shifts = correct_biases(copy, view, ranges, list(batches), threads=threads, progress=False)
    if not any(shift.applied for shift in result.bias_shifts):
        return
    stem = result.stem
    before = (stem.scores[stem.levels] if stem is not None and stem.scores
              else _score(model, view, ranges, scored, threads))  # fmt: skip
    after = result.scores[f"{result.chosen} + {BIAS_CORRECTION}"] = _score(copy, view, ranges, scored, threads)
    result.bias_correction = _finite(after) >= _finite(before) + TIE_DB
    result.bias_base = before


def _selected(ranges: Mapping[str, Mapping[int, np.ndarray]], selection: Mapping[int, str],
              chosen: str) -> dict[int, np.ndarray]:  # fmt: skip
    """Each quantizer's range from its method in ``selection`` (``chosen`` where it has none)."""
    return {key: ranges[selection.get(key, chosen)][key] for key in ranges[chosen]}


def held_out_halves(statistics: Statistics) -> tuple[Scored, Scored] | None:
    """The held-out (feed, float outputs) pairs as two halves (:func:`qdq.workflow.refinement.halves`); one held-out
    batch is split by its samples where the model declares their axes (:class:`qdq.onnx_in.samples.SampleAxes`)."""
    axes = statistics.axes
    return halves(statistics.scored, partial(pair_samples, axes), axes.halves if axes is not None else None)


def _refine(fed: _StepFed | None, kept: Mapping[str, Mapping[int, np.ndarray]], chosen: str,
            names: Mapping[int, str], clipping: Mapping[str, list[str]], parts: tuple[Scored, Scored] | None,
            start: tuple[FidelityMeter, FidelityMeter] | None) -> tuple[dict[int, str], Refinement]:  # fmt: skip
    """:func:`qdq.workflow.refinement.refine` of the quantizers whose steps ``fed`` feeds (``start``: the chosen
    candidate's meters on the two halves, already run)."""
    if fed is None or parts is None:
        return refine(kept, chosen, None, names, clipping)
    steps, split = fed, parts

    def score(selection: Mapping[int, str], half: int) -> FidelityMeter:
        return steps.meter(_selected(kept, selection, chosen), split[half])

    return refine(kept, chosen, score, names, clipping, keys=list(fed.steps), start=start)


class _StepFed:
    """The model with Q/DQ written at ``base`` ranges, each activation quantizer's step a graph input (a step inside
    an ``If`` branch too: the branch reads it from the outer scope): one session scores any ranges of those
    quantizers (a quantizer whose pair another quantizer's Q/DQ serves, the same tensor on the same grid, is not
    fed)."""

    def __init__(self, model: onnx.ModelProto, view: GraphView, base: Mapping[int, np.ndarray],
                 weights: Mapping[int, np.ndarray], threads: int | None) -> None:  # fmt: skip
        quantized = onnx.ModelProto()
        quantized.CopyFrom(model)
        write_qdq(quantized, view, {**base, **weights})
        names = quantizer_names(view)
        by_name = {names[id(q)]: q for q in view.quantizers() if id(q) in base}
        self.steps: dict[int, tuple[list[str], float, bool]] = {}  # key -> (inputs, written / computed, unsigned)
        on_ir(quantized, lambda ir_model: self._feed_steps(ir_model.graph, by_name, base))
        self.session = ort_session(quantized, session_options(threads=threads, optimization_level="disable"))
        self.inputs = {i.name for i in self.session.get_inputs()}

    def _feed_steps(self, main: ir.Graph, by_name: Mapping[str, Quantizer], base: Mapping[int, np.ndarray]) -> None:
        """Each quantizer's own Q's step, an initializer of its graph, becomes an input of the main graph."""
        for node in ir.traversal.RecursiveGraphIterator(main):
            owner = by_name.get(next(iter(tag_names(node)), "")) if node.op_type == "QuantizeLinear" else None
            step = node.inputs[1] if owner is not None else None
            if owner is None or step is None or not step.is_initializer() or step.const_value is None:
                continue  # not a quantizer's own Q (a pair two quantizers share), or its step moved already
            computed = float(activation_step(np.asarray(base[id(owner)]), owner.unsigned))
            written = float(step.const_value.numpy())
            self.steps.setdefault(id(owner), ([], written / computed, owner.unsigned))[0].append(str(step.name))
            assert step.graph is not None
            step.graph.initializers.pop(str(step.name))
            step.const_value = None
            main.inputs.append(step)  # a branch reads it from the outer scope

    def meter(self, ranges: Mapping[int, np.ndarray], scored: Scored) -> FidelityMeter:
        """A :class:`~qdq.workflow.fidelity.FidelityMeter` of the model with the fed steps from ``ranges`` on the
        ``scored`` (feed, float outputs) pairs."""
        steps = {name: np.asarray(activation_step(np.asarray(ranges[key]), unsigned) * ratio, np.float32).reshape(())
                 for key, (inputs, ratio, unsigned) in self.steps.items() for name in inputs}  # fmt: skip
        return _meter(self.session, self.inputs, scored, steps)


class Quantized:
    """``model`` with Q/DQ at ``ranges`` (activations and weights, by quantizer ``id`` of ``view``) in one ONNX
    Runtime session, unoptimized (each Q and DQ computed as written)."""

    def __init__(self, model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray],
                 threads: int | None = None) -> None:  # fmt: skip
        quantized = onnx.ModelProto()
        quantized.CopyFrom(model)
        write_qdq(quantized, view, dict(ranges))
        self.session = ort_session(quantized, session_options(threads=threads, optimization_level="disable"))
        self.inputs = {i.name for i in self.session.get_inputs()}

    def meter(self, scored: Scored) -> FidelityMeter:
        """The output fidelity on the ``scored`` (feed, float outputs) pairs."""
        return _meter(self.session, self.inputs, scored)


def _meter(session: Any, inputs: set[str], scored: Scored, extra: Mapping[str, np.ndarray] | None = None
           ) -> FidelityMeter:  # fmt: skip
    """The output fidelity of ``session`` on the ``scored`` (feed, float outputs) pairs, each feed's ``inputs``
    (and ``extra``, such as fed steps) given."""
    found = FidelityMeter()
    for feed, reference in scored:
        outputs: list[Any] = session.run(None, {**{n: a for n, a in feed.items() if n in inputs}, **(extra or {})})
        found.add(reference, outputs)
    return found


def _score(model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray],
           scored: Scored, threads: int | None) -> float:  # fmt: skip
    return Quantized(model, view, ranges, threads).meter(scored).score()


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -math.inf

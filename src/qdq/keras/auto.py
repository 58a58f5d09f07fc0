"""``method="auto"`` for Keras models: the calibration method chosen for the whole model by the fidelity of its
outputs, the default of :func:`qdq.keras.calibrate`.

The PyTorch front end's ``auto`` (:mod:`qdq.workflow.auto_calibration`: the held-out rule, the candidates, the
fidelity, the choice and the result are that module's) on the Keras front end's own statistics:

0. cross-layer equalization (:mod:`qdq.keras.equalize`) on the first calibration batches, checked at the end (6);
1. one pass of :func:`qdq.keras.collect_stats` with histograms holds samples out by the shared rule
   (:func:`~qdq.workflow.auto_calibration.held_out`: the last quarter of each batch, along dimension 0 of its
   inputs, of 8 batches at most; a batch that cannot be split, one whole batch in four): their statistics apart,
   the float model's outputs on them kept (when nothing can be held out, the first batches are scored instead, and
   the result says so);
2. each candidate's ranges (every registered method computed from statistics, its default options) come from the
   other samples' statistics and are set on the model (:func:`qdq.keras.set_ranges`);
3. the quantized model runs on the held-out samples (``predict_on_batch``: traced once, the ranges are variables)
   and its outputs are compared with the float ones (:class:`~qdq.workflow.auto_calibration.FidelityMeter`; the
   channels of a channels-last output are its features, as a channel of ``[N, C, H, W]`` is in the PyTorch door),
   by the halves the refinement scores on (the same sums; the chosen candidate's are the refinement's start);
4. :func:`~qdq.workflow.auto_calibration.choose` picks, with the diagnostics' verdict on each candidate's ranges
   (:func:`~qdq.workflow.auto_calibration.destructive`, on the Keras calibrators);
5. the quantizers whose candidates disagree most may each take another candidate's range where the held-out
   fidelity measurably rises (:mod:`qdq.workflow.refinement`);
6. each quantizer's method's ranges are set from every sample's statistics; the equalization is undone where the
   held-out samples score the model :data:`~qdq.workflow.equalization.UNDO_DB` or more lower with it than with its
   kernels as they were (each pair's activation at the range the chosen method gives its own histogram:
   :func:`~qdq.workflow.equalization.kept`); the result is recorded on the model (:func:`qdq.keras.auto_result`),
   and a :class:`~qdq.errors.QdqCalibrationWarning` names the quantizers whose chosen range the diagnostics call
   destructive (never chosen silently);
7. the stem (:mod:`qdq.workflow.stem`): the wrapped layers nearest the inputs, level by level, run float on the
   held-out halves (their wrappers bypassed, the model called eagerly for each trial); the levels that pay
   their cost stay float (``QuantizeWrapper.kept_float``, saved with the model), as the PyTorch door disables their
   quantizers (``AutoResult.stem``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from qdq.errors import QdqCalibrationWarning
from qdq.keras.calibration import batches_of, collect_stats, inputs_of, record_auto, set_ranges
from qdq.keras.equalize import assign, quantized_view, restore
from qdq.keras.equalize import equalize as equalize_pairs
from qdq.workflow import equalization
from qdq.workflow.auto_calibration import AutoResult, candidate, candidates, choose, destructive, held_out
from qdq.workflow.collection import first_batches
from qdq.workflow.diagnostics import CalibrationReport, diagnose_statistics
from qdq.workflow.equalization import MEASURED_BATCHES, Scaling
from qdq.workflow.fidelity import FidelityMeter
from qdq.workflow.refinement import Halves, candidate_score, halves, refine, samples_of
from qdq.workflow.stem import StemChoice, choose_stem, stem_levels

__all__ = ["clipping_warning", "run", "select"]


def select(
    model: Any,
    data: Iterable[Any],
    *,
    num_batches: int | None = None,
    num_bins: int | None = None,
    warn: bool = True,
    equalize: bool = True,
) -> tuple[dict[str, float], AutoResult]:
    """``auto`` on a quantized Keras model: set the chosen method's ranges; return them and what every candidate
    scored (see the module docstring). ``data`` is read once.

    Args:
        model: from :func:`qdq.keras.quantize_model`; its wrappers are marked calibrated.
        data: calibration batches, as :func:`qdq.keras.calibrate` takes them.
        num_batches: use at most this many batches.
        num_bins: histogram bins (default: :data:`qdq.calib.histogram.DEFAULT_NUM_BINS`).
        warn: warn (:class:`~qdq.errors.QdqCalibrationWarning`) when the chosen ranges clip destructively.
        equalize: first rescale the channels between two quantized convolutions through their ReLU-like activation
            where that predicts less output noise (:mod:`qdq.keras.equalize`; the kernels change in place).

    Returns:
        ``({"<wrapper>/input_<i>": amax}, AutoResult)``; the result is also :func:`qdq.keras.auto_result(model)
        <qdq.keras.auto_result>`.
    """
    ranges, result, text = run(model, data, num_batches=num_batches, num_bins=num_bins, equalize=equalize)
    if warn and text is not None:
        warnings.warn(text, QdqCalibrationWarning, stacklevel=3)
    return ranges, result


def run(
    model: Any, data: Iterable[Any], *, num_batches: int | None = None, num_bins: int | None = None,
    equalize: bool = True,
) -> tuple[dict[str, float], AutoResult, str | None]:
    """:func:`select` without the warning: the ranges set, the result, and the clipping warning's text (None when
    the chosen ranges clip nothing destructively)."""
    started = time.perf_counter()
    scalings: list[Scaling] = []
    if equalize:
        data, first = first_batches(batches_of(data), min(MEASURED_BATCHES, num_batches or MEASURED_BATCHES))
        scalings = equalize_pairs(model, [inputs_of(batch) for batch in first])
    stats = collect_stats(model, data, "histogram", num_batches=num_batches, num_bins=num_bins, held_out=held_out)
    statistics = time.perf_counter()
    named = stats.histograms()  # "<wrapper>/input_<i>" -> the calibrator of the batches not held out
    scores: dict[str, float] = {}
    clipping: dict[str, list[str]] = {}
    grid = candidates()
    kept: dict[str, dict[str, float]] = {}
    parts = halves(stats.scored, lambda pair: samples_of(pair[1]))
    by_half: dict[str, Halves | None] = {}  # the refinement starts from the chosen one's
    for method, options in grid:
        label = method.label(options)
        ranges = kept[label] = set_ranges(model, stats.ranges(method.name, **options))
        clipping[label] = destructive(named, ranges, label)
        scores[label], by_half[label] = candidate_score(lambda pairs: _meter(model, pairs), parts, stats.scored)
    chosen = choose(scores, clipping)

    def score(selection: Mapping[str, str], half: int) -> FidelityMeter:
        set_ranges(model, {name: kept[label][name] for name, label in selection.items()})
        return _meter(model, parts[half] if parts else [])

    names = {name: name for name in kept[chosen]}
    selection, refinement = refine(kept, chosen, score if parts else None, names, clipping,
                                   start=by_half.get(chosen))
    was_held_out = bool(stats.held_out)
    stats.merge_held_out()
    final = {label: stats.ranges(method.name, **options)
             for label in {chosen, *selection.values()} for method, options in [candidate(label)]}  # fmt: skip
    ranges = set_ranges(model, {name: final[selection.get(name, chosen)][name] for name in final[chosen]})
    histograms = {**stats.histograms(), **{s.handles["quantizer"]: s.histogram for s in scalings}}
    scalings, equalization_scores = _settled(model, scalings, stats.scored, parts, ranges, chosen)
    if scalings:  # kept: the statistics are those of the rescaled activations
        histograms = stats.histograms()
    stem = _float_stem(model, parts)
    result = AutoResult(chosen, scores, clipping, len(stats.scored), was_held_out,
                        {"statistics": statistics - started, "scoring": time.perf_counter() - statistics},
                        refinement=refinement, stem=stem, equalized=scalings,
                        equalization=equalization_scores)  # fmt: skip
    record_auto(model, result)
    return ranges, result, clipping_warning(histograms, ranges, f"auto: {chosen}")


def _settled(model: Any, scalings: list[Scaling], scored: Sequence[tuple[Any, list[np.ndarray]]],
             parts: tuple[Any, Any] | None, ranges: dict[str, float],
             chosen: str) -> tuple[list[Scaling], tuple[float, float] | None]:  # fmt: skip
    """Equalization kept unless the held-out samples clearly score it lower (:func:`~qdq.workflow.equalization.kept`):
    the model as it is against its kernels as they were, each pair's activation at the range the chosen method gives
    its own histogram (the kernels' ranges follow them), on the held-out ``scored`` pairs or, where there are two,
    their halves ``parts`` (:func:`_meter_all`). ``ranges`` is updated where it is undone. Returns the scalings
    kept and both scores (None where nothing was scored)."""
    if not scalings or not scored:
        return scalings, None
    method, options = candidate(chosen)
    plain_ranges = {s.handles["quantizer"]: method.compute_amax(s.histogram, **method.resolve_options(options))
                    for s in scalings}  # fmt: skip
    if any(amax is None for amax in plain_ranges.values()):
        return scalings, None
    with_it = _meter_all(model, scored, parts).score()
    equalized = restore(scalings)
    set_ranges(model, {name: float(amax) for name, amax in plain_ranges.items()})
    plain = _meter_all(model, scored, parts).score()
    if not equalization.kept(with_it, plain):
        ranges.update({name: float(amax) for name, amax in plain_ranges.items()})
        return [], (with_it, plain)
    assign(scalings, equalized)
    set_ranges(model, {name: ranges[name] for name in plain_ranges})
    return scalings, (with_it, plain)


def _float_stem(model: Any, parts: tuple[Any, Any] | None) -> StemChoice:
    """:func:`qdq.workflow.stem.choose_stem` on the model's quantized view: a trial runs the stem's wrappers float
    (``bypass``; the model called eagerly, which reads the flag on every call, where a traced predict function would
    be traced again for each trial); those of the levels kept stay float for good (``kept_float``: the layers run,
    and export, float), as the PyTorch door disables their quantizers."""
    from qdq.keras.calibration import forget_traced_functions

    if parts is None:
        return choose_stem([], None)
    view = quantized_view(model)
    wrappers = {op.name: op.ref for op in view.ops}

    def score(ops: list[str], half: int) -> FidelityMeter:
        for name in ops:
            wrappers[name].bypass = True
        try:
            return _meter(model, parts[half], eager=bool(ops))  # the model as it is: its traced function
        finally:
            for name in ops:
                wrappers[name].bypass = False

    choice = choose_stem(stem_levels(view), score)
    for name in choice.ops:
        wrappers[name].kept_float = True
    forget_traced_functions(model)
    return choice


def clipping_warning(histograms: Mapping[str, Any], ranges: Mapping[str, float], label: str) -> str | None:
    """The clipping warning (:meth:`qdq.workflow.diagnostics.CalibrationReport.warning_text`) for ``ranges``
    against ``histograms`` (the quantizers' calibrators, by range name), each quantizer's method named ``label``;
    None when no range clips destructively."""
    rows = [diagnose_statistics(name, calibrator, ranges[name], label) for name, calibrator in
            histograms.items() if name in ranges]  # fmt: skip
    text = CalibrationReport([row for row in rows if row is not None]).warning_text()
    return None if text is None else text.replace("qdq.calibration_report(model) lists every quantizer",
                                                  "qdq.keras.auto_result(model).clipping lists them")  # fmt: skip


def _meter(model: Any, scored: Sequence[tuple[Any, list[np.ndarray]]], eager: bool = False) -> FidelityMeter:
    """A :class:`~qdq.workflow.fidelity.FidelityMeter` of ``model`` (quantizing) on the ``scored`` (inputs, float
    outputs) pairs; ``eager``: the model called as a function (wrapper flags read on each call) instead of its
    traced ``predict_on_batch``."""
    from qdq.keras._backend import keras

    meter = FidelityMeter()
    for inputs, reference in _joined(scored):  # one call: the meter's sums add up the same
        result = model(inputs, training=False) if eager else model.predict_on_batch(inputs)
        outputs = [np.asarray(value) for value in keras().tree.flatten(result)]
        meter.add(_features_first(reference), _features_first(outputs))
    return meter


def _meter_all(model: Any, scored: Sequence[tuple[Any, list[np.ndarray]]], parts: tuple[Any, Any] | None
               ) -> FidelityMeter:  # fmt: skip
    """:func:`_meter` on all the held-out ``scored`` pairs: on their two halves ``parts`` summed where there are two
    (:func:`~qdq.workflow.refinement.halves`: the batch shapes every other score runs at, so nothing is traced
    again)."""
    return _meter(model, parts[0]) + _meter(model, parts[1]) if parts is not None else _meter(model, scored)


def _joined(pairs: Sequence[tuple[Any, list[np.ndarray]]]) -> list[tuple[Any, list[np.ndarray]]]:
    """The (inputs, float outputs) ``pairs`` as one pair, concatenated along dimension 0 (the samples), where every
    input and output is an array with samples there; else the pairs as they are."""
    from qdq.keras._backend import keras

    tree = keras().tree
    if len(pairs) < 2:
        return list(pairs)
    try:
        inputs = tree.map_structure(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *[p[0] for p in pairs])
        outputs = [np.concatenate(parts) for parts in zip(*[p[1] for p in pairs])]
    except (ValueError, TypeError):  # structures or trailing shapes that differ: batch by batch
        return list(pairs)
    return [(inputs, outputs)]


def _features_first(outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Channels-last outputs of rank 3 or more with their channels on axis 1, where the meter reads features."""
    from qdq.keras._backend import keras

    if keras().config.image_data_format() != "channels_last":
        return list(outputs)
    return [np.moveaxis(value, -1, 1) if value.ndim >= 3 else value for value in outputs]

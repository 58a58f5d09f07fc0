"""The ONNX door's float stem (:mod:`qdq.workflow.stem`): each trial is the prepared model placed again with the stem's
ops float (:meth:`qdq.onnx_in.prepared.PreparedModel.view`), its quantizers taking the ranges of the tensors
calibration observed, written as a Q/DQ copy and scored on the held-out samples (:class:`qdq.onnx_in.auto.Quantized`,
unoptimized). A trial that would quantize a tensor calibration never observed is not scored (never kept); the
quantizers calibration never reached (an ``If`` branch no batch took) stay float as in the placement calibrated.
The trials are scored with the final ranges and without bias correction, the same for every trial.

The levels chosen are then timed (:class:`qdq.workflow.stem.StemTiming`): both files, the stem float and all int8,
written as the target's rewrite finishes them and run on the target's first native runtime where it is installed
and loads a file without compiling an engine (ONNX Runtime for ``onnxruntime``; TensorRT is not timed), on one
held-out sample (latency, as a deployed model runs), in interleaved rounds, cut where the inputs say their samples
lie (:mod:`qdq.onnx_in.samples`: dimension 0, or a named batch axis such as silero-vad's state ``[2, batch, 128]``).
A model whose inputs do not say which axis holds the samples is not timed.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdq.graphs.view import GraphView
from qdq.onnx_in.auto import Quantized, Scored
from qdq.onnx_in.calibrate import WeightCache, weight_ranges
from qdq.onnx_in.prepared import Placement, PreparedModel, activation_values, ranges_by_value, values_ranges
from qdq.onnx_in.samples import one_sample
from qdq.onnx_in.view import keep_unreached_float
from qdq.runtime.backend import timing_backend
from qdq.targets import Target
from qdq.workflow.fidelity import FidelityMeter
from qdq.workflow.progress import Progress, counter
from qdq.workflow.stem import StemChoice, StemTimer, StemTiming, choose_stem, stem_levels

__all__ = ["STEM_WHY", "Placing", "float_stem"]


@dataclass(frozen=True)
class Placing:
    """The arguments a placement of the stem trials is made with (those of the placement being written)."""

    keep_float: Sequence[str]
    float_values: Sequence[str]
    nonnegative: Sequence[str]
    batches: Sequence[Any]
    weight_method: str
    threads: int | None
    progress: Progress
    weight_cache: WeightCache = field(default_factory=dict)  # the call's weight ranges, computed once each


#: the reason ``float_ops`` gives for an op of the stem left float
STEM_WHY = ("the model's stem, left float by auto: int8 there lost more held-out output fidelity than its cost "
            "(result.auto.stem)")


_Trial = tuple[GraphView, dict[int, np.ndarray]]  # a placement's view and its activation ranges


def float_stem(source: PreparedModel, placement: Placement, placing: Placing, ranges: Mapping[int, np.ndarray],
               parts: tuple[Scored, Scored] | None,
               base: Callable[[Scored], FidelityMeter] | None = None) -> tuple[StemChoice, _Trial | None]:  # fmt: skip
    """:func:`qdq.workflow.stem.choose_stem` of ``placement`` with its activation ``ranges``: each trial is the
    placement made again with the stem's ops float, its quantizers taking the ranges of the tensors they read; the
    view and ranges to write when the stem is kept float. ``base`` meters ``placement`` at ``ranges`` where a
    session that does so exists already (else one is made)."""
    view = placement.view
    levels = stem_levels(view)
    observed = ranges_by_value(view, ranges)
    asked = set().union(*map(activation_values, _placed(source, placement.target, placing).quantizers()))
    trials: dict[tuple[str, ...], _Trial | None] = {(): (view, dict(ranges))}
    sessions: dict[tuple[str, ...], Quantized | None] = {}
    bar = counter(placing.progress, "auto: the stem float", 2 * (len(levels) + 1) if parts else 0)

    def score(ops: list[str], half: int) -> FidelityMeter:
        key = tuple(ops)
        if not key and base is not None and parts is not None:
            bar.update()
            return base(parts[half])
        if key not in trials:
            trials[key] = _stem_trial(source, placement.target, placing, ops, observed, asked)
        if key not in sessions:
            found = trials[key]
            sessions[key] = None if found is None else Quantized(
                placement.model, found[0],
                {**found[1], **weight_ranges(placement.model, found[0], placing.weight_method,
                                             placing.weight_cache)}, placing.threads)  # fmt: skip
        bar.update()
        session = sessions[key]
        if parts is None or session is None:
            return FidelityMeter()  # no score: never kept
        meter = session.meter(parts[half])
        if half == 1:
            del sessions[key]  # both halves scored: its memory back
        return meter

    def weights(found: _Trial) -> dict[int, np.ndarray]:
        return weight_ranges(placement.model, found[0], placing.weight_method, placing.weight_cache)

    first = parts[0][0][0] if parts and parts[0] else None  # the first held-out (feed, outputs) pair's feed
    timer = _timer(placement, trials, weights, first, bar)
    choice = choose_stem(levels, score if parts is not None else None, timer)
    bar.close()
    return choice, (trials[tuple(choice.ops)] if choice.levels else None)


def _timer(placement: Placement, trials: Mapping[tuple[str, ...], _Trial | None],
           weights: Callable[[_Trial], dict[int, np.ndarray]], feed: Mapping[str, np.ndarray] | None,
           bar: Any) -> StemTimer | None:  # fmt: skip
    """``timer(ops)`` for :func:`~qdq.workflow.stem.choose_stem` (module doc), or None where the target's runtime
    cannot time here."""
    backend = timing_backend(placement.target.native_runtime)
    feed = one_sample(placement.model, feed) if feed is not None else None
    if backend is None or feed is None:
        return None

    def timer(ops: list[str]) -> StemTiming | None:
        bar.set_postfix_str(f"timing it against all int8 on {backend.name}")
        files = {"int8": trials.get(()), "stem": trials.get(tuple(ops))}
        with tempfile.TemporaryDirectory(prefix="qdq-stem-") as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the files are timed, not used: what their rewrite says is not news
            paths = {}
            for label, found in files.items():
                if found is None:
                    return None
                copy = onnx.ModelProto()
                copy.CopyFrom(placement.model)
                paths[label] = Placement(copy, found[0], placement.target).write(
                    {**found[1], **weights(found)}, Path(folder) / f"{label}.onnx")
            return StemTiming.measure(paths["int8"], paths["stem"], backend.name, inputs=feed)

    return timer


def _placed(source: PreparedModel, target: Target, placing: Placing, ops: Sequence[str] = ()) -> GraphView:
    """The view of ``source`` placed as ``placing`` says, with ``ops`` float too (before calibration)."""
    return source.view(target, [*placing.keep_float, *ops], placing.float_values, placing.nonnegative,
                       batches=placing.batches)  # fmt: skip


def _stem_trial(source: PreparedModel, target: Target, placing: Placing, ops: list[str],
                observed: Mapping[str, np.ndarray], asked: set[str]) -> _Trial | None:  # fmt: skip
    """The placement with ``ops`` float too and its activation ranges from ``observed`` (tensor -> amax); None when
    it quantizes a tensor the placement calibrated did not (``asked``: every tensor calibration was asked for,
    those it never reached included)."""
    view = _placed(source, target, placing, ops)
    for name in ops:
        view.float_ops[name] = STEM_WHY
    missing = [q for q in view.quantizers()
               if not q.per_channel and any(v not in observed for v in activation_values(q))]  # fmt: skip
    if any(v not in asked for q in missing for v in activation_values(q)):
        return None
    keep_unreached_float(view, missing)  # what the placement calibrated left float: calibration never reached it
    ranges = values_ranges(view, observed)
    return (view, ranges) if ranges is not None else None

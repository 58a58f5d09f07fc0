"""Latency: every configuration timed on the runtime's backend in interleaved rounds (:func:`time_trials`), the
fastest that meet the budget timed again (:func:`confirm`), the choice (:func:`choose`) and what each unit costs
(:func:`unit_costs`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from qdq.runtime.benchmark import compare_models
from qdq.tuning.budget import Budget
from qdq.tuning.evaluation import Evaluator
from qdq.tuning.result import Trial
from qdq.workflow.progress import counter

__all__ = ["choose", "confirm", "spread", "time_trials", "unit_costs"]


def time_trials(ev: Evaluator, rounds: int, iters: int, max_loaded: int) -> None:
    """Time FP32 and every configuration tried in interleaved rounds (``Trial.ms``), at most ``max_loaded`` files
    loaded at once: beyond that, in groups that each hold FP32 and INT8 too (their figures: the first group's)."""
    anchors = [t for t in (ev.fp32, ev.trials[0]) if t.path is not None]
    rest = [t for t in ev.trials[1:] if t.path is not None]
    size = max(max_loaded - len(anchors), 1)
    groups = [rest[start : start + size] for start in range(0, len(rest), size)] or [[]]
    for index, group in enumerate(groups):
        step = "tune: timing" + (f" ({index + 1}/{len(groups)})" if len(groups) > 1 else "")
        timed = anchors + group
        for trial, blocks in zip(timed, _timings(ev, timed, rounds, iters, step)):
            if index == 0 or any(trial is member for member in group):
                trial.ms, trial.low, trial.high = spread(blocks)


def confirm(ev: Evaluator, rounds: int, iters: int, count: int = 3) -> None:
    """Time again, in fresh interleaved rounds, FP32, INT8, the ``count`` fastest configurations that meet the
    budget and the one that meets it with the fewest float units (``Trial.confirmed``): the choice among them rests
    on measurements it did not select on."""
    meeting = [t for t in ev.trials if t.meets(ev.budget) and t.ms is not None]
    if not meeting:
        return
    passing = sorted(meeting, key=lambda t: t.ms or math.inf)[:count]
    fewest = min(reversed(meeting), key=lambda t: len(t.floated))  # the last of the fewest: the pruned one
    passing += [] if any(t is fewest for t in passing) else [fewest]
    int8 = ev.trials[0]
    timed = [t for t in [ev.fp32, int8, *(t for t in passing if t is not int8)] if t.path is not None]
    for trial, blocks in zip(timed, _timings(ev, timed, rounds, iters, "tune: confirming")):
        trial.confirmed = spread(blocks)


def _timings(ev: Evaluator, trials: list[Trial], rounds: int, iters: int, step: str) -> list[np.ndarray]:
    """Each trial's block medians (ms), timed in interleaved rounds on the runtime's backend (each file loaded
    through it: counted in ``builds``)."""
    models = {f"{i}": t.path for i, t in enumerate(trials) if t.path is not None}  # all have one here
    bar = counter(ev.progress, step, rounds * len(models))
    ev.builds += len(models)
    engine = ev.engine
    with engine.once():
        comparison = compare_models(models, engine.backend.name, threads=engine.threads, rounds=rounds, iters=iters,
                                    warmup=2, batch=ev.batch, inputs=ev.feed(ev.calibration_batch),
                                    progress=bar.update, **engine.options)  # fmt: skip
    bar.close()
    return [np.asarray(comparison.block_ms[key]) for key in models]


def choose(trials: Sequence[Trial], budget: Budget) -> Trial | None:
    """The configuration that meets the budget at the lowest latency (confirmed where re-timed); where one with fewer
    float units is as fast within the timing's spread (its 25th percentile at most the fastest's 75th), the one with
    the fewest float units."""
    passing = [t for t in trials if t.meets(budget) and t.latency is not None]
    confirmed = [t for t in passing if t.confirmed is not None]
    if not confirmed:
        return min(passing, key=lambda t: t.latency or math.inf) if passing else None
    fastest = min(confirmed, key=lambda t: t.latency or math.inf)
    ceiling = fastest.confirmed[2] if fastest.confirmed is not None else math.inf
    level = [t for t in confirmed if t.confirmed is not None and t.confirmed[1] <= ceiling]
    return min(level, key=lambda t: (len(t.floated), t.latency or math.inf))


def unit_costs(trials: Sequence[Trial], chosen: Trial | None) -> dict[tuple[str, ...], tuple[float, float, float]]:
    """Unit -> the latency it adds, measured: the difference between two timed configurations that differ by that
    unit alone (the difference of their medians, and the range their 25th-75th percentiles allow), preferring the
    pair whose larger side is ``chosen`` (a pruning try without the unit), then a greedy step that added it."""
    timed = [(t, set(t.floated), (t.ms, t.low, t.high)) for t in trials if t.matmul_bits is None
             and t.ms is not None and t.low is not None and t.high is not None]  # fmt: skip
    found: dict[tuple[str, ...], tuple[float, float, float]] = {}
    for trial, units, (ms, low, high) in timed:
        for _, fewer, (other_ms, other_low, other_high) in timed:
            if len(units) == len(fewer) + 1 and fewer < units:
                (unit,) = units - fewer
                if unit not in found or trial is chosen:
                    found[unit] = (ms - other_ms, low - other_high, high - other_low)
    return found


def spread(blocks: np.ndarray) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) of interleaved block timings, ms."""
    low, high = np.percentile(blocks, [25, 75])
    return float(np.median(blocks)), float(low), float(high)

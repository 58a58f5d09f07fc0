"""Per-quantizer refinement of ``auto``'s choice: one quantizer at a time takes another candidate method's range where
the model's output fidelity on the held-out samples measurably rises.

``auto`` (:mod:`qdq.workflow.auto_calibration`) chooses one method for the whole model. One method is not right for
every activation of a model: in a sentence encoder, percentile suits every activation but one whose outliers carry
the signal, where max does better, and the reverse elsewhere. After the model-level choice, :func:`refine` walks the
activation quantizers whose candidate ranges disagree most (the largest ratio between the chosen method's range and
another candidate's), at most :data:`REFINE_QUANTIZERS` of them. For each it walks the other candidates' ranges
that differ by at least :data:`MIN_DIFFERENCE`, the smaller ones from the nearest down, then the larger ones from
the nearest up: the model is scored on the first half of the held-out samples with that one range changed, and a
walk stops at the first range that scores no higher than the one before it (a range too wide rounds coarsely, one
too narrow clips: the score rises and then falls as the range moves away). The best range of a walk is kept when
the score rises by at least :data:`REFINE_GAIN_DB`, and by at least half of that on each half of the held-out
batches (alternate batches: a gain one half of the samples carries and the other does not is fitted to those
samples, not to the model); the next quantizers start from it. One held-out batch is split
by its samples where the front end can; with fewer than two held-out batches or :data:`MIN_SPLIT_SAMPLES` samples
nothing is changed (:func:`halves`). A range the diagnostics call
destructive (it clips at least :data:`~qdq.workflow.diagnostics.CLIPPED_ENERGY_LIMIT` of its activation's energy)
must gain :data:`DESTRUCTIVE_GAIN_DB`, and is named in the result and in the clipping warning.

Cost: each trial runs the model on the first half of the held-out batches, and on the second only for a walk's
best range that gained enough on the first; at least two and at most ``candidates - 1`` first-half runs per
quantizer (two when the nearest range on either side scores lower); the chosen method's own two halves are not run
again where the front end scored the candidates by halves (:func:`candidate_score`, ``start``: every door does).
The front end makes a run cheap (the ONNX front end feeds the activation steps to one session as inputs). The final
ranges of each quantizer come from its method over every batch's statistics, as the model-level choice's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from qdq.markdown import markdown_table
from qdq.workflow.fidelity import FidelityMeter

__all__ = [
    "DESTRUCTIVE_GAIN_DB",
    "MIN_DIFFERENCE",
    "MIN_SPLIT_SAMPLES",
    "REFINE_GAIN_DB",
    "REFINE_QUANTIZERS",
    "Change",
    "Halves",
    "Refinement",
    "candidate_score",
    "halves",
    "refine",
    "samples_of",
]

#: the held-out score gain (dB) a change of one quantizer's range must bring to be kept
REFINE_GAIN_DB = 0.5
#: the gain (dB) a range the diagnostics call destructive must bring
DESTRUCTIVE_GAIN_DB = 1.0
#: at most this many quantizers are tried, those whose candidate ranges disagree most
REFINE_QUANTIZERS = 8
#: a candidate range is tried only where it differs from the current one by at least this fraction
MIN_DIFFERENCE = 0.01
#: the fewest held-out samples the refinement runs on (fewer: nothing changes)
MIN_SPLIT_SAMPLES = 4

Key = TypeVar("Key", bound=Hashable)
Pair = TypeVar("Pair")


@dataclass(frozen=True)
class Change:
    """One quantizer whose range the refinement took from another method.

    Attributes:
        quantizer: its name.
        before: the method it had (a candidate label).
        after: the method it has now.
        gain_db: how much the held-out score rose with it (dB).
        destructive: the new range clips a destructive share of its activation's energy.
        half_gains_db: how much the score of each half of the held-out batches rose (dB).
    """

    quantizer: str
    before: str
    after: str
    gain_db: float
    destructive: bool = False
    half_gains_db: tuple[float, ...] = ()


@dataclass
class Refinement:
    """What :func:`refine` changed.

    Attributes:
        start: the held-out score of the model-level choice (dB).
        score: the held-out score after the changes (dB).
        changes: the changes kept, in the order they were made.
        tried: the quantizers tried (those whose candidates disagree most).
        runs: scoring runs made (each on one half of the held-out batches).
        skipped: why nothing was tried ("" when the refinement ran).
    """

    start: float
    score: float
    changes: list[Change] = field(default_factory=list)
    tried: int = 0
    runs: int = 0
    skipped: str = ""

    def summary(self) -> str:
        """One line: how many quantizers changed method and what it gained."""
        if self.skipped:
            return f"not refined: {self.skipped}"
        if not self.changes:
            return f"no quantizer refined ({self.tried} tried)"
        return (f"{len(self.changes)} of {self.tried} quantizers tried take another method's range "
                f"({self.start:.1f} -> {self.score:.1f} dB)")  # fmt: skip

    def table(self) -> str:
        """Markdown table of the changes, with a legend."""
        rows = [[c.quantizer, c.before, c.after, f"+{c.gain_db:.2f}", " / ".join(f"{g:+.2f}" for g in c.half_gains_db),
                 "yes" if c.destructive else ""] for c in self.changes]  # fmt: skip
        legend = (f"each change kept because the held-out output fidelity rose by >= {REFINE_GAIN_DB} dB "
                  f"(>= {DESTRUCTIVE_GAIN_DB} dB for a destructive range: one that clips >= 10% of its activation's "
                  "energy), and by half of that on each half of the held-out batches.")  # fmt: skip
        header = ["quantizer", "method before", "method after", "gain (dB)", "halves (dB)", "destructive"]
        return markdown_table(header, rows) + "\n\n" + legend


Split = Callable[[Pair], tuple[Pair, Pair] | None]


def halves(pairs: Sequence[Pair], samples: Callable[[Pair], int],
           split: Split[Pair] | None = None) -> tuple[list[Pair], list[Pair]] | None:  # fmt: skip
    """The held-out ``pairs`` (a batch and the float model's outputs on it) as two halves, alternate batches; one
    batch split in two by ``split`` where the front end can (its samples in two halves: None where it cannot); None
    with fewer than two batches or :data:`MIN_SPLIT_SAMPLES` samples (``samples(pair)``: how many a pair holds)."""
    if sum(samples(pair) for pair in pairs) < MIN_SPLIT_SAMPLES:
        return None
    if len(pairs) == 1 and split is not None and (parts := split(pairs[0])) is not None:
        pairs = list(parts)
    if len(pairs) < 2:
        return None
    return list(pairs[0::2]), list(pairs[1::2])


Halves = tuple[FidelityMeter, FidelityMeter]


def candidate_score(meter: Callable[[Sequence[Pair]], FidelityMeter], parts: tuple[list[Pair], list[Pair]] | None,
                    scored: Sequence[Pair]) -> tuple[float, Halves | None]:  # fmt: skip
    """A candidate's score on the held-out ``scored`` pairs (``meter(pairs)`` runs the model with its ranges), by the
    two halves :func:`halves` gave (``parts``) where there are two: the same sums, and the halves' meters, which
    :func:`refine` starts from (``start``) for the chosen candidate instead of running them again."""
    if parts is None:
        return meter(scored).score(), None
    both = (meter(parts[0]), meter(parts[1]))
    return (both[0] + both[1]).score(), both


def samples_of(outputs: Sequence[Any]) -> int:
    """The samples of a batch by its first output (dimension 0; 1 for a scalar output or none)."""
    if not outputs:
        return 1
    shape = tuple(getattr(outputs[0], "shape", ()))
    return int(shape[0]) if shape else 1


def refine(
    candidates: Mapping[str, Mapping[Key, Any]],
    chosen: str,
    score: Callable[[Mapping[Key, str], int], FidelityMeter] | None,
    names: Mapping[Key, str],
    clipping: Mapping[str, Collection[str]],
    *,
    keys: Sequence[Key] | None = None,
    limit: int | None = None,
    start: tuple[FidelityMeter, FidelityMeter] | None = None,
) -> tuple[dict[Key, str], Refinement]:
    """Each quantizer's method after refining the model-level ``chosen`` one (see the module docstring).

    Args:
        candidates: candidate label -> {quantizer key -> its range (amax, 0-d)}, in the candidates' order.
        chosen: the model-level choice (a label of ``candidates``).
        score: ``score(selection, half)``: the model, each quantizer's range from its method in ``selection`` {key
            -> label}, run on half ``half`` (0 or 1) of the held-out batches (:func:`halves`); None when they
            cannot be halved (nothing changes).
        names: the quantizers' names (for the result and ``clipping``).
        clipping: label -> names of the quantizers that label's ranges clip destructively.
        keys: the quantizers that may change (default: every key of ``candidates[chosen]``).
        limit: at most this many quantizers are tried (default :data:`REFINE_QUANTIZERS`).
        start: ``chosen``'s meters on the two halves, where the front end scored them already (not run again).

    Returns:
        ``({key: label}, Refinement)``.
    """
    selection = {key: chosen for key in candidates[chosen]}
    if score is None:
        why = (f"fewer than two held-out batches or {MIN_SPLIT_SAMPLES} samples (calibration data in several "
               f"batches lets it check a gain on two halves)")  # fmt: skip
        return selection, Refinement(math.nan, math.nan, skipped=why)
    limit = REFINE_QUANTIZERS if limit is None else limit
    order = [key for key in _by_disagreement(candidates, chosen, keys) if key in selection][:limit]
    if not order:
        return selection, Refinement(math.nan, math.nan, skipped="no candidate ranges differ")
    current = start if start is not None else (score(selection, 0), score(selection, 1))
    first_score = (current[0] + current[1]).ranked()
    result = Refinement(first_score, first_score, tried=len(order), runs=0 if start is not None else 2)
    for key in order:
        for side in _sides(candidates, key, selection[key]):
            best, base = None, current[0].ranked()
            for label in side:  # nearest first: the score is taken to rise and then fall as the range moves away
                first = score({**selection, key: label}, 0)
                result.runs += 1
                if first.ranked() <= base:
                    break
                best, base = (label, first), first.ranked()
            if best is None:
                continue
            label, first = best
            harmful = names[key] in clipping.get(label, ())
            need = DESTRUCTIVE_GAIN_DB if harmful else REFINE_GAIN_DB
            if first.ranked() - current[0].ranked() < need / 2:
                continue
            trial = {**selection, key: label}
            second = score(trial, 1)
            result.runs += 1
            gains = (first.ranked() - current[0].ranked(), second.ranked() - current[1].ranked())
            whole = (first + second).ranked()
            if min(gains) >= need / 2 and whole - result.score >= need:
                result.changes.append(Change(names[key], selection[key], label, whole - result.score, harmful, gains))
                selection, current, result.score = trial, (first, second), whole
                break
    return selection, result


def _sides(candidates: Mapping[str, Mapping[Key, Any]], key: Key, label: str) -> list[list[str]]:
    """The other candidates' labels for ``key`` whose ranges differ from ``label``'s, as two walks away from it:
    the smaller ranges (the nearest first) and the larger ones; a range that does not differ from the one before it
    in its walk is left out (it would score the same)."""
    current = _amax(candidates[label].get(key))
    if current is None:
        return []
    found = {other: amax for other in candidates if other != label
             and (amax := _amax(candidates[other].get(key))) is not None and _differs(amax, current)}  # fmt: skip
    below = sorted((other for other in found if found[other] < current), key=lambda other: -found[other])
    above = sorted((other for other in found if found[other] > current), key=lambda other: found[other])
    walks = []
    for walk in (below, above):
        distinct: list[str] = []
        for other in walk:
            if not distinct or _differs(found[other], found[distinct[-1]]):
                distinct.append(other)
        walks.append(distinct)
    return walks


def _by_disagreement(candidates: Mapping[str, Mapping[Key, Any]], chosen: str,
                     keys: Sequence[Key] | None) -> list[Key]:  # fmt: skip
    """``keys`` (all of ``chosen``'s) whose candidates differ from ``chosen``'s range, the largest log-ratio first."""
    spread: dict[Key, float] = {}
    for key in keys if keys is not None else list(candidates[chosen]):
        base = _amax(candidates[chosen].get(key))
        if base is None or base <= 0:
            continue
        ratios = [abs(math.log(amax / base)) for label in candidates
                  if (amax := _amax(candidates[label].get(key))) is not None and amax > 0]  # fmt: skip
        if ratios and max(ratios) >= math.log1p(MIN_DIFFERENCE):
            spread[key] = max(ratios)
    return sorted(spread, key=lambda key: -spread[key])


def _amax(value: Any) -> float | None:
    """A per-tensor range as a float (None: no range, or not one number)."""
    if value is None:
        return None
    array = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value, dtype=np.float64)
    return float(array) if array.size == 1 and np.isfinite(array).all() else None


def _differs(amax: float | None, current: float | None) -> bool:
    return amax is not None and current is not None and abs(amax - current) >= MIN_DIFFERENCE * max(current, 1e-30)

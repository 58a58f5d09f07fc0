"""The model's stem kept float where the held-out samples show that int8 there costs more than it is worth.

Quantization error made early is carried, and often grown, by every layer after it. The first weighted ops of a
model read what int8 holds worst: the raw input (pixels on a step coarser than their own 1/255, audio whose quiet
parts fall below one step), a spectrum's magnitudes, the first features at full resolution with a few channels of
large gain. Leaving the ops nearest the input float is the oldest rule of low-precision inference; whether it pays
differs per model, so ``auto`` measures it, as it measures the ranges.

The **levels** of a view (:func:`stem_levels`) group its int8 weighted ops by how many weighted ops the longest path
from a graph input to them goes through (:meth:`qdq.graphs.view.GraphView.weighted_depth`): level 0 reads the
inputs through no weighted op, level 1 reads level 0's outputs, and so on. :func:`choose_stem` scores the model with
the first ``n`` levels float, ``n`` = 1 .. :data:`STEM_LEVELS`, on each half of the held-out batches
(:func:`qdq.workflow.refinement.halves`; the second half only where the first gained the cost), and keeps the ``n``
whose score rises most above the all-int8 one once :data:`STEM_COST_DB` per level is paid, when it rises by that
much on each half too. Levels are tried together
rather than one op at a time: one float op between int8 ones moves its neighbours' quantizers to other tensors (a
conv's output taken before its activation clips it), which can cost more than it saves. A float op costs speed;
the levels tried are at most :data:`STEM_LEVELS`, within the first :data:`STEM_SHARE` of the model's weighted depth
(the most weighted ops a path from an input to an output goes through, float ones included: the user keeping a
later op float does not shrink the stem), holding at most :data:`STEM_OPS_SHARE` of the int8 weighted ops; the ops
near the input are a small share of most networks' arithmetic.

That share is no bound on what a float stem costs: where its outputs reach int8 ops far apart at full resolution (a
U-Net's skip connections, a residual add), the runtime converts each of those tensors between its float and int8
layouts, and the file can run much slower than its all-int8 twin: a cost only a measurement shows, no count of
operations (figures in ``benchmarks/RESULTS.md``, zoo).
Where a door can time both files on the target's runtime (``timer``: the ONNX door on ONNX Runtime), the levels
chosen are timed against the all-int8 model, and their held-out gain, net of the cost per level, must pay for the time
too: the stem must divide the output error's amplitude by more than it multiplies the time (``20 log10`` of the time
ratio, :attr:`StemTiming.cost_db`: 0.8 dB for 10 % more time, 6 dB for twice the time); otherwise the stem stays int8
(``StemChoice.timing``). Both files are timed on one intra-op thread: the price is a ratio of work, and a pool of
threads on a small or shared machine stalls for a scheduler tick at random, which made the same call keep the stem
or drop it from one run to the next (``benchmarks/RESULTS.md``, zoo_draws).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdq.graphs import ops as vocab
from qdq.graphs.view import GraphView
from qdq.markdown import markdown_table
from qdq.workflow.fidelity import FidelityMeter

__all__ = ["STEM_COST_DB", "STEM_LEVELS", "STEM_OPS_SHARE", "STEM_SHARE", "STEM_SLOWDOWN_MS", "StemChoice", "StemTimer",
           "StemTiming", "choose_stem", "stem_levels"]

#: the stem is tried float up to this many levels deep
STEM_LEVELS = 3
#: the held-out gain (dB) each level left float must pay for
STEM_COST_DB = 0.5
#: the levels tried lie within this share of the model's weighted depth (a third left a network 6-8 weighted ops
#: deep two levels to try; the ops share and the held-out gain still bound what is kept)
STEM_SHARE = 1 / 2
#: the levels tried hold at most this share of the model's int8 weighted ops
STEM_OPS_SHARE = 1 / 2
#: a slowdown under this many milliseconds (median) costs nothing: a small model's timing is noise
STEM_SLOWDOWN_MS = 1.0
#: how a door times the stem's file against the all-int8 one, on one sample: interleaved rounds, and timed runs in each
#: (after one untimed run)
_TIMING_ROUNDS, _TIMING_RUNS = 3, 3


@dataclass(frozen=True)
class StemTiming:
    """The kept stem's file timed against the all-int8 one on one runtime, in interleaved rounds.

    Attributes:
        runtime: the runtime both files ran on.
        int8_ms: the all-int8 file, one median per round (ms per inference).
        stem_ms: the file with the stem float, the same rounds.
    """

    runtime: str
    int8_ms: tuple[float, ...]
    stem_ms: tuple[float, ...]

    @classmethod
    def measure(cls, int8: Path, stem: Path, runtime: str, *, inputs: Mapping[str, Any] | None = None,
                threads: int = 1) -> StemTiming:  # fmt: skip
        """The two files timed on ``runtime`` in interleaved rounds, on one sample: ``inputs``, or random inputs of
        the files' fixed shapes (what every door's timer runs), on ``threads`` intra-op threads (module doc)."""
        from qdq.runtime.benchmark import compare_models

        timed = compare_models({"int8": int8, "stem": stem}, runtime, batch=1, threads=threads, inputs=inputs,
                               warmup=1, rounds=_TIMING_ROUNDS, iters=_TIMING_RUNS)  # fmt: skip
        return cls(runtime, timed.block_ms["int8"], timed.block_ms["stem"])

    @property
    def slowdown(self) -> float:
        """How much slower the stem's file ran (median of the rounds' ratios, minus 1; 0.3: 30 % slower)."""
        return statistics.median(s / i for s, i in zip(self.stem_ms, self.int8_ms)) - 1.0

    @property
    def cost_db(self) -> float:
        """The held-out gain (dB) the slowdown costs: ``20 log10`` of the time ratio, the same factor on the output
        error's amplitude; nothing where the stem ran faster or under :data:`STEM_SLOWDOWN_MS` slower (median)."""
        late = statistics.median(self.stem_ms) - statistics.median(self.int8_ms)
        return 20 * math.log10(1 + self.slowdown) if late >= STEM_SLOWDOWN_MS and self.slowdown > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.slowdown:+.0%} time on {self.runtime}"


@dataclass
class StemChoice:
    """What :func:`choose_stem` measured and kept.

    Attributes:
        levels: the levels kept float (0: the stem stays int8).
        ops: the ops kept float, level by level.
        scores: levels left float -> the held-out score (dB), 0 being the all-int8 model; NaN where the second half
            was not run.
        half_gains: levels left float -> the gain (dB) on each half of the held-out batches (NaN: not run).
        skipped: why nothing was tried ("" when it ran).
        timing: the levels the held-out scores chose, timed against the all-int8 model (None: not timed).
        dropped: the levels the scores chose and the timing dropped (0: none).
    """

    levels: int = 0
    ops: list[str] = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)
    half_gains: dict[int, tuple[float, float]] = field(default_factory=dict)
    skipped: str = ""
    timing: StemTiming | None = None
    dropped: int = 0

    @property
    def tried(self) -> int:
        """How many levels were tried."""
        return max(self.scores, default=0)

    @property
    def gain_db(self) -> float:
        """What the kept levels gained on the held-out batches (dB; 0 when none are kept)."""
        return self.scores[self.levels] - self.scores[0] if self.levels else 0.0

    def summary(self) -> str:
        """One line: the levels kept float and what they gained."""
        if self.skipped:
            return f"stem not tried: {self.skipped}"
        if self.dropped and self.timing is not None:
            gain = self.scores[self.dropped] - self.scores[0]
            return (f"stem int8: float, its first {self.dropped} level(s) gained +{gain:.1f} dB but ran "
                    f"{self.timing}, which costs {self.timing.cost_db:.1f} dB (20 log10 of the time ratio)")
        if not self.levels:
            return f"stem int8 (float up to {self.tried} levels gained less than {STEM_COST_DB} dB a level)"
        timed = f"; {self.timing}" if self.timing is not None else ""
        return (f"stem float: {len(self.ops)} op(s) of the first {self.levels} level(s), +{self.gain_db:.1f} dB "
                f"({self.scores[0]:.1f} -> {self.scores[self.levels]:.1f}){timed}")  # fmt: skip

    def table(self) -> str:
        """Markdown table of the levels tried, with a legend."""
        rows = [[str(n), "—" if math.isnan(score) else f"{score:.2f}",
                 " / ".join("—" if math.isnan(g) else f"{g:+.2f}" for g in self.half_gains.get(n, ())),
                 "kept" if n == self.levels else "dropped: slower" if self.dropped and n == self.dropped else ""]
                for n, score in self.scores.items()]  # fmt: skip
        legend = (f"levels float: the weighted ops nearest the inputs left float (level 0 reads the inputs through no "
                  f"weighted op, level 1 reads level 0, ...). Kept: the most held-out output fidelity once "
                  f"{STEM_COST_DB} dB per level is paid, on the whole and on each half of the held-out batches "
                  f"(—: the first half gained less, the second was not run); dropped where its file, timed against "
                  f"the all-int8 one, ran slower than that gain pays for (20 log10 of the time ratio, in dB).")
        return markdown_table(["levels float", "output fidelity (dB)", "halves (dB)", ""], rows) + "\n\n" + legend


#: ``timer(float_ops)``: the model with ``float_ops`` float timed against the all-int8 one (None: it could not be)
StemTimer = Callable[[list[str]], StemTiming | None]


def stem_levels(view: GraphView, limit: int = STEM_LEVELS) -> list[list[str]]:
    """The names of ``view``'s int8 weighted ops in each of its first levels (see the module docstring): at most
    ``limit`` levels, within the first :data:`STEM_SHARE` of the model's weighted depth, holding at most
    :data:`STEM_OPS_SHARE` of its int8 weighted ops together (a stem, not the model)."""
    deepest = max((view.weighted_depth(value) for op in view.ops for value in op.outputs), default=0)
    limit = min(limit, int(deepest * STEM_SHARE))
    levels: list[list[str]] = [[] for _ in range(limit)]
    total = 0
    for op in view.ops:
        if op.type not in vocab.WEIGHTED or op.name in view.float_ops or not view.is_quantized(op):
            continue
        total += 1
        depth = max((view.weighted_depth(value) for _, value in op.data_inputs), default=0)
        if depth < limit:
            levels[depth].append(op.name)
    kept, count = [], 0
    for level in levels:
        count += len(level)
        if not level or count > STEM_OPS_SHARE * total:
            break
        kept.append(level)
    return kept


def choose_stem(levels: list[list[str]], score: Callable[[list[str], int], FidelityMeter] | None,
                timer: StemTimer | None = None) -> StemChoice:  # fmt: skip
    """How many of ``levels`` to keep float.

    Args:
        levels: from :func:`stem_levels`.
        score: ``score(float_ops, half)``: the model with ``float_ops`` float run on half ``half`` (0 or 1) of the
            held-out batches; None when they cannot be halved (nothing is tried).
        timer: ``timer(float_ops)``: the model with ``float_ops`` float timed against the all-int8 one (None: it
            could not be); None where the door cannot time its files. Called once, for the levels chosen.
    """
    if score is None:
        return StemChoice(skipped="fewer than two held-out batches to check a gain on")
    if not levels:
        return StemChoice(skipped="no int8 weighted op")
    base = (score([], 0), score([], 1))
    choice = StemChoice(scores={0: (base[0] + base[1]).ranked()})
    best = 0.0
    for n in range(1, len(levels) + 1):
        ops = [name for level in levels[:n] for name in level]
        need = STEM_COST_DB * n
        first = score(ops, 0)
        if first.ranked() - base[0].ranked() < need:  # the first half already says no: the second is not run
            choice.half_gains[n] = (first.ranked() - base[0].ranked(), math.nan)
            choice.scores[n] = math.nan
            continue
        second = score(ops, 1)
        choice.scores[n] = (first + second).ranked()
        choice.half_gains[n] = (first.ranked() - base[0].ranked(), second.ranked() - base[1].ranked())
        net = choice.scores[n] - choice.scores[0] - need
        if net > best and min(choice.half_gains[n]) >= need:
            best, choice.levels, choice.ops = net, n, ops
    if choice.levels and timer is not None:
        choice.timing = timer(choice.ops)
        if choice.timing is not None and best <= choice.timing.cost_db:
            choice.dropped, choice.levels, choice.ops = choice.levels, 0, []
    return choice

"""What :func:`qdq.tune` found: every configuration tried (:class:`Trial`), the choice, what the search cost
(:class:`TuneResult`), its Markdown report and its Pareto plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from qdq.atomic import atomic_open
from qdq.errors import QdqConfigError
from qdq.markdown import markdown_table
from qdq.tuning.budget import Budget

__all__ = ["Trial", "TuneResult", "advice"]


@dataclass
class Trial:
    """One configuration tried.

    Attributes:
        name: ``"FP32"``, ``"INT8"``, ``"greedy k"`` (``"(undone)"`` when the step did not improve the score and
            was taken back), ``"top k"`` (the ``k`` units of the largest gain float together) or ``"prune k"``.
        floated: the units left float, each a tuple of tensor names.
        score / holdout: the budget's score on the tuning and the held-out data (holdout None: not evaluated).
        ms / low / high: measured latency (median of the interleaved rounds' block medians, and the 25th-75th
            percentile), ms per batch; None where it was not timed.
        confirmed: (median, 25th, 75th percentile) ms per batch of the confirmation timing, fresh interleaved
            rounds of FP32, INT8 and the fastest configurations that meet the budget, made after they were
            picked; the choice is made on it (not on ``ms``, whose minimum over many noisy trials is biased low).
            None where it was not re-timed.
        matmul_bits: for a precision variant, the bits of the block-quantized weights its float MatMuls got
            (``MatMulNBits``, :mod:`qdq.targets.onnxruntime.passes.matmul_nbits`); None for the others.
        path: its file in the work folder.
    """

    name: str
    floated: tuple[tuple[str, ...], ...]
    score: float
    holdout: float | None = None
    ms: float | None = None
    low: float | None = None
    high: float | None = None
    confirmed: tuple[float, float, float] | None = None
    matmul_bits: int | None = None
    path: Path | None = None

    @property
    def latency(self) -> float | None:
        """The latency to compare (ms per batch): the confirmation's median where there is one, else ``ms``."""
        return self.confirmed[0] if self.confirmed is not None else self.ms

    def meets(self, budget: Budget) -> bool:
        return self.score >= budget.threshold and self.holdout is not None and self.holdout >= budget.threshold


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        path: the chosen file (written atomically), or None when no configuration met the budget.
        budget: the budget, its threshold resolved.
        fp32, int8, chosen: the FP32 file, full INT8 and the chosen configuration (chosen None: none met it).
        trials: every configuration tried, in order.
        gains: unit -> the budget's proxy (default: output SQNR in dB against FP32) on the first tuning batch gained
            by leaving it float alone (the sensitivity pass, which orders the greedy search).
        evaluations: files scored (tuning and held-out splits counted once each); files: files written;
            builds: files loaded on the runtime (sessions; engine builds on TensorRT), for scoring and timing;
            calibrations: calibration passes (1); seconds: wall time.
        advice: the next step when the result is no faster than FP32 or nothing met the budget.
        runtime: where the latencies were measured; batch: the timed batch size.
        unit_ms: unit -> the latency it adds (ms per batch: the difference of the medians, and the lowest and
            highest difference the two 25th-75th percentile ranges allow), measured between two timed configurations
            that differ by that unit alone; units without such a pair are absent.
        made_by: tensor -> what computes it in the FP32 file: the op type, and the module it belongs to where the
            exporter recorded one (``"Softmax in blocks.2.attn"``), or ``"graph input"``.
    """

    path: Path | None
    budget: Budget
    fp32: Trial
    int8: Trial
    chosen: Trial | None
    trials: list[Trial]
    gains: dict[tuple[str, ...], float]
    evaluations: int
    files: int
    calibrations: int
    seconds: float
    builds: int = 0
    advice: str | None = None
    runtime: str = "onnxruntime"
    batch: int = 1
    unit_ms: dict[tuple[str, ...], tuple[float, float, float]] = field(default_factory=dict)
    made_by: dict[str, str] = field(default_factory=dict)

    def describe(self, unit: tuple[str, ...]) -> str:
        """``unit``'s tensors, each with what computes it (``made_by``) where known."""
        return ", ".join(f"{name} ({self.made_by[name]})" if name in self.made_by else name for name in unit)

    def report(self) -> str:
        """A Markdown report: the budget, every configuration (score, held-out score, measured latency), the
        units left float with their gain and measured cost, and the search's cost."""
        fp32_ms = self.fp32.ms or math.nan
        lines = [f"# tune: {self.budget.describe()} on {self.runtime}", ""]
        rows = []
        for trial in [self.fp32, *self.trials]:
            speed = f"{fp32_ms / trial.ms:.2f}x" if trial.ms else "-"
            timed = f"{trial.ms:.2f} ({trial.low:.2f}-{trial.high:.2f})" if trial.ms else "-"
            held = "-" if trial.holdout is None else f"{trial.holdout:.4g}"
            verdict = "PASS" if trial.meets(self.budget) else "FAIL"
            mark = " (chosen)" if trial is self.chosen else ""
            rows.append([trial.name + mark, str(len(trial.floated)), f"{trial.score:.4g}", held, verdict, timed, speed])
        lines += [markdown_table(["configuration", "units float", "score (tuning)", "score (held-out)", "budget",
                                  f"ms per batch of {self.batch}", "speed-up vs FP32"], rows), ""]  # fmt: skip
        if any(t.matmul_bits for t in self.trials):
            lines += ["- N MatMul(s) k-bit: the configuration named with its float MatMuls on constant weights run as "
                      "ONNX Runtime's MatMulNBits (k-bit weights in blocks of 32, activations quantized to int8 per "
                      "block at run time).", ""]  # fmt: skip
        lines += [
            "- score: " + self.budget.name + " on the tuning data and on the held-out data ('-': not evaluated, the "
            "tuning score already misses). budget: PASS when both reach the threshold.",
            "- ms: median of interleaved rounds (25th-75th percentile), measured on the runtime; speed-up: FP32 ms "
            "/ this ms (> 1: faster than FP32).",
            "",
        ]
        if self.chosen is not None and self.chosen.floated:
            stepped = any(unit in self.unit_ms for unit in self.chosen.floated)
            unit_rows = [[self.describe(unit), f"{self.gains.get(unit, math.nan):+.2f}"]
                         + ([_cost(self.unit_ms[unit]) if unit in self.unit_ms else "-"] if stepped else [])
                         for unit in self.chosen.floated]  # fmt: skip
            header = ["tensors left float", "proxy gained alone"] + (["measured ms added"] if stepped else [])
            lines += [markdown_table(header, unit_rows), ""]
            if stepped:
                lines += ["- measured ms added: the latency difference between two timed configurations that differ "
                          "by that unit alone (a pruning try without it, else the greedy step that added it): the "
                          "difference of their medians, and in brackets the range their 25th-75th percentiles allow; "
                          "a range across zero is below the timing's resolution."]  # fmt: skip
            if self.chosen.latency is not None and self.int8.latency is not None:
                lines += [f"- together they cost {self.chosen.latency - self.int8.latency:+.2f} ms per batch against "
                          "full INT8 (measured, interleaved)."]  # fmt: skip
            lines.append("")
        lines += self._confirmation()
        top = sorted(self.gains.items(), key=lambda item: -item[1])[:8]
        lines += ["- proxy: what ranks the units, " + ("the budget's own proxy" if self.budget.proxy else
                  "the output SQNR against FP32 (dB)") + ", on the first tuning batch.", ""]  # fmt: skip
        if top:
            lines += [markdown_table(["most sensitive units (tensors)", "proxy gained alone"],
                                     [[self.describe(unit), f"{gain:+.2f}"] for unit, gain in top]), ""]  # fmt: skip
        lines.append(f"Search cost: {self.evaluations} evaluations, {self.files} files written, {self.builds} "
                     f"builds on {self.runtime}, {self.calibrations} calibration, {self.seconds:.0f} s.")  # fmt: skip
        if self.advice:
            lines += ["", self.advice]
        return "\n".join(lines)

    def _confirmation(self) -> list[str]:
        confirmed = [t for t in [self.fp32, *self.trials] if t.confirmed is not None]
        if not confirmed or self.fp32.confirmed is None:
            return []
        fp32_ms = self.fp32.confirmed[0]
        rows = [[t.name + (" (chosen)" if t is self.chosen else ""), f"{t.confirmed[0]:.2f} ({t.confirmed[1]:.2f}-"
                 f"{t.confirmed[2]:.2f})", f"{fp32_ms / t.confirmed[0]:.2f}x"] for t in confirmed if t.confirmed]
        return [markdown_table(["confirmation", f"ms per batch of {self.batch}", "speed-up vs FP32"], rows), "",
                "- confirmation: FP32, INT8, the fastest configurations that meet the budget and the one with the "
                "fewest float units timed again in fresh interleaved rounds; the choice is the fastest of these (the "
                "fastest of many noisy timings is biased low), or one with fewer float units as fast within the "
                "spread (its 25th percentile at most the fastest's 75th).",
                ""]  # fmt: skip

    def plot(self, path: str | Path) -> Path:
        """A Pareto plot (latency against score of every timed configuration) saved at ``path`` (matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise QdqConfigError("the Pareto plot needs matplotlib: pip install 'qdq[app]'.") from err
        timed = [t for t in [self.fp32, *self.trials] if t.ms and math.isfinite(t.score)]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([t.ms or 0.0 for t in timed], [t.score for t in timed], c=["C2" if t.meets(self.budget) else "C3"
                                                                         for t in timed])  # fmt: skip
        for t in timed:
            ax.annotate(t.name, (t.ms or 0.0, t.score), fontsize=7)
        ax.axhline(self.budget.threshold, color="grey", linestyle="--", label="budget")
        ax.set_xlabel(f"ms per batch of {self.batch} ({self.runtime})")
        ax.set_ylabel(self.budget.name)
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        with atomic_open(out) as stream:
            fig.savefig(stream, format=out.suffix.lstrip(".") or "png")
        plt.close(fig)
        return out


def advice(fp32: Trial, int8: Trial, chosen: Trial | None) -> str | None:
    """The next step when the result is no faster than FP32 or nothing met the budget; None otherwise."""
    if int8.latency is not None and fp32.latency is not None and int8.latency >= fp32.latency:
        return ("Even the full INT8 file runs no faster than FP32 on this runtime and machine (an x86 CPU without "
                "VNNI, or a model too small for int8 kernels to pay): keep FP32 here, or deploy where int8 kernels "
                "are fast (a VNNI/AMX CPU, TensorRT).")  # fmt: skip
    if chosen is None:
        return ("No configuration met the budget: raise max_steps (or max_candidates), or fine-tune with "
                "quantization-aware training (docs/guides/qat.md).")  # fmt: skip
    if chosen.latency is not None and fp32.latency is not None and chosen.latency >= fp32.latency:
        return ("The configuration that meets the budget is no faster than FP32: quantization-aware training "
                "(docs/guides/qat.md) is the next step.")  # fmt: skip
    return None


def _cost(cost: tuple[float, float, float]) -> str:
    return f"{cost[0]:+.2f} ({cost[1]:+.2f} to {cost[2]:+.2f})"

"""Latency measurement: warm-up, then a timed loop of single inferences; and speed-ups measured interleaved.

Each inference is timed on its own by the runtime's clock (:meth:`Runtime.time_ms
<qdq.runtime.base.Runtime.time_ms>`: the host's :func:`time.perf_counter` unless a backend keeps its own time);
the result keeps min, median, p90 and mean in milliseconds. Min is the least disturbed by other processes, median
the typical case.

Absolute times (:func:`benchmark_model`): one session alive at a time. ONNX Runtime's intra-op worker threads
spin for a while after each run, so an idle session burns the cores the running one needs (alternating two live
sessions slows both: benchmarks/RESULTS.md, code_figures).

Speed-ups (:func:`compare_models`): on a shared machine the load changes from second to second, so two models
timed one after the other can differ widely for no reason of their own (benchmarks/RESULTS.md, code_figures).
``compare_models`` keeps every model loaded and times them in rounds, each model a block of runs per round (a
few untimed runs first, so that the other session's spinning threads have gone back to sleep), the order
reversed every other round. Each round gives one ratio per model against the baseline, from the two blocks'
medians measured seconds apart; the speed-up is the median of these ratios and its spread their interquartile
range (:class:`SpeedUp`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdq.errors import QdqConfigError
from qdq.runtime._text import markdown_table
from qdq.runtime.backend import load_runtime
from qdq.runtime.base import BenchmarkResult, Inputs, Runtime
from qdq.runtime.model_info import random_inputs

__all__ = ["Comparison", "SpeedUp", "benchmark", "benchmark_model", "compare_models", "results_table"]


def benchmark(
    runtime: Runtime,
    inputs: Inputs | None = None,
    *,
    batch: int | None = None,
    iters: int = 50,
    warmup: int = 10,
    label: str | None = None,
    seed: int = 0,
    sizes: Mapping[str, int] | None = None,
) -> BenchmarkResult:
    """Time ``iters`` inferences of ``runtime`` after ``warmup`` untimed ones.

    Args:
        runtime: a loaded runtime.
        inputs: the feed; by default random data for the model's inputs (see
            :func:`~qdq.runtime.model_info.random_inputs`) at ``batch``.
        batch: batch size of the random feed (default: the runtime's ``batch``, else 1). Ignored when
            ``inputs`` is given; the recorded batch is then the leading dimension of the first input.
        iters: timed inferences (>= 1).
        warmup: untimed inferences before timing (>= 0).
        label: name of the row in tables (default: the ONNX file name).
        seed: seed of the random feed.
        sizes: sizes of the random feed's named dynamic dimensions other than the batch (``{"sequence": 128}``).

    Returns:
        A :class:`~qdq.runtime.base.BenchmarkResult`, times in ms per inference.
    """
    _check_counts(iters, warmup)
    if inputs is None:
        batch = batch or runtime.batch or 1
        inputs = random_inputs(runtime.input_specs, batch, seed=seed, sizes=sizes)
    times_ms = _times_ms(runtime.bind(inputs), runtime, iters, warmup)
    return BenchmarkResult.from_times(
        times_ms,
        label=label or runtime.path.name,
        backend=runtime.name,
        precision=runtime.precision,
        batch=_batch_of(inputs),
        threads=runtime.threads,
        warmup=warmup,
        note=runtime.advice or "",
    )


def benchmark_model(
    onnx_path: str | Path,
    runtime: str = "onnxruntime",
    *,
    batch: int = 1,
    threads: int | None = None,
    iters: int = 50,
    warmup: int = 10,
    label: str | None = None,
    sizes: Mapping[str, int] | None = None,
    **options: Any,
) -> BenchmarkResult:
    """Load ``onnx_path`` on ``runtime``, time it on random inputs of ``batch`` (and ``sizes``: see
    :func:`benchmark`), and close it.

    ``options`` go to the backend's ``load`` (e.g. ``precision="bf16"`` for OpenVINO). Only this
    model's session is alive while it is timed.
    """
    _check_counts(iters, warmup)
    with load_runtime(onnx_path, runtime, threads=threads, batch=batch, **options) as loaded:
        return benchmark(loaded, batch=batch, iters=iters, warmup=warmup, label=label, sizes=sizes)


@dataclass(frozen=True)
class SpeedUp:
    """How many times faster a model ran than the baseline, over interleaved rounds (> 1: faster).

    ``median`` is the median of the per-round ratios (baseline time / model time, each time the median of
    one block of runs); ``low`` and ``high`` are their 25th and 75th percentiles.
    """

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def from_ratios(cls, ratios: Sequence[float]) -> SpeedUp:
        values = np.asarray(ratios, dtype=np.float64)
        low, median, high = np.percentile(values, [25, 50, 75])
        return cls(float(median), float(low), float(high), len(values))

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"


@dataclass(frozen=True)
class Comparison:
    """Models timed in interleaved rounds on one runtime: ``block_ms[label]`` holds one median per round."""

    runtime: str
    batch: int
    threads: int | None
    iters: int
    baseline: str
    block_ms: dict[str, tuple[float, ...]]

    @property
    def rounds(self) -> int:
        return len(self.block_ms[self.baseline])

    def median_ms(self, label: str) -> float:
        """The median over rounds of ``label``'s block medians, in ms per inference."""
        return float(np.median(self.block_ms[label]))

    def speedup(self, label: str) -> SpeedUp:
        """``label`` against the baseline, round by round."""
        base, other = self.block_ms[self.baseline], self.block_ms[label]
        return SpeedUp.from_ratios([b / o for b, o in zip(base, other, strict=True)])


def compare_models(
    models: Mapping[str, str | Path],
    runtime: str = "onnxruntime",
    *,
    baseline: str | None = None,
    batch: int = 1,
    threads: int | None = None,
    rounds: int = 7,
    iters: int = 20,
    warmup: int = 3,
    seed: int = 0,
    progress: Any = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    **options: Any,
) -> Comparison:
    """Time ``models`` (label -> ONNX path) against each other in ``rounds`` interleaved rounds.

    Every model is loaded once with ``options`` (e.g. ``precision="f32"`` for OpenVINO) and fed the same
    random inputs of ``batch``. Each round runs each model ``warmup`` times untimed, then ``iters`` timed
    runs, in the order of ``models`` on even rounds and reversed on odd ones. ``baseline`` (default: the
    first label) is what :meth:`Comparison.speedup` divides by. ``progress``, if given, is called with no
    argument after each block (a progress bar's ``update``). ``inputs`` (input name -> array) replaces the random
    inputs, e.g. one batch of real data of the size the models run at; ``batch`` is then its leading dimension.
    """
    _check_counts(iters, warmup)
    if rounds < 1:
        raise QdqConfigError(f"rounds must be >= 1, got {rounds}")
    labels = list(models)
    baseline = labels[0] if baseline is None else baseline
    if baseline not in models:
        raise QdqConfigError(f"baseline {baseline!r} is not one of the models {labels}")
    loaded: list[Runtime] = []
    try:
        for label in labels:
            loaded.append(load_runtime(models[label], runtime, threads=threads, batch=batch, **options))
        feed = dict(inputs) if inputs is not None else random_inputs(loaded[0].input_specs, batch, seed=seed)
        runtimes = dict(zip(labels, loaded))
        calls = {label: rt.bind(feed) for label, rt in runtimes.items()}
        blocks: dict[str, list[float]] = {label: [] for label in labels}
        for index in range(rounds):
            for label in labels if index % 2 == 0 else labels[::-1]:
                blocks[label].append(_block_median_ms(calls[label], runtimes[label], iters, warmup))
                if progress is not None:
                    progress()
    finally:
        for rt in loaded:
            rt.close()
    return Comparison(loaded[0].name, batch, threads, iters, baseline,
                      {label: tuple(times) for label, times in blocks.items()})  # fmt: skip


def _times_ms(call: Any, runtime: Runtime, iters: int, warmup: int) -> list[float]:
    """``warmup`` untimed calls, then the time of each of ``iters`` calls by ``runtime``'s clock, in ms."""
    for _ in range(warmup):
        call()
    return [runtime.time_ms(call) for _ in range(iters)]


def _block_median_ms(call: Any, runtime: Runtime, iters: int, warmup: int) -> float:
    return float(np.median(_times_ms(call, runtime, iters, warmup)))


def results_table(results: Sequence[BenchmarkResult], baseline: BenchmarkResult | None = None) -> str:
    """Format results as a Markdown table; with a ``baseline``, add speed-up columns (> 1: faster)."""
    headers = ["model", "runtime", "precision", "batch", "threads", "min ms", "median ms", "p90 ms", "mean ms"]
    if baseline is not None:
        headers += ["speed-up (median)", "speed-up (min)"]
    rows = []
    for r in results:
        row: list[object] = [r.label, r.backend, r.precision, r.batch, r.threads or "default"]
        row += [f"{v:.4g}" for v in (r.min_ms, r.median_ms, r.p90_ms, r.mean_ms)]
        if baseline is not None:
            row += [f"{r.speedup_over(baseline, s):.2f}×" for s in ("median", "min")]
        rows.append(row)
    return markdown_table(headers, rows)


def _check_counts(iters: int, warmup: int) -> None:
    if iters < 1:
        raise QdqConfigError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise QdqConfigError(f"warmup must be >= 0, got {warmup}")


def _batch_of(inputs: Inputs) -> int:
    first = inputs if isinstance(inputs, np.ndarray) else next(iter(inputs.values()))
    return int(first.shape[0]) if np.ndim(first) else 1

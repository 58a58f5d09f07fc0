"""Latency measurement: warm-up, then a timed loop of single inferences.

Each inference is timed on its own with :func:`time.perf_counter`; the result keeps min, median, p90
and mean in milliseconds. Min is the least disturbed by other processes, median the typical case.

One session alive at a time. :func:`benchmark_model` loads a model, times it and closes it before
returning, and callers comparing several models should do the same, never keeping several sessions
open in an interleaved A/B loop. ONNX Runtime's intra-op worker threads spin for a while after each
run, so an idle session still burns the cores the running one needs; on the 2-core machine of the
project's probe (notes/probe.md §4) this doubled 2-thread batch-1 medians. Measuring one model at a
time avoids it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qdq.errors import QdqConfigError
from qdq.runtime._text import markdown_table
from qdq.runtime.base import BenchmarkResult, Inputs, Runtime, load_runtime
from qdq.runtime.model_info import random_inputs

__all__ = ["benchmark", "benchmark_model", "results_table"]


def benchmark(
    runtime: Runtime,
    inputs: Inputs | None = None,
    *,
    batch: int | None = None,
    iters: int = 50,
    warmup: int = 10,
    label: str | None = None,
    seed: int = 0,
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

    Returns:
        A :class:`~qdq.runtime.base.BenchmarkResult`, times in ms per inference.
    """
    _check_counts(iters, warmup)
    if inputs is None:
        batch = batch or runtime.batch or 1
        inputs = random_inputs(runtime.input_specs, batch, seed=seed)
    call = runtime.bind(inputs)
    for _ in range(warmup):
        call()
    times_ms = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times_ms.append((time.perf_counter() - start) * 1e3)
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
    **options: Any,
) -> BenchmarkResult:
    """Load ``onnx_path`` on ``runtime``, time it on random inputs of ``batch``, and close it.

    ``options`` go to the backend's ``load`` (e.g. ``precision="bf16"`` for OpenVINO). Only this
    model's session is alive while it is timed.
    """
    _check_counts(iters, warmup)
    with load_runtime(onnx_path, runtime, threads=threads, batch=batch, **options) as loaded:
        return benchmark(loaded, batch=batch, iters=iters, warmup=warmup, label=label)


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

"""benchmark / benchmark_model / compare_models / results_table (no timing is asserted, only the bookkeeping)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from backends import requires_openvino

from qdq.errors import QdqConfigError
from qdq.runtime import (
    Comparison,
    SpeedUp,
    benchmark,
    benchmark_model,
    compare_models,
    load_runtime,
    results_table,
)
from qdq.runtime.ort import OrtRuntime


def test_benchmark_statistics_are_ordered(fp32_onnx: Path) -> None:
    with load_runtime(fp32_onnx, threads=1) as runtime:
        result = benchmark(runtime, batch=2, iters=7, warmup=2)
    assert result.iterations == 7 and len(result.times_ms) == 7 and result.warmup == 2
    assert all(t > 0 for t in result.times_ms)
    assert result.min_ms == min(result.times_ms)
    assert result.min_ms <= result.median_ms <= result.p90_ms <= max(result.times_ms)
    assert result.min_ms <= result.mean_ms <= max(result.times_ms)
    assert (result.batch, result.threads) == (2, 1)
    assert (result.backend, result.precision, result.label) == ("onnxruntime", "fp32", fp32_onnx.name)


def test_benchmark_with_given_inputs_records_their_batch(fp32_onnx: Path) -> None:
    with load_runtime(fp32_onnx) as runtime:
        result = benchmark(runtime, np.zeros((3, 3, 32, 32), np.float32), iters=2, warmup=0, label="zeros")
    assert (result.batch, result.threads, result.label) == (3, None, "zeros")


class _CountingClock(OrtRuntime):
    """A runtime that keeps its own time: the n-th timed call took n ms."""

    def time_ms(self, call):
        call()
        self.ticks = getattr(self, "ticks", 0) + 1
        return float(self.ticks)


def test_every_timed_call_goes_through_the_runtimes_own_clock(fp32_onnx: Path) -> None:
    with _CountingClock.load(fp32_onnx, threads=1) as runtime:
        result = benchmark(runtime, batch=1, iters=5, warmup=3)
    assert result.times_ms == (1.0, 2.0, 3.0, 4.0, 5.0)  # warm-up calls untimed, then the clock's own readings


def test_benchmark_model_closes_its_session(fp32_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = []
    release = OrtRuntime._release
    monkeypatch.setattr(OrtRuntime, "_release", lambda self: (closed.append(self.path), release(self)))
    result = benchmark_model(fp32_onnx, "onnxruntime", batch=4, threads=1, iters=3, warmup=1)
    assert closed == [fp32_onnx]
    assert (result.batch, result.iterations) == (4, 3)


@requires_openvino
def test_benchmark_model_on_openvino(u8_onnx: Path) -> None:
    result = benchmark_model(u8_onnx, "openvino", batch=2, threads=1, iters=3, warmup=1)
    assert (result.backend, result.precision, result.batch, result.threads) == ("openvino", "int8", 2, 1)
    assert result.min_ms <= result.median_ms <= result.p90_ms


@pytest.mark.parametrize(("iters", "warmup", "message"), [(0, 1, "iters must be >= 1"), (1, -1, "warmup")])
def test_benchmark_counts_are_validated(fp32_onnx: Path, iters: int, warmup: int, message: str) -> None:
    with pytest.raises(QdqConfigError, match=message):
        benchmark_model(fp32_onnx, iters=iters, warmup=warmup)


def test_results_table(fp32_onnx: Path, u8_onnx: Path) -> None:
    reference = benchmark_model(fp32_onnx, threads=1, iters=3, warmup=0)
    quantized = benchmark_model(u8_onnx, threads=1, iters=3, warmup=0)
    lines = results_table([reference, quantized], baseline=reference).splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert "speed-up (median)" in lines[0] and "p90 ms" in lines[0]
    assert lines[2].startswith("| tiny_fp32.onnx") and "1.00×" in lines[2]
    expected = reference.median_ms / quantized.median_ms
    assert f"{expected:.2f}×" in lines[3] and "int8" in lines[3]
    assert "speed-up" not in results_table([reference])


def test_speedup_is_the_median_of_the_rounds_ratios_with_their_quartiles() -> None:
    speedup = SpeedUp.from_ratios([1.0, 5.0, 2.0, 4.0, 3.0])
    assert (speedup.median, speedup.low, speedup.high, speedup.rounds) == (3.0, 2.0, 4.0, 5)
    assert str(speedup) == "3.00x (2.00-4.00)"


def test_compare_models_interleaves_the_models_round_by_round(
    fp32_onnx: Path, u8_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    bench_module = importlib.import_module("qdq.runtime.benchmark")  # the module (the package exports the function)

    order: list[float] = []
    fake_ms = iter([4.0, 1.0, 2.0, 4.0, 4.0, 1.0])  # (FP32, INT8), (INT8, FP32), (FP32, INT8)

    def block(call, runtime, iters, warmup):  # records which model ran (the session behind ``call``) and fakes its time
        call()
        order.append(iters)
        return next(fake_ms)

    monkeypatch.setattr(bench_module, "_block_median_ms", block)
    ticks: list[int] = []
    result = compare_models({"FP32": fp32_onnx, "INT8": u8_onnx}, batch=2, threads=1, rounds=3, iters=5,
                            progress=lambda: ticks.append(1))  # fmt: skip
    assert isinstance(result, Comparison) and result.rounds == 3 and len(ticks) == 6 and order == [5] * 6
    # even rounds run FP32 first, odd rounds INT8 first: block times map back to their model
    assert result.block_ms == {"FP32": (4.0, 4.0, 4.0), "INT8": (1.0, 2.0, 1.0)}
    speedup = result.speedup("INT8")
    assert (speedup.median, speedup.low, speedup.high) == (4.0, 3.0, 4.0)
    assert result.speedup("FP32").median == 1.0 and result.median_ms("INT8") == 1.0


def test_compare_models_times_real_sessions_and_checks_its_arguments(fp32_onnx: Path, u8_onnx: Path) -> None:
    result = compare_models({"a": fp32_onnx, "b": u8_onnx}, batch=2, threads=1, rounds=2, iters=2, warmup=0)
    assert all(len(t) == 2 and min(t) > 0 for t in result.block_ms.values()) and result.baseline == "a"
    with pytest.raises(QdqConfigError, match="baseline 'c'"):
        compare_models({"a": fp32_onnx}, baseline="c")
    with pytest.raises(QdqConfigError, match="rounds"):
        compare_models({"a": fp32_onnx}, rounds=0)

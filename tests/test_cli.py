"""``qdq quantize``'s speed check for an ONNX file: the written file timed against the FP32 one."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from onnx_models import constant_weight_conv
from qdq.cli import main, speed_check
from qdq.runtime.benchmark import Comparison


def _timed(fp32_ms: list[float], int8_ms: list[float]):
    def compare(models, runtime, **kwargs):
        assert set(models) == {"fp32", "int8"} and kwargs["batch"] == 4
        return Comparison(runtime, 4, None, 5, "fp32", {"fp32": tuple(fp32_ms), "int8": tuple(int8_ms)})

    return compare


@pytest.mark.parametrize(
    ("int8_ms", "advised"),
    [([2.0, 2.1, 1.9], False), ([5.0, 5.5, 4.5], True), ([5.0, 3.0, 5.0], False)],  # faster; slower; not every round
)
def test_the_check_says_int8_does_not_pay_only_when_slower_in_every_round(monkeypatch, tmp_path, int8_ms, advised):
    benchmark = importlib.import_module("qdq.runtime.benchmark")  # qdq.runtime.benchmark is also a function's name
    monkeypatch.setattr(benchmark, "compare_models", _timed([4.0, 4.0, 4.0], int8_ms))
    feed = {"x": np.zeros((4, 3, 8, 8), np.float32)}
    text = speed_check(tmp_path / "a.onnx", tmp_path / "b.onnx", feed, [], "onnxruntime")
    median = float(np.median([4.0 / t for t in int8_ms]))
    assert f"| onnxruntime | 4     | 4.00    | {np.median(int8_ms):.2f}" in text
    assert f"{median:.2f}x" in text
    assert ("INT8 does not pay" in text) == advised


def test_a_scalar_input_does_not_count_as_the_batch(monkeypatch, tmp_path):
    # silero-vad's inputs: the audio [4, 576], its state [2, 4, 128] and a scalar rate (first here)
    benchmark = importlib.import_module("qdq.runtime.benchmark")
    monkeypatch.setattr(benchmark, "compare_models", _timed([4.0, 4.0, 4.0], [2.0, 2.0, 2.0]))
    feed = {"sr": np.array(16000), "input": np.zeros((4, 576), np.float32), "state": np.zeros((2, 4, 128), np.float32)}
    assert "| onnxruntime | 4     |" in speed_check(tmp_path / "a.onnx", tmp_path / "b.onnx", feed, [], "onnxruntime")


def test_a_target_whose_runtime_builds_engines_is_not_timed(tmp_path):
    feed = {"x": np.zeros((4, 3, 8, 8), np.float32)}
    assert speed_check(tmp_path / "a.onnx", tmp_path / "b.onnx", feed, [], "tensorrt").startswith("speed: not timed")


def test_the_cli_times_the_written_file_unless_told_not_to(tmp_path, capsys):
    model = constant_weight_conv(tmp_path / "net.onnx")
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).random((8, 3, 8, 8), np.float32))
    out = tmp_path / "int8.onnx"
    args = ["quantize", "--model", str(model), "--data", str(tmp_path / "cal.npy"), "--out", str(out),
            "--calib", "percentile"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| onnxruntime | 8 " in printed and "INT8 speed-up" in printed
    assert main([*args, "--no-timing"]) == 0
    assert "INT8 speed-up" not in capsys.readouterr().out

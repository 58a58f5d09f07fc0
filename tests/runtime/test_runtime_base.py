"""The Runtime interface, the registry of backends, lazy imports and BenchmarkResult statistics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qdq.errors import QdqBackendUnavailable, QdqConfigError, QdqTypeError
from qdq.runtime import (
    BenchmarkResult,
    Runtime,
    load_runtime,
    read_model_info,
    register_runtime,
    runtime_names,
    unregister_runtime,
)
from qdq.runtime.backend import get_runtime_class
from qdq.runtime.openvino import OpenVinoRuntime
from qdq.runtime.ort import OrtRuntime


def test_registered_runtimes() -> None:
    assert runtime_names() == ["onnxruntime", "openvino", "tensorrt"]
    assert get_runtime_class("onnxruntime") is OrtRuntime
    assert get_runtime_class("ov") is OpenVinoRuntime


def test_unknown_runtime_lists_names_and_suggests() -> None:
    with pytest.raises(QdqConfigError) as info:
        get_runtime_class("onnxrt")
    message = str(info.value)
    assert "onnxruntime" in message and "openvino" in message and "tensorrt" in message
    assert "Did you mean 'onnxruntime'?" in message
    assert isinstance(info.value, ValueError)


def test_register_runtime_refuses_duplicates() -> None:
    with pytest.raises(QdqConfigError, match="already registered"):
        register_runtime("onnxruntime", OrtRuntime)


def test_register_custom_runtime(fp32_onnx: Path) -> None:
    class EchoRuntime(Runtime):
        name = "echo"

        @classmethod
        def load(cls, onnx_path, *, threads=None, batch=None, **options):  # type: ignore[no-untyped-def]
            return cls(read_model_info(onnx_path), threads=threads, batch=batch)

        @property
        def precision(self) -> str:
            return "echo"

        def _run(self, feed):  # type: ignore[no-untyped-def]
            return [feed["input"] * 2]

        def _release(self) -> None:
            pass

    register_runtime("echo", EchoRuntime)
    try:
        with load_runtime(fp32_onnx, "echo", threads=3) as runtime:
            x = np.ones((1, 3, 32, 32), np.float32)
            np.testing.assert_array_equal(runtime.run(x)[0], 2 * x)
            assert runtime.threads == 3
    finally:
        unregister_runtime("echo")
    assert "echo" not in runtime_names()


def test_missing_backend_package_names_the_pip_command(fp32_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # makes `import openvino` fail
    with pytest.raises(QdqBackendUnavailable, match="pip install openvino") as info:
        load_runtime(fp32_onnx, "openvino")
    assert isinstance(info.value, ImportError)


def test_tensorrt_unavailable_here_is_a_clean_error(fp32_onnx: Path) -> None:
    try:
        import tensorrt  # noqa: F401
        import torch

        if torch.cuda.is_available():
            pytest.skip("TensorRT and a GPU are available: covered by test_tensorrt_backend.py")
    except ImportError:
        pass
    with pytest.raises(QdqBackendUnavailable, match=r"tensorrt|CUDA GPU"):
        load_runtime(fp32_onnx, "tensorrt")


def test_importing_runtime_and_cli_imports_no_backend() -> None:
    code = (
        "import sys, qdq.runtime, qdq.cli; "
        "print(sorted(m for m in ('onnx', 'onnxruntime', 'openvino', 'tensorrt', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_benchmark_result_statistics() -> None:
    times = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 7.0, 8.0, 9.0]
    result = BenchmarkResult.from_times(
        times, label="m", backend="onnxruntime", precision="int8", batch=8, threads=2, warmup=3
    )
    assert (result.min_ms, result.median_ms, result.mean_ms) == (1.0, 5.5, 5.5)
    assert result.p90_ms == pytest.approx(9.1)  # linear interpolation between 9 and 10
    assert result.iterations == 10 and result.warmup == 3
    assert (result.batch, result.threads) == (8, 2)
    slower = BenchmarkResult.from_times([11.0], label="ref", backend="onnxruntime", precision="fp32",
                                        batch=8, threads=2, warmup=3)  # fmt: skip
    assert result.speedup_over(slower) == pytest.approx(2.0)
    assert result.speedup_over(slower, "min") == pytest.approx(11.0)


def test_benchmark_result_needs_timings() -> None:
    with pytest.raises(QdqConfigError, match="iterations must be >= 1"):
        BenchmarkResult.from_times([], label="m", backend="b", precision="p", batch=1, threads=None, warmup=0)


def test_feed_validation(fp32_onnx: Path) -> None:
    runtime = load_runtime(fp32_onnx, threads=1)
    assert runtime.input_names == ["input"] and runtime.output_names == ["logits"]
    with pytest.raises(QdqConfigError, match=r"missing \['input'\], unknown \['x'\]"):
        runtime.run({"x": np.zeros((1, 3, 32, 32), np.float32)})
    with pytest.raises(QdqTypeError, match="numpy array or a dict"):
        runtime.run([np.zeros((1, 3, 32, 32), np.float32)])  # type: ignore[arg-type]
    runtime.close()
    runtime.close()  # idempotent
    assert "closed" in repr(runtime)
    with pytest.raises(QdqConfigError, match="closed"):
        runtime.run(np.zeros((1, 3, 32, 32), np.float32))


@pytest.mark.parametrize("options", [{"threads": 0}, {"threads": True}, {"batch": -1}, {"batch": 2.0}])
def test_common_options_are_validated(fp32_onnx: Path, options: dict) -> None:
    with pytest.raises(QdqConfigError, match="must be a positive integer"):
        load_runtime(fp32_onnx, **options)


def test_bound_call_refuses_a_closed_runtime(fp32_onnx: Path) -> None:
    runtime = load_runtime(fp32_onnx, threads=1)
    call = runtime.bind(np.zeros((1, 3, 32, 32), np.float32))
    assert call()[0].shape == (1, 10)
    runtime.close()
    with pytest.raises(QdqConfigError, match="closed"):
        call()

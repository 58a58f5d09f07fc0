"""TensorRT backend on a CUDA GPU (skipped without tensorrt or a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

trt = pytest.importorskip("tensorrt")
if not torch.cuda.is_available():
    pytest.skip("TensorRT tests need a CUDA GPU", allow_module_level=True)

from qdq.runtime import benchmark, load_runtime  # noqa: E402
from qdq.runtime.tensorrt import TensorRtRuntime  # noqa: E402


def test_fp32_engine_matches_torch(fp32_onnx: Path, torch_model: torch.nn.Module, batch_input: torch.Tensor) -> None:
    with torch.no_grad():
        expected = torch_model(batch_input).numpy()
    with load_runtime(fp32_onnx, "tensorrt", batch=4) as runtime:
        assert isinstance(runtime, TensorRtRuntime)
        assert runtime.precision == "fp32"
        (logits,) = runtime.run(batch_input.numpy())
    # TensorRT may use TF32 for float convolutions.
    np.testing.assert_allclose(logits, expected, rtol=1e-2, atol=1e-3)


def test_tensorrt_style_int8_engine_matches_onnxruntime(trt_onnx: Path, batch_input: torch.Tensor) -> None:
    x = batch_input.numpy()
    with load_runtime(trt_onnx, "onnxruntime") as runtime:
        (reference,) = runtime.run(x)
    with load_runtime(trt_onnx, "tensorrt", batch=4) as runtime:
        assert runtime.precision == "int8"
        (logits,) = runtime.run(x)
    assert np.abs(logits - reference).max() <= 0.02 * np.abs(reference).max()


def test_engine_benchmark(trt_onnx: Path) -> None:
    with load_runtime(trt_onnx, "tensorrt", batch=2) as runtime:
        result = benchmark(runtime, iters=10, warmup=3)
    assert (result.backend, result.batch, result.iterations) == ("tensorrt", 2, 10)
    assert result.min_ms <= result.median_ms <= result.p90_ms

"""ONNX Runtime backend: session settings, numerics against torch, error paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from qdq.errors import QdqConfigError
from qdq.runtime import load_runtime
from qdq.runtime.model_info import read_model_info
from qdq.runtime.ort import OrtRuntime


def test_session_settings(fp32_onnx: Path) -> None:
    with load_runtime(fp32_onnx, threads=2, optimization_level="extended") as runtime:
        assert isinstance(runtime, OrtRuntime)
        options = runtime.session.get_session_options()
        assert options.intra_op_num_threads == 2
        assert options.inter_op_num_threads == 1
        assert str(options.execution_mode).endswith("ORT_SEQUENTIAL")
        assert str(options.graph_optimization_level).endswith("ORT_ENABLE_EXTENDED")
        assert runtime.precision == "fp32"
        assert runtime.threads == 2


def test_fp32_matches_torch(fp32_onnx: Path, torch_model: torch.nn.Module, batch_input: torch.Tensor) -> None:
    with torch.no_grad():
        expected = torch_model(batch_input).numpy()
    with load_runtime(fp32_onnx, threads=1) as runtime:
        (logits,) = runtime.run(batch_input.numpy())
    assert logits.shape == (3, 10)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


def test_int8_model_stays_close_to_fp32(fp32_onnx: Path, u8_onnx: Path, batch_input: torch.Tensor) -> None:
    x = batch_input.numpy()
    with load_runtime(fp32_onnx, threads=1) as runtime:
        (reference,) = runtime.run(x)
    with load_runtime(u8_onnx, threads=1) as runtime:
        assert runtime.precision == "int8"
        (logits,) = runtime.run({"input": x})
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error < 0.05, f"int8 logits differ from fp32 by {error:.1%} of the output range"


def test_unknown_optimization_level(fp32_onnx: Path) -> None:
    with pytest.raises(QdqConfigError, match="Did you mean 'all'"):
        load_runtime(fp32_onnx, optimization_level="al")


def test_model_ort_cannot_load_is_a_config_error(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"])], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )  # fmt: skip
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(QdqConfigError, match="onnxruntime cannot load"):
        load_runtime(path)


def test_wrong_input_shape_is_a_config_error(fp32_onnx: Path) -> None:
    with load_runtime(fp32_onnx) as runtime, pytest.raises(QdqConfigError, match=r"cannot run .*dimensions"):
        runtime.run(np.zeros((1, 2, 32, 32), np.float32))


def test_float16_file_loads_without_the_nchwc_pass(vit_fp16_onnx) -> None:
    """ONNX Runtime 1.32 crashes the process creating an ORT_ENABLE_ALL session for this float16 ViT (its
    NchwcTransformer); qdq's runtime leaves that pass out for files recording float16. Run in a child process,
    so that a regression fails this test instead of killing the test run."""
    import subprocess
    import sys

    path, x = vit_fp16_onnx
    info = read_model_info(path)
    assert info.float_type == "float16" and info.precision == "int8+fp16"
    np.save(path.with_suffix(".npy"), x)
    script = (
        "import sys, numpy as np; from qdq.runtime import load_runtime; "
        "r = load_runtime(sys.argv[1], 'onnxruntime'); out = r.run(np.load(sys.argv[2]))[0]; "
        "print(r.precision, out.shape, bool(np.isfinite(out).all()))"
    )
    child = subprocess.run([sys.executable, "-c", script, str(path), str(path.with_suffix(".npy"))],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["int8+fp16", "(2,", "10)", "True"]

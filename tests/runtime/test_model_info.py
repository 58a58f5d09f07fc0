"""read_model_info / random_inputs: input specs, precision label, and the user-error paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import rt_models

from qdq.errors import QdqConfigError
from qdq.runtime import TensorSpec, random_inputs, read_model_info


def test_fp32_model_info(fp32_onnx: Path) -> None:
    info = read_model_info(fp32_onnx)
    assert info.inputs == (TensorSpec("input", ("batch", 3, 32, 32), np.dtype(np.float32)),)
    assert info.outputs == ("logits",)
    assert info.op_counts["Conv"] == rt_models.TinyCnn.n_convs
    assert not info.quantized
    assert info.precision == "fp32"


def test_quantized_model_info(u8_onnx: Path) -> None:
    info = read_model_info(u8_onnx)
    assert info.quantized
    assert info.precision == "int8"
    assert info.op_counts["QuantizeLinear"] > 0


def test_random_inputs_fill_the_batch_dimension(fp32_onnx: Path) -> None:
    specs = read_model_info(fp32_onnx).inputs
    feed = random_inputs(specs, batch=4, seed=3)
    assert list(feed) == ["input"]
    assert feed["input"].shape == (4, 3, 32, 32)
    assert feed["input"].dtype == np.float32
    np.testing.assert_array_equal(feed["input"], random_inputs(specs, batch=4, seed=3)["input"])
    assert not np.array_equal(feed["input"], random_inputs(specs, batch=4, seed=4)["input"])


def test_integer_inputs_get_integers() -> None:
    feed = random_inputs([TensorSpec("ids", ("batch", 5), np.dtype(np.int64))], batch=2)
    assert feed["ids"].dtype == np.int64
    assert feed["ids"].shape == (2, 5)


def test_fixed_batch_refuses_another_batch() -> None:
    spec = TensorSpec("x", (1, 3), np.dtype(np.float32))
    assert spec.concrete_shape(1) == (1, 3)
    with pytest.raises(QdqConfigError, match="fixed batch size of 1"):
        spec.concrete_shape(8)


def test_dynamic_non_batch_dimension_needs_explicit_inputs() -> None:
    spec = TensorSpec("x", ("batch", "height"), np.dtype(np.float32))
    with pytest.raises(QdqConfigError, match="dynamic dimension 'height' at axis 1"):
        random_inputs([spec], batch=2)


def test_named_dynamic_dimensions_take_their_sizes_and_masks_are_ones() -> None:
    specs = [
        TensorSpec("input_ids", ("batch", "sequence"), np.dtype(np.int64)),
        TensorSpec("attention_mask", ("batch", "sequence"), np.dtype(np.int64)),
    ]
    feed = random_inputs(specs, batch=3, sizes={"sequence": 7})
    assert feed["input_ids"].shape == feed["attention_mask"].shape == (3, 7)
    assert (feed["attention_mask"] == 1).all() and feed["input_ids"].max() < 10
    with pytest.raises(QdqConfigError, match="--seq-len"):
        random_inputs(specs, batch=3)


def test_batch_must_be_positive(fp32_onnx: Path) -> None:
    with pytest.raises(QdqConfigError, match="batch must be >= 1"):
        random_inputs(read_model_info(fp32_onnx).inputs, batch=0)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), (b"hello, not onnx\n", "not an ONNX model"), (b"", "not an ONNX model")],
    ids=["missing", "text", "empty"],
)
def test_bad_files_raise_config_errors(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(QdqConfigError, match=message):
        read_model_info(path)


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(QdqConfigError, match="not a file"):
        read_model_info(tmp_path)

"""Runtimes on CPUs whose int8 dot products saturate: the int8 weights of ORT's own quantizer (``u8_onnx``)
and of a TensorRT-style graph (``trt_onnx``), re-encoded as uint8 before the backend compiles the model.

The reference is ONNX Runtime with graph optimizations off (its reference kernels, which compute
``DequantizeLinear`` then a float Conv: no int8 dot product, so nothing saturates)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import qdq.cpu
from qdq.runtime import load_runtime

# int8 weights with more than 64 levels: u8_onnx 4 convs and the classifier, trt_onnx its 4 convs
REENCODED = {"u8_onnx": 5, "trt_onnx": 4}


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    with load_runtime(path, "onnxruntime", threads=1, optimization_level="disable") as runtime:
        return runtime.run(x)[0]


@pytest.mark.parametrize("model", ["u8_onnx", "trt_onnx"])
def test_onnxruntime_with_uint8_weights_matches_its_reference_kernels(model, request, batch_input: torch.Tensor):
    path, x = request.getfixturevalue(model), batch_input.numpy()
    with load_runtime(path, "onnxruntime", threads=1, uint8_weights=True) as runtime:
        assert runtime.reencoded_weights == REENCODED[model] and runtime.precision == "int8"
        out = runtime.run(x)[0]
    # u8_onnx: every layer is an int8 kernel, bit for bit; trt_onnx: float Conv outputs (float32 rounding)
    np.testing.assert_allclose(out, reference(path, x), rtol=0, atol=1e-4 * np.abs(out).max())


def test_onnxruntime_default_follows_the_cpu(u8_onnx: Path, monkeypatch):
    for saturates in (True, False):
        monkeypatch.setattr(qdq.cpu, "int8_dot_saturates", lambda s=saturates: s)
        with load_runtime(u8_onnx, "onnxruntime", threads=1) as runtime:
            assert runtime.reencoded_weights == (REENCODED["u8_onnx"] if saturates else 0)


@pytest.mark.parametrize("model", ["u8_onnx", "trt_onnx"])
def test_openvino_with_uint8_weights_runs_them_in_float_exactly(model, request, batch_input: torch.Tensor):
    pytest.importorskip("openvino", reason="needs openvino")
    from qdq.runtime.openvino import precision_report

    path, x = request.getfixturevalue(model), batch_input.numpy()
    with load_runtime(path, "openvino", threads=1, uint8_weights=True) as runtime:
        out = runtime.run(x)[0]
    np.testing.assert_allclose(out, reference(path, x), rtol=0, atol=1e-4 * np.abs(out).max())
    assert set(precision_report(path, threads=1, uint8_weights=True).counts("Convolution")) == {"f32"}


def test_openvino_warns_when_it_moves_layers_to_float(u8_onnx: Path, monkeypatch):
    pytest.importorskip("openvino", reason="needs openvino")
    monkeypatch.setattr(qdq.cpu, "int8_dot_saturates", lambda: True)
    with pytest.warns(UserWarning, match="5 int8 weight.*runs those layers in float.*weight_bits=7"):
        load_runtime(u8_onnx, "openvino", threads=1).close()
    monkeypatch.setattr(qdq.cpu, "int8_dot_saturates", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_runtime(u8_onnx, "openvino", threads=1).close()

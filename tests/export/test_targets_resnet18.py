"""torchvision ResNet-18 (random init, 3x64x64) through placement and export, for both targets.

* target "onnxruntime": in the graph ONNX Runtime optimizes (``optimized_model_filepath``) every one of the
  20 Convs is a ``QLinearConv`` (none left as Conv / FusedConv), the 8 residual adds are ``QLinearAdd`` and
  the classifier a ``QGemm``; the output stays within a few steps of the PyTorch model (BatchNorm folded
  into the int8 weights' scales and int32 biases change float rounding, not the grid).
* target "tensorrt": every Q/DQ pair computes the PyTorch quantizer's function bit for bit (teacher forced:
  the quantizer applied to the input ORT computed), the first one sees the same input and gives the same
  values, every Q/DQ is int8 with zero point 0, and the pairs are exactly the model's enabled quantizers.
  End to end, float convolutions that round differently in ORT and PyTorch move one value across a rounding
  boundary now and then (CPU dependent: 1 of 32768 at the second quantizer on an AVX2 CPU), and 20 layers
  amplify that to a few output steps: the output is checked to a few steps, with the same top-1.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
import torchvision
from export_helpers import (
    calibrate_max,
    inexact_quantizers,
    onnx_quantizer_outputs,
    ort_session,
    quantizer_outputs,
    run_ort,
    steps_apart,
    teacher_forced_mismatches,
)

import qdq
from qdq.export import export_onnx, qdq_sites
from qdq.placement import apply_placement
from qdq.quantizer import TensorQuantizer

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))


def placed_resnet18(target: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = apply_placement(qdq.quantize_model(torchvision.models.resnet18(num_classes=10)), target=target)
    calibrate_max(model, X)
    return model.eval()


@pytest.mark.slow
def test_onnxruntime_target_runs_every_conv_in_int8(tmp_path):
    model = placed_resnet18("onnxruntime")
    path = export_onnx(model, X, tmp_path / "r18.onnx", target="onnxruntime", dynamo=False)
    optimized = tmp_path / "r18_optimized.onnx"
    out = ort_session(path, optimize=True, optimized_path=optimized).run(None, {"input": X.numpy()})[0]
    kernels = Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
    assert kernels["QLinearConv"] == 20
    assert kernels["Conv"] == kernels["FusedConv"] == kernels["NchwcConv"] == 0
    assert kernels["QLinearAdd"] == 8 and kernels["QGemm"] == 1
    with torch.no_grad():
        reference = model(X).numpy()
    assert steps_apart(reference, out) <= 4.0


@pytest.mark.slow
def test_tensorrt_target_is_bit_exact_at_every_quantizer(tmp_path):
    model = placed_resnet18("tensorrt")
    path = export_onnx(model, X, tmp_path / "r18.onnx", target="tensorrt", dynamo=False)
    assert teacher_forced_mismatches(model, path, X) == {}
    first = "conv1._input_quantizer"
    assert first not in inexact_quantizers(quantizer_outputs(model, X), onnx_quantizer_outputs(path, X))
    sites = qdq_sites(onnx.load(str(path)))
    enabled = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    assert sorted(n for s in sites for n in s.quantizers) == sorted(enabled)
    assert all(s.zero_point.dtype == np.int8 and not s.zero_point.any() for s in sites)
    with torch.no_grad():
        reference = model(X).numpy()
    engine = run_ort(path, X)
    assert steps_apart(reference, engine) <= 8.0
    assert (reference.argmax(1) == engine.argmax(1)).all()

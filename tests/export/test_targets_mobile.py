"""torchvision MobileNetV2 and EfficientNet-B0 (random init, 3x64x64) exported for ONNX Runtime.

* Every Conv is a ``QLinearConv`` in the graph ORT optimizes (none left as Conv / FusedConv / NCHWc Conv),
  and no Q/DQ is left between int8 kernels: ReLU6 folds into the convs, SiLU and the squeeze-excitation run
  as QLinearSigmoid / QLinearMul, the pools as QLinearGlobalAveragePool. The output stays within a couple of
  output steps of PyTorch, and the graph holds exactly the model's enabled quantizers.
* Quantizers with a vanishing range (``amax <= 2**-24``: PyTorch gives zeros, the export multiplies by a 0/1
  mask before the Q) keep every Conv in int8: the rewrite folds the mask into the Conv before it, or drops
  it when its input is zero anyway. This is what the random-init models of ``benchmarks/cpu_int8.py`` hit
  from their middle on (BatchNorm with unit running variance makes activations shrink layer after layer).

BatchNorm statistics get one training-mode pass (momentum 0.1) so that activations keep a usable range.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torchvision
from export_helpers import calibrate_max, run_ort, steps_apart
from torch import nn

import qdq
from qdq.export import export_onnx, qdq_sites
from qdq.quantizer import TensorQuantizer
from qdq.runtime.ort import fusion_report
from qdq.tensor_quant import AMAX_EPSILON

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
BN_BATCH = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))

CONVS = {"mobilenet_v2": 52, "efficientnet_b0": 81}
# BatchNorms set to output zeros in the vanishing-range test (their conv's quantizer calibrates to amax 0):
# a depthwise conv followed by ReLU6 (the mask follows a Clip), a projection conv read by a residual add, and
# a depthwise conv followed by SiLU and squeeze-excitation (zeros then reach a pool and a product)
DEAD = {
    "mobilenet_v2": ["features.15.conv.1.1", "features.16.conv.3"],
    "efficientnet_b0": ["features.3.0.block.1.1"],
}


def ort_model(name: str, batchnorm_pass: bool = True, dead: tuple[str, ...] = ()) -> torch.nn.Module:
    """``name`` quantized for ONNX Runtime and max-calibrated on X; the BatchNorms ``dead`` output zeros."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    if batchnorm_pass:
        with torch.no_grad():
            model.train()(BN_BATCH)
    for bn in dead:
        nn.init.zeros_(model.get_submodule(bn).weight)
        nn.init.zeros_(model.get_submodule(bn).bias)
    model = qdq.quantize_model(model.eval(), qdq.QuantConfig(target="onnxruntime"))
    calibrate_max(model, X)
    return model.eval()


def check_all_int8(path, name: str) -> None:
    report = fusion_report(path, threads=1)
    assert report.source_weighted == {"Conv": CONVS[name], "Gemm": 1}
    assert report.int8_kernels == {"com.microsoft:QLinearConv": CONVS[name], "com.microsoft:QGemm": 1}
    assert report.n_float == 0
    assert report.problems == (), report.to_markdown()


def enabled_quantizers(model: torch.nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONVS))
def test_every_conv_is_qlinearconv(tmp_path, name):
    model = ort_model(name)
    path = export_onnx(model, X, tmp_path / f"{name}.onnx", target="onnxruntime", dynamo=False)
    check_all_int8(path, name)
    assert sorted(n for s in qdq_sites(onnx.load(str(path))) for n in s.quantizers) == enabled_quantizers(model)
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X)) <= 2.0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONVS))
def test_vanishing_ranges_keep_every_conv_in_int8(tmp_path, name):
    model = ort_model(name, dead=tuple(DEAD[name]))
    zeros = [
        n
        for n, m in model.named_modules()
        if isinstance(m, TensorQuantizer) and m.amax is not None and m.amax.max() == 0
    ]
    assert len(zeros) >= len(DEAD[name])
    path = export_onnx(model, X, tmp_path / f"{name}.onnx", target="onnxruntime", dynamo=False)
    check_all_int8(path, name)
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X)) <= 2.0


@pytest.mark.slow
def test_vanished_random_init_model_keeps_every_conv_in_int8(tmp_path):
    model = ort_model("efficientnet_b0", batchnorm_pass=False)
    amax = [float(m.amax.max()) for m in model.modules() if isinstance(m, TensorQuantizer) and m.amax is not None]
    assert sum(a <= AMAX_EPSILON for a in amax) > 50  # the collapse this test is about
    path = export_onnx(model, X, tmp_path / "effnet.onnx", target="onnxruntime", dynamo=False)
    check_all_int8(path, "efficientnet_b0")
    with torch.no_grad():
        np.testing.assert_allclose(run_ort(path, X), model(X).numpy(), atol=1e-6)


class PoolNet(nn.Module):
    """Conv -> ReLU -> global average pool -> flatten -> Linear, the pooling written functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1)
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_global_pool_runs_in_int8(tmp_path, dynamo):
    """The dynamo exporter writes the pool as ReduceMean, TorchScript as GlobalAveragePool -> Flatten: both
    become QLinearGlobalAveragePool with no Q/DQ left between int8 kernels."""
    torch.manual_seed(0)
    model = qdq.quantize_model(PoolNet(), qdq.QuantConfig(target="onnxruntime"))
    calibrate_max(model, X)
    path = export_onnx(model.eval(), X, tmp_path / "pool.onnx", target="onnxruntime", dynamo=dynamo)
    report = fusion_report(path, threads=1)
    assert report.count("QLinearGlobalAveragePool") == 1 and report.count("QLinearConv") == 1
    assert report.problems == (), report.to_markdown()
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X)) <= 1.0

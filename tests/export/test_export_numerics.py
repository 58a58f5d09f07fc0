"""Export -> ONNX Runtime round trip against the PyTorch fake-quant model, per layer type.

One small model holds every layer type (Conv2d, ConvTranspose2d, AvgPool, QuantAdd, QuantConcat, Linear).
For per-tensor and per-channel weights, both exporters and both targets it checks:

* the value of every Q/DQ pair in ONNX Runtime (reference kernels) equals the PyTorch quantizer's output
  bit for bit (target tensorrt); for target onnxruntime, where biases become int32, the quantizers before
  the first biased layer and every weight are exact;
* the final output is within 1 quantization step (max |output| / 127) of PyTorch, with ORT's reference
  kernels and with its optimized (int8) graph;
* the Q/DQ pairs are exactly the model's enabled quantizers, with the right axis, scale size and zero point;
* ``onnx.checker`` passes, the input/output are ``input``/``output`` with a symbolic batch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_helpers import (
    calibrate_max,
    inexact_quantizers,
    onnx_quantizer_outputs,
    quantizer_outputs,
    run_ort,
    steps_apart,
)
from torch import nn

from qdq import nn as qnn
from qdq.descriptor import QuantDescriptor
from qdq.export import export_onnx, qdq_sites
from qdq.quantizer import TensorQuantizer


class AllOps(nn.Module):
    """conv -> relu -> avgpool -> conv-transpose, + residual add, concat, linear head."""

    def __init__(self, per_channel: bool) -> None:
        super().__init__()
        w = QuantDescriptor(axis=0) if per_channel else QuantDescriptor()
        self.conv = qnn.QuantConv2d(3, 8, 3, padding=1, quant_desc_weight=w)
        self.relu = nn.ReLU()
        self.pool = qnn.QuantAvgPool2d(2)
        self.up = qnn.QuantConvTranspose2d(8, 6, 2, stride=2, quant_desc_weight=w)
        self.side = nn.Conv2d(8, 6, 1)  # float: the residual add's first input
        self.add = qnn.QuantAdd(quantize=(True, True))
        self.cat = qnn.QuantConcat(dim=1)
        self.fc = qnn.QuantLinear(14, 5, quant_desc_weight=w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.relu(self.conv(x))
        b = self.up(self.pool(a))
        s = self.add(self.side(a), b)
        c = self.cat([s, a[:, :8]])
        return self.fc(c.mean(dim=(2, 3)))


# This model is not placed for onnxruntime (a float conv, a signed quantizer after ReLU): export warns.
pytestmark = pytest.mark.filterwarnings("ignore:.*will run in float on ONNX Runtime")

INPUT = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
_CACHE: dict[tuple, tuple] = {}


def exported(tmp_path_factory: pytest.TempPathFactory, per_channel: bool, dynamo: bool, target: str) -> tuple:
    """(model, path), exported once per configuration."""
    key = (per_channel, dynamo, target)
    if key not in _CACHE:
        torch.manual_seed(0)
        model = AllOps(per_channel).eval()
        calibrate_max(model, INPUT)
        folder = tmp_path_factory.mktemp("allops")
        options = {"weights": "int8"} if target == "onnxruntime" else None  # the same file on every CPU
        path = export_onnx(model, INPUT[:1], folder / "m.onnx", target=target, dynamo=dynamo, target_options=options)
        _CACHE[key] = (model, path)
    return _CACHE[key]


CONFIGS = [
    pytest.param(pc, dyn, tgt, id=f"{'channel' if pc else 'tensor'}-{'dynamo' if dyn else 'torchscript'}-{tgt}")
    for pc in (False, True)
    for dyn in (False, True)
    for tgt in ("tensorrt", "onnxruntime")
]


@pytest.mark.parametrize(("per_channel", "dynamo", "target"), CONFIGS)
def test_output_within_one_step(tmp_path_factory, per_channel, dynamo, target):
    model, path = exported(tmp_path_factory, per_channel, dynamo, target)
    with torch.no_grad():
        reference = model(INPUT).numpy()
    assert steps_apart(reference, run_ort(path, INPUT, optimize=False)) <= 1.0
    assert steps_apart(reference, run_ort(path, INPUT, optimize=True)) <= 1.0


@pytest.mark.parametrize(("per_channel", "dynamo", "target"), CONFIGS)
def test_quantizer_outputs_bit_exact(tmp_path_factory, per_channel, dynamo, target):
    model, path = exported(tmp_path_factory, per_channel, dynamo, target)
    torch_out = quantizer_outputs(model, INPUT)
    onnx_out = onnx_quantizer_outputs(path, INPUT)
    bad = inexact_quantizers(torch_out, onnx_out)
    if target == "tensorrt":
        assert bad == {}
    else:  # int32 biases: quantizers downstream of a biased layer may move by one step
        exact = {"conv._input_quantizer", "conv._weight_quantizer", "up._weight_quantizer", "fc._weight_quantizer"}
        assert exact.isdisjoint(bad)
        for name, error in bad.items():
            step = float(dict(model.named_modules())[name].step_size)
            assert error <= step * 1.0001, name


@pytest.mark.parametrize(("per_channel", "dynamo", "target"), CONFIGS)
def test_qdq_nodes_match_quantizers(tmp_path_factory, per_channel, dynamo, target):
    model, path = exported(tmp_path_factory, per_channel, dynamo, target)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    sites = qdq_sites(proto)
    names = [n for site in sites for n in site.quantizers]
    enabled = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    assert sorted(names) == sorted(enabled)
    untagged = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.name not in
                {site.dequantize.name for site in sites}]  # fmt: skip
    if target == "tensorrt":
        assert untagged == []
    else:  # int32 biases of the Conv/ConvTranspose/Gemm layers that ORT runs in int8
        assert all(n.name.endswith("bias_DequantizeLinear") for n in untagged)
    by_name = {site.quantizer: site for site in sites}
    for module_name, channels in (("conv", 8), ("up", 8), ("fc", 5)):
        site = by_name[f"{module_name}._weight_quantizer"]
        if per_channel:  # ConvTranspose weights (in, out, k, k): axis 0 = its 8 input channels
            assert site.axis == 0 and site.step.shape == (channels,)
        else:
            assert site.axis is None and site.step.shape == ()
        assert site.zero_point.dtype == np.int8 and not site.zero_point.any()
    for site in sites:
        if site.quantizer.endswith("_weight_quantizer"):
            continue
        if target == "tensorrt":
            assert site.zero_point.dtype == np.int8 and not site.zero_point.any()
        else:  # the same grid as int8 with zero point 0
            assert site.zero_point.dtype == np.uint8 and (site.zero_point == 128).all()


@pytest.mark.parametrize(("per_channel", "dynamo", "target"), CONFIGS[:4])
def test_io_names_and_dynamic_batch(tmp_path_factory, per_channel, dynamo, target):
    model, path = exported(tmp_path_factory, per_channel, dynamo, target)
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["output"]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        reference = model(x).numpy()
    assert steps_apart(reference, run_ort(path, x)) <= 1.0

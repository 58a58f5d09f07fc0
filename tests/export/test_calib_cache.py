"""TensorRT calibration cache: written from calibrated amax, parsed back independently.

The cache's values are parsed with ``struct.unpack('!f', bytes.fromhex(...))`` (how ModelOpt reads them)
and compared with ``float32(amax) / 127`` (for any quantizer grid, and after the ONNX Runtime rewrite);
the names are the ONNX tensors the activation quantizers read; weights are absent; ``strip_qdq`` gives the
float graph with those same tensor names.
"""

from __future__ import annotations

import struct

import numpy as np
import onnx
import pytest
import torch
from export_helpers import calibrate_max, run_ort
from torch import nn

from qdq import nn as qnn
from qdq.errors import QdqConfigError
from qdq.export import export_onnx, qdq_sites, read_calibration_cache, strip_qdq, write_calibration_cache
from qdq.quantizer import TensorQuantizer

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = qnn.QuantConv2d(3, 8, 3, padding=1)
        self.conv2 = qnn.QuantConv2d(8, 8, 3, padding=1)
        self.add = qnn.QuantAdd(quantize=(False, True))
        self.pool = qnn.QuantAdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.conv1(x))
        return self.pool(self.add(self.conv2(a), a)).flatten(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = Net().eval()
    calibrate_max(model, X)
    path = export_onnx(model, X, tmp_path_factory.mktemp("cache") / "net.onnx", dynamo=False)
    return model, path


def _parse(path) -> tuple[str, dict[str, float]]:
    lines = path.read_text().splitlines()
    values = {}
    for line in lines[1:]:
        name, hexdigits = line.rsplit(": ", 1)
        assert len(hexdigits) == 8
        values[name] = struct.unpack("!f", bytes.fromhex(hexdigits))[0]
    return lines[0], values


def test_cache_holds_amax_over_127_per_activation_tensor(exported, tmp_path):
    model, onnx_path = exported
    cache = write_calibration_cache(model, onnx_path, tmp_path / "calib.cache", trt_version=8601)
    header, values = _parse(cache)
    assert header == "TRT-8601-EntropyCalibration2"
    sites = {s.quantizer: s for s in qdq_sites(onnx.load(str(onnx_path)))}
    modules = dict(model.named_modules())
    activations = ["conv1._input_quantizer", "conv2._input_quantizer", "add.input_quantizers.1",
                   "pool._input_quantizer"]  # fmt: skip
    expected = {sites[n].input: float(np.float32(modules[n].amax.item()) / np.float32(127)) for n in activations}
    assert values == expected
    assert "input" in values  # the network input, quantized by conv1
    assert read_calibration_cache(cache) == (header, values)


def test_cache_from_mappings(tmp_path):
    cache = write_calibration_cache({"q": 2.54}, {"q": "t0"}, tmp_path / "c.cache", trt_version=10000)
    header, values = _parse(cache)
    assert header == "TRT-10000-EntropyCalibration2"
    assert values == {"t0": pytest.approx(0.02, rel=1e-6)}
    assert cache.read_text().splitlines()[1] == f"t0: {struct.pack('>f', np.float32(2.54) / 127).hex()}"


def test_cache_errors(tmp_path):
    with pytest.raises(QdqConfigError, match="no calibrated"):
        write_calibration_cache({"a": 1.0}, {"b": "t"}, tmp_path / "c.cache")
    (tmp_path / "bad.cache").write_text("hello\n")
    with pytest.raises(QdqConfigError, match="TRT-"):
        read_calibration_cache(tmp_path / "bad.cache")


def test_strip_qdq_keeps_the_cache_tensor_names(exported, tmp_path):
    model, onnx_path = exported
    cache = write_calibration_cache(model, onnx_path, tmp_path / "calib.cache")
    float_graph = strip_qdq(onnx_path, tmp_path / "float.onnx")
    onnx.checker.check_model(float_graph, full_check=True)
    ops = {n.op_type for n in float_graph.graph.node}
    assert not ops & {"QuantizeLinear", "DequantizeLinear"}
    tensors = {n for node in float_graph.graph.node for n in node.input} | {"input"}
    assert set(_parse(cache)[1]) <= tensors
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    states = [q.is_enabled for q in quantizers]
    for q in quantizers:
        q.disable()
    with torch.no_grad():
        reference = model(X).numpy()
    for q, enabled in zip(quantizers, states):
        if enabled:
            q.enable()
    assert np.allclose(run_ort(tmp_path / "float.onnx", X), reference, atol=1e-5)


def test_cache_scales_are_read_from_the_graph_for_every_grid(tmp_path):
    """An unsigned quantizer (uint8, step amax / 255) and a 6-bit one (step amax / 31) still give TensorRT's
    amax / 127 (to one float32 ulp: the range is recovered from the graph's step); the signed 8-bit ones give
    the graph's step itself, also after the ONNX Runtime rewrite turned them into uint8 with zero point 128."""
    torch.manual_seed(0)
    model = Net().eval()
    calibrate_max(model, X)
    model.pool.input_quantizer.unsigned = True  # its grid is [0, 255] steps (negative inputs clamp to 0)
    model.conv2.input_quantizer.num_bits = 6
    modules = dict(model.named_modules())
    with pytest.warns(UserWarning, match="float"):
        path = export_onnx(model, X, tmp_path / "ort.onnx", target="onnxruntime", dynamo=False)
    sites = {s.quantizer: s for s in qdq_sites(onnx.load(str(path)))}
    assert sites["conv1._input_quantizer"].zero_point.dtype == np.uint8  # signed, rewritten to zero point 128
    values = _parse(write_calibration_cache(model, path, tmp_path / "c.cache"))[1]
    for name in ("conv1._input_quantizer", "add.input_quantizers.1"):
        assert values[sites[name].input] == float(np.float32(modules[name].amax.item()) / np.float32(127))
    for name in ("pool._input_quantizer", "conv2._input_quantizer"):
        expected = np.float32(modules[name].amax.item()) / np.float32(127)
        assert abs(values[sites[name].input] - expected) <= np.spacing(expected)

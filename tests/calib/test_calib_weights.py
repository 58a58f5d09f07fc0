"""calibrate_weights with duck-typed quantizers: the quantizer's own axis, every method, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import histogram_reference as ref
from qdq.calib import calibrate_weights
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError


class FakeQuantizer:
    """The attributes calibrate_weights relies on; records what amax was set to."""

    def __init__(self, axis, num_bits=8, unsigned=False):
        self.axis, self.num_bits, self.unsigned = axis, num_bits, unsigned
        self.amax = None


def quantized(module, axis, **kwargs):
    module.weight_quantizer = FakeQuantizer(axis, **kwargs)
    return module


def make_model():
    return nn.Sequential(
        quantized(nn.Conv2d(3, 8, 3), (0,)),
        quantized(nn.ConvTranspose2d(8, 4, 3), (1,)),  # keeps axis 1: must not be forced to 0
        nn.Conv2d(4, 4, 1),  # no quantizer: untouched
        nn.Flatten(),
        quantized(nn.Linear(16, 5), (0,)),
        quantized(nn.Linear(5, 3), None),  # a per-tensor weight quantizer
    )


def numpy_max(weight, axis):
    w = np.abs(weight.detach().numpy())
    if axis is None:
        return w.max()
    reduce_dims = tuple(d for d in range(w.ndim) if d not in axis)
    return w.max(axis=reduce_dims, keepdims=True)


def test_max_uses_each_quantizers_axis():
    model = make_model()
    done = calibrate_weights(model, method="max")
    assert sorted(done) == ["0", "1", "4", "5"]
    for name in done:
        module = model.get_submodule(name)
        amax = module.weight_quantizer.amax
        np.testing.assert_array_equal(amax.numpy(), numpy_max(module.weight, module.weight_quantizer.axis))
        assert amax is done[name] and amax.dtype == torch.float32
    assert model[1].weight_quantizer.amax.shape == (1, 4, 1, 1)
    assert model[5].weight_quantizer.amax.shape == ()
    assert not hasattr(model[2], "weight_quantizer")


@pytest.mark.parametrize("method", ["percentile", "mse"])
def test_histogram_methods_equal_a_numpy_oracle_on_each_channel(method):
    """ConvTranspose keeps axis 1: each kept channel's amax is the numpy oracle's on weight[:, c]."""
    model = make_model()
    calibrate_weights(model, method=method, percentile=99.0, num_bins=512)
    conv_t = model[1]
    amax = conv_t.weight_quantizer.amax
    for c in range(conv_t.weight.shape[1]):
        values = conv_t.weight[:, c].detach().numpy()
        if method == "percentile":
            expected = ref.percentile_amax(values, 99.0, num_bins=512)
        else:
            expected = ref.mse_amax(values, num_bins=512)
        assert float(amax[0, c, 0, 0]) == pytest.approx(expected, rel=1e-6), c


def test_default_method_is_max():
    """The seed's recipe calibrates weights with max, per channel; so does calibrate_weights by default."""
    model = make_model()
    calibrate_weights(model)
    np.testing.assert_array_equal(model[0].weight_quantizer.amax.numpy(), numpy_max(model[0].weight, (0,)))


def test_the_workflow_uses_the_same_function():
    from qdq.workflow import calibration

    assert calibration.calibrate_weights is calibrate_weights


def test_percentile_100_is_within_one_bin_of_the_max():
    model = make_model()
    calibrate_weights(model, method="percentile", percentile=100.0)
    weight = model[0].weight.detach().abs().amax(dim=(1, 2, 3), keepdim=True)
    amax = model[0].weight_quantizer.amax
    width = 2.0 ** torch.ceil(torch.log2(weight + 1e-30)) / 2048  # power-of-two range above each max
    assert bool((amax <= weight).all()) and bool((amax > weight - width).all())


def test_perchannel_false_gives_one_amax_per_tensor():
    model = make_model()
    calibrate_weights(model, method="max", perchannel=False)
    for name in ("0", "1", "4", "5"):
        q = model.get_submodule(name).weight_quantizer
        assert q.amax.shape == () and float(q.amax) == float(numpy_max(model.get_submodule(name).weight, None))


def test_quantizer_bits_and_sign_are_used():
    layer = quantized(nn.Linear(4, 4), (0,), num_bits=4, unsigned=True)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-2, 1, 16).reshape(4, 4))
    calibrate_weights(layer, method="max")
    # unsigned: negatives do not count; rows of linspace(-2, 1, 16) end at -1.4, -0.6, 0.2, 1.0
    np.testing.assert_allclose(layer.weight_quantizer.amax.flatten().numpy(), [0.0, 0.0, 0.2, 1.0], rtol=1e-6)


def test_unknown_method_raises():
    with pytest.raises(QdqConfigError, match="Did you mean 'percentile'"):
        calibrate_weights(make_model(), method="percentil")
    with pytest.raises(QdqConfigError, match="method 'entropy' cannot set a weight's range"):
        calibrate_weights(make_model(), method="entropy")


def test_bad_quantizer_names_the_module():
    model = make_model()
    model[4].weight_quantizer.num_bits = 1
    with pytest.raises(QdqConfigError, match="module '4': num_bits"):
        calibrate_weights(model, method="max")


def test_bad_option_names_the_module():
    with pytest.raises(QdqConfigError, match="module '0': percentile"):
        calibrate_weights(make_model(), method="percentile", percentile=101)


def test_not_a_module_raises():
    with pytest.raises(QdqTypeError, match=r"nn\.Module"):
        calibrate_weights({"weight": torch.ones(2)})


def test_model_without_quantizers_warns():
    with pytest.warns(UserWarning, match="nothing was calibrated"):
        assert calibrate_weights(nn.Linear(2, 2)) == {}


def test_empty_weight_names_the_module():
    empty = nn.Module()
    empty.weight = nn.Parameter(torch.empty(0, 3))
    model = nn.Sequential(quantized(empty, (0,)))
    with pytest.raises(QdqCalibrationError, match="module '0': the weight is empty"):
        calibrate_weights(model, method="max")


def test_lstm_fused_weights_are_calibrated_per_layer_and_direction():
    """QuantLSTM quantizes cat([W_ih, W_hh]) of each layer x direction per row: each quantizer gets the row
    max of exactly that tensor (numpy oracle), and the quantized forward then uses those static ranges."""
    from qdq import nn as qnn

    torch.manual_seed(0)
    lstm = qnn.QuantLSTM(5, 6, num_layers=2, bidirectional=True)
    cell = qnn.QuantLSTMCell(3, 4)
    model = nn.ModuleDict({"lstm": lstm, "cell": cell})
    done = calibrate_weights(model, method="max")
    assert sorted(done) == ["cell", *(f"lstm.weight_quantizers.{i}" for i in range(4))]
    for idx, suffix in enumerate(["_l0", "_l0_reverse", "_l1", "_l1_reverse"]):
        fused = np.concatenate([getattr(lstm, f"weight_ih{suffix}").detach().numpy(),
                                getattr(lstm, f"weight_hh{suffix}").detach().numpy()], axis=1)  # fmt: skip
        got = lstm.weight_quantizers[idx].amax.numpy()
        np.testing.assert_array_equal(got.reshape(-1), np.abs(fused).max(axis=1))
    fused = np.concatenate([cell.weight_ih.detach().numpy(), cell.weight_hh.detach().numpy()], axis=1)
    np.testing.assert_array_equal(cell._weight_quantizer.amax.numpy().reshape(-1), np.abs(fused).max(axis=1))


def test_mse_of_a_depthwise_weight_equals_the_oracle_on_each_of_its_many_channels():
    """96 channels of 9 taps, their scales spread over 2**-6 .. 2**6: each channel fills a few bins of its own
    histogram, at positions that differ between channels (the search reads each channel's own bins)."""
    generator = torch.Generator().manual_seed(0)
    conv = quantized(nn.Conv2d(96, 96, 3, groups=96), (0,))
    with torch.no_grad():
        conv.weight.copy_(torch.randn(96, 1, 3, 3, generator=generator)
                          * 2.0 ** torch.linspace(-6, 6, 96).view(-1, 1, 1, 1))  # fmt: skip
    calibrate_weights(conv, method="mse", num_bins=512)
    amax = conv.weight_quantizer.amax.reshape(-1)
    for c in range(96):
        expected = ref.mse_amax(conv.weight[c].detach().numpy(), num_bins=512)
        assert float(amax[c]) == pytest.approx(expected, rel=1e-6), c

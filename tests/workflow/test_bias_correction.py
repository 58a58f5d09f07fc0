"""Bias correction in the PyTorch door: the shift against a numpy oracle of the layer's quantized and float outputs,
the significance rule, a bias created and taken back, dead channels, and auto keeping it only where it scores."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from qdq.quantizer import disabled_quantizers
from qdq.workflow.bias_correction import SIGNIFICANCE, correct_biases, measured, undo


def _fake_quant(x: np.ndarray, amax: np.ndarray | float, axis: int | None = None) -> np.ndarray:
    """Symmetric int8 fake quantization in numpy (step amax / 127, round half to even, [-128, 127])."""
    amax = np.asarray(amax, np.float32)
    if axis is not None:
        amax = amax.reshape([-1 if d == axis else 1 for d in range(x.ndim)])
    step = amax / np.float32(127)
    return (np.clip(np.round(x / step), -128, 127) * step).astype(np.float32)


def _linear(bias: bool = True, seed: int = 0) -> tuple[nn.Module, np.ndarray]:
    torch.manual_seed(seed)
    layer = qdq.quantize_model(nn.Sequential(nn.Linear(6, 4, bias=bias)))
    rng = np.random.default_rng(seed)
    x = ((rng.integers(0, 120, size=(64, 6)) + 0.4) * 0.01).astype(np.float32)
    x[:, 5] = 1.27  # amax 1.27 in every batch: step 0.01, every other value 0.4 of a step above the grid (rounded
    return layer, x  # down: a steady error the correction measures)


def _calibrated(model: nn.Module, x: np.ndarray) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdq.calibrate(model, [torch.from_numpy(x)], method="max", progress=False)
    return model


def test_the_shift_is_the_mean_error_of_the_layers_own_quantization_against_a_numpy_oracle():
    model, x = _linear()
    _calibrated(model, x)
    layer = model[0]
    weight = layer.weight.detach().numpy().copy()
    bias = layer.bias.detach().numpy().copy()
    amax_x = float(layer._input_quantizer.amax)
    amax_w = layer._weight_quantizer.amax.detach().numpy().reshape(-1)
    batches = [torch.from_numpy(x[i : i + 16]) for i in range(0, 64, 16)]
    shifts = correct_biases(model, batches)
    errors = _fake_quant(x, amax_x) @ _fake_quant(weight, amax_w, axis=0).T - x @ weight.T  # [64, 4] per sample
    mean = errors.astype(np.float64).mean(axis=0)
    significant = measured(mean, errors.sum(axis=0), (errors.astype(np.float64) ** 2).sum(axis=0), 64)
    assert len(shifts) == 1 and shifts[0].op == "0" and significant.any() and shifts[0].applied
    np.testing.assert_allclose(shifts[0].shift, np.where(significant, mean, 0), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(layer.bias.detach().numpy(), bias - shifts[0].shift, rtol=1e-6, atol=1e-7)
    assert shifts[0].unmeasured == tuple(int(c) for c in np.flatnonzero(~significant))
    undo(model, shifts)
    np.testing.assert_allclose(layer.bias.detach().numpy(), bias, rtol=1e-6, atol=1e-7)


def test_a_convs_shift_is_reduced_over_its_positions_per_sample_and_its_spread_over_the_first_batch():
    torch.manual_seed(1)
    model = qdq.quantize_model(nn.Sequential(nn.Conv2d(3, 4, 3)))
    x = torch.rand(32, 3, 8, 8) * torch.tensor([1.0, 0.3, 2.0]).reshape(1, 3, 1, 1) + 0.2
    _calibrated(model, x.numpy())
    conv = model[0]
    with torch.no_grad():
        quantized = conv(x).double().numpy()
        with disabled_quantizers(model):
            reference = conv(x).double().numpy()
    per_sample = (quantized - reference).mean(axis=(2, 3))  # [N, C]: each sample's mean error per channel
    mean = per_sample.mean(axis=0)
    significant = measured(mean, per_sample.sum(axis=0), (per_sample**2).sum(axis=0), 32)
    spread = reference[:16].transpose(1, 0, 2, 3).reshape(4, -1).std(axis=1)  # the float output's, first batch
    shifts = correct_biases(model, [x[:16], x[16:]])
    assert significant.any() and shifts[0].constant == ()
    np.testing.assert_allclose(shifts[0].shift, np.where(significant, mean, 0), rtol=1e-5, atol=1e-8)
    assert shifts[0].relative == pytest.approx(float(np.max(np.abs(shifts[0].shift) / spread)), rel=1e-5)


def test_a_shift_inside_its_sampling_error_is_not_applied():
    assert SIGNIFICANCE == 3.0
    # per-sample errors 1, -1, 1, -1...: mean 0.01 off by noise of SE 0.25 -> not measured; a steady 0.01 -> measured
    noisy = np.array([1.0, -1.0] * 8) + 0.01
    steady = np.full(16, 0.01)
    for errors, expected in ((noisy, False), (steady, True)):
        mean = np.array([errors.mean()])
        assert measured(mean, np.array([errors.sum()]), np.array([(errors**2).sum()]), 16)[0] == expected
    assert not measured(np.array([1.0]), np.array([1.0]), np.array([1.0]), 1)[0]  # one sample measures nothing


def test_a_conv_without_bias_shifts_the_running_mean_of_its_norm_and_keeps_the_state_dict_keys():
    from qdq.workflow.auto_calibration import _norms_after, _traced

    torch.manual_seed(0)
    model = qdq.quantize_model(nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1,
                                                                                                      bias=False)))
    model.eval()
    with torch.no_grad():
        model[0].weight[2] = 0.0  # a dead channel: its output never varies
        model[1].running_mean.uniform_(-0.1, 0.1)
    x = (torch.rand(16, 2, 6, 6) + 0.004).contiguous()
    _calibrated(model, x.numpy())
    keys, mean = list(model.state_dict()), model[1].running_mean.clone()
    norms = _norms_after(model, _traced(model)[0])
    assert norms == {"0": "1"}  # the last conv has no norm after it: not corrected (no bias to take a shift)
    shifts = correct_biases(model, [x[:8], x[8:]], norms=norms)
    assert [s.bias for s in shifts] == ["1.running_mean"] and shifts[0].applied and shifts[0].constant == (2,)
    assert list(model.state_dict()) == keys and model[2].bias is None
    np.testing.assert_allclose(model[1].running_mean.numpy(), mean.numpy() + shifts[0].shift, atol=1e-7)
    with torch.no_grad():  # the norm's output is the float one, shifted back: BN(conv_q(x)) ~ BN(conv(x)) on average
        quantized_mean = model[1](_enabled(model[0], x)).mean(dim=(0, 2, 3))
        model[1].running_mean.copy_(mean)
        float_mean = model[1](_enabled(model[0], x, on=False)).mean(dim=(0, 2, 3))
        model[1].running_mean.add_(torch.from_numpy(shifts[0].shift))
    np.testing.assert_allclose(quantized_mean.numpy(), float_mean.numpy(), atol=1e-5)
    undo(model, shifts)
    np.testing.assert_allclose(model[1].running_mean.numpy(), mean.numpy(), atol=1e-7)


def _enabled(layer: nn.Module, x: torch.Tensor, on: bool = True) -> torch.Tensor:
    """``layer(x)`` with its quantizers on or off."""
    quantizers = (layer._input_quantizer, layer._weight_quantizer)
    for quantizer in quantizers:
        quantizer.enable() if on else quantizer.disable()
    try:
        return layer(x)
    finally:
        for quantizer in quantizers:
            quantizer.enable()


def _scores_in_turn(values: list[float]):
    calls = iter(values)
    return lambda *args: next(calls)


def test_auto_keeps_the_correction_only_where_it_scores_and_can_be_turned_off(monkeypatch):
    from qdq.workflow import auto_calibration

    model, x = _linear(seed=1)
    data = [torch.from_numpy(x[i : i + 8]) for i in range(0, 64, 8)]
    before = model[0].bias.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdq.calibrate(model, data, progress=False, bias_correction=False)
    assert torch.equal(model[0].bias, before)
    fit, scored = data[:4], [(b, b) for b in data[4:]]
    for after, kept in ((20.0 + auto_calibration.TIE_DB / 2, False), (20.0 + 2 * auto_calibration.TIE_DB, True)):
        monkeypatch.setattr(auto_calibration, "_score", _scores_in_turn([after]))
        scores = {"max": 20.0}
        assert auto_calibration._bias_correction(model, fit, scored, None, 20.0, scores, "max", {}) is kept
        assert scores["max + bias correction"] == after
        assert torch.allclose(model[0].bias, before, atol=1e-6) is not kept  # taken back unless kept
    with pytest.raises(qdq.QdqTypeError, match="bias_correction"):
        qdq.calibrate(model, data, method="max", bias_correction=True, progress=False)

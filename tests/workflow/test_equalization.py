"""qdq.workflow.equalization: the noise model, the scales, the weights rewritten, against values worked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from equalization_models import images, torch_pair
from onnx_models import export
from qdq.quantizer import disabled_quantizers
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.equalization import (
    SCALE_CAP,
    ChannelStats,
    _device_moments,
    predicted_noise,
    scaled_first,
    scaled_second,
)


def test_predicted_noise_is_the_two_rounding_terms_by_hand():
    # second: 2 outputs x 2 input channels, 1x1; the activation's channels peak at 1 and 4, mean squares 0.25 and 4
    weight = np.array([[1.0, 2.0], [3.0, 4.0]]).reshape(2, 2, 1, 1)
    peak, mean_square = np.array([1.0, 4.0]), np.array([0.25, 4.0])
    # unscaled: activation step 4/255 through sum(W^2) = 30; weight steps 2/127 and 4/127 through 0.25 + 4
    expected = (4 / 255) ** 2 * 30 + ((2 / 127) ** 2 + (4 / 127) ** 2) * 4.25
    assert predicted_noise(weight, 1, peak, mean_square, np.ones(2), 255) == pytest.approx(expected, rel=1e-12)
    # channel 0 doubled: W / s = [[0.5, 2], [1.5, 4]] (sum of squares 22.5); peaks 2 and 4 (step 4/255 still); the
    # weight steps are unchanged (each row's largest is in column 1); the mean squares 1 and 4
    expected = (4 / 255) ** 2 * 22.5 + ((2 / 127) ** 2 + (4 / 127) ** 2) * 5.0
    scaled = predicted_noise(weight, 1, peak, mean_square, np.array([2.0, 1.0]), 255)
    assert scaled == pytest.approx(expected, rel=1e-12)


def test_predicted_noise_of_a_depthwise_conv_reads_one_channel_per_output():
    weight = np.array([2.0, 5.0]).reshape(2, 1, 1, 1)  # groups = 2: output k reads channel k only
    peak, mean_square = np.array([1.0, 8.0]), np.array([1.0, 16.0])
    expected = (8 / 127) ** 2 * (4 + 25) + (2 / 127) ** 2 * 1 + (5 / 127) ** 2 * 16
    assert predicted_noise(weight, 2, peak, mean_square, np.ones(2), 127) == pytest.approx(expected, rel=1e-12)


def test_scaled_second_divides_each_groups_own_columns():
    # 2 groups, 4 input channels: output 0 reads channels 0 and 1, output 1 reads channels 2 and 3
    weight = np.ones((2, 2, 1, 1), np.float32)
    scaled = scaled_second(weight, 2, np.array([1, 2, 4, 8], np.float32))
    np.testing.assert_array_equal(scaled[:, :, 0, 0], [[1, 0.5], [0.25, 0.125]])
    assert scaled.dtype == np.float32


def test_scaled_first_multiplies_output_rows_and_bias():
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    out, bias = scaled_first(weight, np.ones(3, np.float32), np.array([1, 2, 3], np.float32))
    np.testing.assert_array_equal(out, [[0, 1], [4, 6], [12, 15]])
    np.testing.assert_array_equal(bias, [1, 2, 3])


def test_channel_stats_over_batches_and_an_empty_one():
    stats = ChannelStats(axis=1)
    stats.update(np.array([[[1.0, -3.0], [2.0, 0.0]]]))  # [1, 2 channels, 2]
    stats.update(np.zeros((0, 2, 2)))  # an If branch the batch did not take: nothing
    stats.update(np.array([[[0.0, 0.0], [4.0, 0.0]]]))
    np.testing.assert_array_equal(stats.peak, [3.0, 4.0])
    np.testing.assert_allclose(stats.mean_square, [10 / 4, 20 / 4])


def test_device_moments_are_the_hand_computed_per_channel_figures():
    """What ChannelStats takes from a CUDA tensor (reduced where it lives, two C-vectors to the host), here on CPU."""
    batch = torch.tensor([[[1.0, -3.0], [2.0, 0.0]], [[0.0, 0.0], [4.0, 0.0]]])  # [2, 2 channels, 2]
    peak, squares, count = _device_moments(batch, 1)
    np.testing.assert_array_equal(peak, [3.0, 4.0])
    np.testing.assert_array_equal(squares, [10.0, 20.0])
    assert count == 4
    peak, squares, count = _device_moments(batch[0, 0], -1)  # a 1-D tensor: every value its own channel
    np.testing.assert_array_equal(peak, [1.0, 3.0])
    assert count == 1


def test_the_pytorch_door_scales_the_norm_and_the_next_conv_to_the_oracle_and_keeps_the_function():
    model = torch_pair("ReLU")
    data, unseen = images(4, 1), images(2, 2)
    with torch.no_grad():
        peaks = torch.cat([model[:3](x) for x in data]).amax(dim=(0, 2, 3)).numpy().astype(np.float64)
        expected = [model(x) for x in unseen]
    gamma, beta, conv1, conv2 = (t.detach().clone() for t in (model[1].weight, model[1].bias, model[0].weight,
                                                               model[3].weight))  # fmt: skip
    quantized = qdq.quantize_model(model, qdq.QuantConfig(target="tensorrt"))
    result = select_amax(quantized, data, progress=False, bias_correction=False)  # the biases as they were
    [scaling] = result.equalized
    oracle = (peaks.max() / np.maximum(peaks, peaks.max() / SCALE_CAP)) ** scaling.alpha
    np.testing.assert_allclose(scaling.scales, oracle, rtol=1e-4)
    s = torch.from_numpy(scaling.scales)
    torch.testing.assert_close(quantized[1].weight, gamma * s)  # the norm takes the scaling, the conv before it not
    torch.testing.assert_close(quantized[1].bias, beta * s)
    torch.testing.assert_close(quantized[0].weight, conv1)
    torch.testing.assert_close(quantized[3].weight, conv2 / s.view(1, -1, 1, 1))
    assert "1 convolution pair(s) equalized" in result.summary()
    with disabled_quantizers(quantized), torch.no_grad():  # ReLU: the float function is the same
        for x, y in zip(unseen, expected, strict=True):
            torch.testing.assert_close(quantized(x), y, rtol=1e-4, atol=1e-4)


def test_both_doors_equalize_the_same_model_alike(tmp_path):
    model = torch_pair("ReLU6")
    data = images(4, 1)
    path = tmp_path / "pair.onnx"
    export(model, data[0], path, names=("x", "y"))
    onnx_door = qdq.quantize_onnx(path, [{"x": x.numpy()} for x in data], tmp_path / "q.onnx", target="tensorrt",
                                  progress=False)  # fmt: skip
    torch_door = select_amax(qdq.quantize_model(model, qdq.QuantConfig(target="tensorrt")), data, progress=False)
    [onnx_scaling], [torch_scaling] = onnx_door.equalized, torch_door.equalized
    assert onnx_scaling.alpha == torch_scaling.alpha
    np.testing.assert_allclose(onnx_scaling.scales, torch_scaling.scales, rtol=1e-4)


def test_a_module_called_twice_is_not_equalized():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = torch_pair("ReLU")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.pair[2](self.pair[1](self.pair[0](x)))
            return self.pair[3](first) + self.pair[3](first)  # the second conv runs twice

    quantized = qdq.quantize_model(Twice().eval(), qdq.QuantConfig(target="tensorrt"))
    assert select_amax(quantized, images(4, 1), progress=False).equalized == []


def test_the_pytorch_door_undoes_a_scaling_the_held_out_samples_reject(monkeypatch):
    """A harmful scaling (forced, as in tests/onnx_in/test_equalize.py): the parameters go back to what they were, and
    so do the two convs' weight ranges (per channel, max)."""
    import qdq.workflow.equalization as equalization

    def harmful(pair, stats, weight, groups, levels):
        scales = np.where(np.arange(stats.peak.size) % 2, 64.0, 1 / 64).astype(np.float32)
        return equalization.Scaling(pair.first.name, pair.second.name, 0.5, scales, -20.0)

    monkeypatch.setattr(equalization, "plan_scaling", harmful)
    model = torch_pair("ReLU")
    given = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    quantized = qdq.quantize_model(model, qdq.QuantConfig(target="tensorrt"))
    result = select_amax(quantized, images(8, 1), progress=False, bias_correction=False)
    with_it, without = result.equalization
    assert with_it <= without - equalization.UNDO_DB and result.equalized == []
    for name, tensor in quantized.named_parameters():
        torch.testing.assert_close(tensor, given[name], rtol=0, atol=0)
    peaks = given["3.weight"].abs().amax(dim=(1, 2, 3))
    torch.testing.assert_close(quantized[3].weight_quantizer.amax.reshape(-1), peaks)

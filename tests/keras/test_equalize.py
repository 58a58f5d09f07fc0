"""qdq.keras.equalize: cross-layer equalization in the Keras door, against a numpy oracle of the activation's peaks
and against the PyTorch door on the same weights (tests/workflow/test_equalization.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import keras
import qdq
import qdq.keras as qk
from equalization_models import images, torch_pair
from qdq.errors import QdqCalibrationWarning
from qdq.keras.post_training import bypassed
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.equalization import SCALE_CAP

EPSILON = 1e-5  # PyTorch's BatchNorm epsilon, so that both doors compute the same function


def keras_pair(torch_model: torch.nn.Sequential, activation: str) -> keras.Model:
    """``torch_pair``'s model in Keras, channels last, with its weights: Conv2D -> BatchNormalization ->
    ReLU / ReLU6 -> 1x1 Conv2D."""
    conv1, norm, _, conv2 = torch_model
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inputs)
    x = keras.layers.BatchNormalization(epsilon=EPSILON, name="norm")(x)
    x = keras.layers.ReLU(max_value=6.0 if activation == "ReLU6" else None, name="act")(x)
    model = keras.Model(inputs, keras.layers.Conv2D(4, 1, name="conv2")(x))
    model.get_layer("conv1").set_weights([_hwio(conv1.weight), conv1.bias.detach().numpy()])
    model.get_layer("norm").set_weights([t.detach().numpy() for t in (norm.weight, norm.bias, norm.running_mean,
                                                                        norm.running_var)])  # fmt: skip
    model.get_layer("conv2").set_weights([_hwio(conv2.weight), conv2.bias.detach().numpy()])
    return model


def _hwio(weight: torch.Tensor) -> np.ndarray:
    return weight.detach().numpy().transpose(2, 3, 1, 0)


def _nhwc(batches: list[torch.Tensor]) -> list[np.ndarray]:
    return [x.numpy().transpose(0, 2, 3, 1).copy() for x in batches]


@pytest.mark.parametrize("activation", ["ReLU", "ReLU6"])
def test_the_keras_door_scales_the_norm_and_the_next_conv_like_the_pytorch_door(activation):
    torch_model = torch_pair(activation)
    model = keras_pair(torch_model, activation)
    data, unseen = _nhwc(images(4, 1)), _nhwc(images(2, 2))
    probe = keras.Model(model.inputs, model.get_layer("act").output)
    peaks = np.max([np.abs(probe.predict_on_batch(x)).max(axis=(0, 1, 2)) for x in data], axis=0).astype(np.float64)
    # ReLU6: a channel scaled by s_c is clipped at 6 / s_c, at or above its peak on the batches measured
    checked = unseen if activation == "ReLU" else data
    expected = [model.predict_on_batch(x) for x in checked]
    gamma, beta = (v.numpy().copy() for v in (model.get_layer("norm").gamma, model.get_layer("norm").beta))
    conv1, conv2 = model.get_layer("conv1").kernel.numpy().copy(), model.get_layer("conv2").kernel.numpy().copy()

    qmodel = qk.quantize_model(model)
    qk.calibrate(qmodel, data)
    result = qk.auto_result(qmodel)
    [scaling] = result.equalized
    oracle = (peaks.max() / np.maximum(peaks, peaks.max() / SCALE_CAP)) ** scaling.alpha
    np.testing.assert_allclose(scaling.scales, oracle, rtol=1e-4)
    norm = qmodel.get_layer("norm")
    np.testing.assert_allclose(norm.gamma.numpy(), gamma * scaling.scales, rtol=1e-6)
    np.testing.assert_allclose(norm.beta.numpy(), beta * scaling.scales, rtol=1e-6)
    np.testing.assert_array_equal(qmodel.get_layer("quant_conv1").layer.kernel.numpy(), conv1)  # the norm scales
    np.testing.assert_allclose(qmodel.get_layer("quant_conv2").layer.kernel.numpy(),
                               conv2 / scaling.scales.reshape(1, 1, -1, 1), rtol=1e-6)  # fmt: skip
    assert "1 convolution pair(s) equalized" in result.summary()
    with bypassed(qmodel):  # the float function is the same
        for x, y in zip(checked, expected, strict=True):
            np.testing.assert_allclose(qmodel.predict_on_batch(x), y, rtol=1e-4, atol=1e-4)

    torch_door = select_amax(qdq.quantize_model(torch_model), images(4, 1), progress=False)
    [torch_scaling] = torch_door.equalized
    assert torch_scaling.alpha == scaling.alpha
    np.testing.assert_allclose(torch_scaling.scales, scaling.scales, rtol=1e-4)


def test_a_depthwise_second_conv_divides_its_own_channel_and_a_plain_first_conv_scales_its_kernel():
    """Conv2D (ReLU inside, no BatchNorm) -> DepthwiseConv2D (multiplier 2): ``first``'s kernel columns and bias
    take the scales, the depthwise kernel ``(kh, kw, C, 2)`` is divided along C."""
    keras.utils.set_random_seed(0)
    spread = 2.0 ** np.arange(6) / 8
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="conv")(inputs)
    model = keras.Model(inputs, keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", name="dw")(x))
    rng = np.random.default_rng(0)
    kernel = (rng.normal(size=(3, 3, 3, 6)) * spread).astype(np.float32)
    bias = (0.1 * spread).astype(np.float32)
    model.get_layer("conv").set_weights([kernel, bias])
    depthwise = (rng.normal(size=(3, 3, 6, 2)) / spread[:, None]).astype(np.float32)
    model.get_layer("dw").set_weights([depthwise, np.zeros(12, np.float32)])
    data = [rng.normal(size=(8, 8, 8, 3)).astype(np.float32) for _ in range(4)]
    expected = model.predict_on_batch(data[0])

    qmodel = qk.quantize_model(model)
    qk.calibrate(qmodel, data)
    [scaling] = qk.auto_result(qmodel).equalized
    s = scaling.scales
    np.testing.assert_allclose(qmodel.get_layer("quant_conv").layer.kernel.numpy(), kernel * s, rtol=1e-6)
    np.testing.assert_allclose(qmodel.get_layer("quant_conv").layer.bias.numpy(), bias * s, rtol=1e-6)
    np.testing.assert_allclose(qmodel.get_layer("quant_dw").layer.kernel.numpy(), depthwise / s[:, None], rtol=1e-6)
    with bypassed(qmodel):
        np.testing.assert_allclose(qmodel.predict_on_batch(data[0]), expected, rtol=1e-4, atol=1e-4)


def _rewritten(qmodel: keras.Model) -> list[np.ndarray]:
    """The variables an equalization of the pair rewrites: the norm's gamma and beta, the second conv's kernel."""
    norm = qmodel.get_layer("norm")
    return [v.numpy().copy() for v in (norm.gamma, norm.beta, qmodel.get_layer("quant_conv2").layer.kernel)]


def test_the_keras_door_undoes_a_scaling_the_held_out_samples_reject(monkeypatch):
    """A harmful scaling (forced, as in the other doors' tests): the variables go back to what they were."""
    import qdq.workflow.equalization as equalization

    def harmful(pair, stats, weight, groups, levels):
        scales = np.where(np.arange(stats.peak.size) % 2, 64.0, 1 / 64).astype(np.float32)
        return equalization.Scaling(pair.first.name, pair.second.name, 0.5, scales, -20.0)

    monkeypatch.setattr("qdq.keras.equalize.plan_scaling", harmful)
    qmodel = qk.quantize_model(keras_pair(torch_pair("ReLU"), "ReLU"))
    before = _rewritten(qmodel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qk.calibrate(qmodel, _nhwc(images(4, 1)))
    assert not [w for w in caught if issubclass(w.category, QdqCalibrationWarning)]  # judged on the weights kept
    result = qk.auto_result(qmodel)
    assert result.equalized == [] and result.equalization[0] < result.equalization[1] - equalization.UNDO_DB
    for now, was in zip(_rewritten(qmodel), before, strict=True):
        np.testing.assert_array_equal(now, was)


def test_equalize_false_leaves_the_kernels_and_ptq_keeps_auto_s_only_where_it_wins():
    """ptq scores auto first and max after it: max sees the variables as given; the model returned has them unless
    auto wins (each score here is the order of the call, so the last method scored wins)."""
    qmodel = qk.quantize_model(keras_pair(torch_pair("ReLU"), "ReLU"))
    before, data = _rewritten(qmodel), _nhwc(images(4, 1))
    qk.calibrate(qmodel, data, equalize=False)
    assert qk.auto_result(qmodel).equalized == []
    for now, was in zip(_rewritten(qmodel), before, strict=True):
        np.testing.assert_array_equal(now, was)

    seen: list[list[np.ndarray]] = []

    def later_is_better(model: keras.Model) -> float:
        seen.append(_rewritten(model))
        return float(len(seen))

    result = qk.ptq(qmodel, data, later_is_better, methods=["auto", "max"])  # float, auto, max
    assert result.best.method == "max"
    assert not np.array_equal(seen[1][2], before[2])  # auto scored with its equalization
    for state in (seen[2], _rewritten(qmodel)):  # max scored, and the model returned, as given
        for now, was in zip(state, before, strict=True):
            np.testing.assert_array_equal(now, was)
    seen.clear()
    result = qk.ptq(qmodel, data, later_is_better, methods=["max", "auto"])
    assert result.best.method == "auto" and qk.auto_result(qmodel).equalized
    np.testing.assert_array_equal(_rewritten(qmodel)[2], seen[2][2])  # the model returned as auto scored it

"""method="auto", the default of the Keras door: the same held-out samples, candidates, fidelity and choice as the
PyTorch door (the same model built in both gets the same choice and scores), and small models whose right choice is
known by construction."""

import warnings

import numpy as np
import pytest
import torch

import keras
import qdq
import qdq.keras as qk
from qdq.errors import QdqCalibrationWarning
from qdq.workflow.auto_calibration import DESTRUCTIVE_MARGIN_DB, candidates, select_amax


def _outlier_batches(seed: int, scale: float, shape: tuple[int, ...], count: int = 8) -> list[np.ndarray]:
    """Batches of N(0, 1) values, but one value in each batch (a rate of 6e-5: below what percentile 99.99 keeps)
    is ``scale``."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        x = rng.normal(size=shape).astype(np.float32)
        x.reshape(-1)[rng.integers(0, x.size)] = scale
        batches.append(x)
    return batches


class _TorchConvTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return torch.tanh(self.conv(x))


def test_the_default_is_auto_and_chooses_as_the_pytorch_door_on_the_same_model():
    """A 3x3 conv whose tanh saturates, built in Keras and in PyTorch with the same weights, on the same batches
    (NHWC / NCHW): one input value in 16384 is 1000, which the tanh discards. Max, mse and entropy keep it and their
    step rounds everything else to zero; percentile 99.99 clips it, which the diagnostics call destructive (it is
    most of the energy), and scores far above the rest: both doors choose it, every candidate scores the same within
    0.5 dB (the same held-out samples, the output's channels as its features in both), and the Keras door warns."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    model = keras.Model(inputs, keras.layers.Conv2D(8, 3, padding="same", activation="tanh", name="conv")(inputs))
    batches = _outlier_batches(0, 1000.0, (64, 8, 8, 4))
    qmodel = qk.quantize_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranges = qk.calibrate(qmodel, batches)  # no method: auto
    result = qk.auto_result(qmodel)
    assert result is not None and result.chosen == "percentile 99.99", result.table()
    assert result.held_out and result.batches == 8  # the last quarter of each batch
    assert result.clipping[result.chosen] == ["quant_conv/input_0"]  # destructive, so it needed the margin
    others = max(score for label, score in result.scores.items() if label != result.chosen)
    assert result.scores[result.chosen] > others + DESTRUCTIVE_MARGIN_DB
    said = [str(w.message) for w in caught if issubclass(w.category, QdqCalibrationWarning)]
    assert len(said) == 1 and "quant_conv/input_0 (auto: percentile 99.99)" in said[0]

    torch_model = _TorchConvTanh()
    kernel, bias = model.get_layer("conv").get_weights()
    with torch.no_grad():
        torch_model.conv.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1)))
        torch_model.conv.bias.copy_(torch.from_numpy(bias))
    torch_batches = [torch.from_numpy(x.transpose(0, 3, 1, 2).copy()) for x in batches]
    quantized = qdq.quantize_model(torch_model)
    reference = select_amax(quantized, torch_batches, progress=False, bias_correction=False)
    assert reference.chosen == result.chosen
    assert list(reference.scores) == list(result.scores) == [m.label(o) for m, o in candidates()]
    for label, score in result.scores.items():
        assert score == pytest.approx(reference.scores[label], abs=0.5), label
    assert ranges["quant_conv/input_0"] == pytest.approx(float(quantized.conv._input_quantizer.amax), rel=1e-6)


def test_outliers_that_carry_the_output_keep_a_range_that_holds_them():
    """A linear layer: the outliers (60, one value in 16384) reach the output unchanged, so clipping them moves those
    outputs by far more than a coarser step costs the rest. percentile 99.99 and entropy clip them (destructive) and
    score far below; the range kept holds them, and nothing is warned. An explicit method afterwards is no longer
    auto's choice."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    qmodel = qk.quantize_model(keras.Model(inputs, keras.layers.Dense(8, name="fc")(inputs)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranges = qk.calibrate(qmodel, _outlier_batches(0, 60.0, (64, 256)))
    result = qk.auto_result(qmodel)
    assert result.chosen in ("max", "mse"), result.table()
    assert result.clipping["percentile 99.99"] == result.clipping["entropy"] == ["quant_fc/input_0"]
    assert result.scores[result.chosen] > result.scores["percentile 99.99"] + 6
    assert ranges["quant_fc/input_0"] >= 0.9 * 60.0
    assert not [w for w in caught if issubclass(w.category, QdqCalibrationWarning)]
    assert "| chosen |" in result.table() and result.summary().startswith(f"auto: {result.chosen} (")
    qk.calibrate(qmodel, _outlier_batches(0, 60.0, (64, 256), count=1), method="max")
    assert qk.auto_result(qmodel) is None


def test_each_activation_takes_the_method_it_needs():
    """Two dense layers on two inputs (as the PyTorch and ONNX doors' test, tests/workflow/test_refinement.py): the
    first's outliers (60) reach its output, the second's (1000) are saturated away after it (tanh). One method cannot
    suit both; the refinement gives the other input the other method and scores above every single method."""
    keras.utils.set_random_seed(0)
    x, z = keras.Input((256,)), keras.Input((256,))
    carried = keras.layers.Dense(8, name="carry")(x)
    saturated = keras.layers.Dense(8, activation="tanh", name="sat")(z)
    qmodel = qk.quantize_model(keras.Model([x, z], [carried, saturated]))
    batches = list(zip(_outlier_batches(0, 60.0, (64, 256)), _outlier_batches(1, 1000.0, (64, 256)), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranges = qk.calibrate(qmodel, [list(pair) for pair in batches])
    result = qk.auto_result(qmodel)
    assert result is not None and result.refinement is not None and result.refinement.changes, result.table()
    assert result.refinement.score > max(result.scores.values()) + 3
    carry = next(v for k, v in ranges.items() if "carry" in k)
    sat = next(v for k, v in ranges.items() if "sat" in k)
    assert carry >= 0.9 * 60 and sat < 10

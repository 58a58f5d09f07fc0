"""A calibration method registered from outside works in qdq.calibrate and qdq.ptq; errors list every method.

The method (tests/batch_maxima.py) is the median of the batch maxima, read from a calibrator registered with it;
its ranges are checked against a numpy oracle computed from the data and the float weights.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import batch_maxima
import histogram_reference as ref
import qdq
from qdq.calib import METHOD_NAMES, CalibrationMethod, MaxCalibrator, get_method, register_method, unregister_method
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.calibration import calibrate, collect_stats, load_amax, named_quantizers
from qdq.workflow.post_training import ptq

BUILTINS = ("max", "entropy", "mse", "percentile", "auto")
BATCHES = 5  # odd: the median is one batch's max


def _model():
    torch.manual_seed(0)
    return qdq.quantize_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))


def _data():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16, 4, generator=g) * (1 + i % 3) for i in range(BATCHES)]


def _activations(model, data):
    """What each activation quantizer sees, computed in numpy from the float weights (the oracle's inputs)."""
    w = model[0].weight.detach().double().numpy()
    b = model[0].bias.detach().double().numpy()
    inputs = [x.double().numpy() for x in data]
    return {"0._input_quantizer": inputs, "2._input_quantizer": [np.maximum(x @ w.T + b, 0) for x in inputs]}


@pytest.fixture
def median_max():
    with batch_maxima.registered() as method:
        yield method


def test_a_registered_method_calibrates_end_to_end(median_max):
    model, data = _model(), _data()
    expected = {name: batch_maxima.median_of_maxima(xs) for name, xs in _activations(model, data).items()}
    assert [n for n, _ in named_quantizers(model, weights=False)] == list(expected)
    calibrate(model, data, method=batch_maxima.NAME, progress=False)
    for name, quantizer in named_quantizers(model, weights=False):
        assert float(quantizer.amax) == pytest.approx(expected[name], rel=1e-6), name
        assert quantizer.amax_method == batch_maxima.NAME
        assert isinstance(quantizer.calibrator, MaxCalibrator) and len(quantizer.calibrator.amaxs) == BATCHES
    weight = model[0].weight.detach().numpy()  # weights: max per output channel, as for every method
    np.testing.assert_array_equal(model[0].weight_quantizer.amax.flatten().numpy(), np.abs(weight).max(1))


def test_ptq_collects_the_statistics_each_method_reads_and_keeps_the_best(median_max):
    model, data = _model(), _data()
    expected = {name: batch_maxima.median_of_maxima(xs) for name, xs in _activations(model, data).items()}
    largest = {name: max(float(np.abs(x).max()) for x in xs) for name, xs in _activations(model, data).items()}
    fed = []

    def forward(m, batch):
        fed.append(batch)
        return m(batch)

    scores = iter([50.0, 60.0, 90.0, 70.0])  # float, then max, median-max, entropy
    result = ptq(model, data, lambda m: next(scores), ("max", batch_maxima.NAME, "entropy"), forward_fn=forward,
                 progress=False)  # fmt: skip
    assert [r.label for r in result.results] == ["max", batch_maxima.NAME, "entropy"]
    assert len(fed) == 2 * BATCHES  # one histogram pass (max, entropy), one batch-max pass (median-max)
    by_label = {r.label: r for r in result.results}
    for name in expected:
        assert float(by_label["max"].amax[name]) == pytest.approx(largest[name], rel=1e-6)
        assert float(by_label[batch_maxima.NAME].amax[name]) == pytest.approx(expected[name], rel=1e-6)
    assert result.best.label == batch_maxima.NAME
    for name, quantizer in named_quantizers(model, weights=False):  # the best's ranges, and its statistics
        assert float(quantizer.amax) == pytest.approx(expected[name], rel=1e-6)
        assert len(quantizer.calibrator.amaxs) == BATCHES
    assert "median-max (best)" in result.table()


def test_ptq_tries_every_registered_method_by_default(median_max):
    model = _model()
    labels = [r.label for r in ptq(model, _data(), lambda m: 1.0, progress=False).results]
    assert labels == ["max", "entropy", "mse", "percentile 99.9", "percentile 99.99", "percentile 99.999",
                      "percentile 99.9999", batch_maxima.NAME]  # fmt: skip


def test_a_histogram_method_shares_the_histogram_pass():
    """The 99.9th percentile of |x| from the histogram: ptq's one histogram pass serves it with max."""
    model, data = _model(), _data()
    method = register_method(CalibrationMethod(
        "p999", "histogram", lambda calibrator: calibrator.compute_amax("percentile", percentile=99.9)))  # fmt: skip
    try:
        fed = []
        result = ptq(model, data, lambda m: 1.0, ("max", "p999"), forward_fn=lambda m, b: fed.append(b) or m(b),
                     progress=False)  # fmt: skip
        assert len(fed) == BATCHES and method.reads("histogram")
        values = np.concatenate([x.numpy().reshape(-1) for x in data])
        oracle = ref.percentile_amax(values, 99.9, num_bins=4096)
        assert float(result.results[1].amax["0._input_quantizer"]) == pytest.approx(oracle, rel=1e-6)
        calibrate(model, data, method="p999", progress=False)
        assert float(model[0].input_quantizer.amax) == pytest.approx(oracle, rel=1e-6)
    finally:
        unregister_method("p999")


def test_an_unknown_method_lists_every_registered_one(median_max):
    model, data = _model(), _data()
    everything = [*BUILTINS, batch_maxima.NAME]
    for call in (lambda: qdq.calibrate(model, data, method="magic", progress=False),
                 lambda: ptq(model, data, lambda m: 1.0, ("max", "magic"), progress=False),
                 lambda: qdq.load_amax(model, "magic")):  # fmt: skip
        with pytest.raises(QdqConfigError) as caught:
            call()
        assert f"unknown calibration method 'magic'; the registered methods are {everything}" in str(caught.value)


def test_unregistering_restores_the_builtins():
    model, data = _model(), _data()
    with batch_maxima.registered():
        assert tuple(METHOD_NAMES) == (*BUILTINS, batch_maxima.NAME)
    assert tuple(METHOD_NAMES) == BUILTINS
    with pytest.raises(QdqConfigError, match=f"unknown calibration method '{batch_maxima.NAME}'"):
        calibrate(model, data, method=batch_maxima.NAME, progress=False)
    calibrate(model, data, method="max", progress=False)  # the built-ins work as before
    assert float(model[0].input_quantizer.amax) == max(float(x.abs().max()) for x in data)


def test_a_registered_model_level_method_runs_its_pass():
    """A method with select= (a pass over the model, as auto): calibrate and ptq call it after its statistics."""
    calls = []

    def half_of_max(model, data, *, num_batches, weight_method, forward_fn, progress, strict, factor):
        calls.append((len(list(data)), factor))
        load_amax(model, "max", weight_method=weight_method, strict=strict, warn=False)
        for _, quantizer in named_quantizers(model, weights=False):
            quantizer.amax = quantizer.amax * factor
            quantizer.amax_method = f"half of max x{factor}"

    register_method(CalibrationMethod("half", "max", select=half_of_max, options={"factor": 0.5}))
    try:
        model, data = _model(), _data()
        calibrate(model, data, method="half", factor=0.25, progress=False)
        assert calls == [(BATCHES, 0.25)]
        assert float(model[0].input_quantizer.amax) == max(float(x.abs().max()) for x in data) * 0.25
        result = ptq(model, data, lambda m: 1.0, ("half",), progress=False)
        assert calls[-1] == (BATCHES, 0.5) and result.best.label == "half"
        with pytest.raises(QdqConfigError, match="passes over the calibration data twice"):
            calibrate(model, iter(data), method="half", progress=False)
        with pytest.raises(QdqConfigError, match="'half' chooses its ranges with a pass over the model"):
            load_amax(model, "half")
        with pytest.raises(QdqTypeError, match=r"takes the options \['factor'\]"):
            calibrate(model, data, method="half", factr=0.1, progress=False)
    finally:
        unregister_method("half")


def test_auto_is_a_registered_method_whose_pass_lives_in_the_workflow():
    auto = get_method("auto")
    assert auto.model_level and auto.collects and auto.select.resolve() is select_amax
    model, data = _model(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(model, iter(data), progress=False)  # the default; it reads the batches once
    assert all(q.amax_method.startswith("auto: ") for _, q in named_quantizers(model, weights=False))
    with pytest.raises(QdqConfigError, match="load_amax: calibration method 'auto'"):
        collect_stats(model, data, calibrator="histogram", progress=False)
        load_amax(model, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate(model, data, method="auto", progress=False)
    assert all(q.amax_method.startswith("auto: ") for _, q in named_quantizers(model, weights=False))

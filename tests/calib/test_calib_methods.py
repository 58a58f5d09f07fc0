"""Calibration methods as registered objects: the built-ins, a method registered from outside, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import histogram_reference as ref
from qdq.calib import (
    CALIBRATION_METHODS,
    METHOD_NAMES,
    WEIGHT_METHODS,
    CalibrationMethod,
    HistogramCalibrator,
    MaxCalibrator,
    calibrate_weights,
    get_method,
    make_calibrator,
    register_method,
    unregister_method,
)
from qdq.calib import registry as calibrator_registry
from qdq.calib.methods import METHOD_REGISTRY, method_label
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.lazy import LazyCallable

BUILTINS = ("max", "entropy", "mse", "percentile", "auto")


def p999(calibrator):
    """The 99.9th percentile of |x|, from the histogram."""
    return calibrator.compute_amax("percentile", percentile=99.9)


@pytest.fixture
def registered():
    """Registers the "p999" method for one test; unregistered afterwards whatever happens."""
    method = register_method(CalibrationMethod("p999", statistics="histogram", compute=p999))
    yield method
    if "p999" in METHOD_REGISTRY:
        unregister_method("p999")


def test_the_builtins_and_what_each_knows():
    assert tuple(METHOD_NAMES) == BUILTINS
    assert tuple(CALIBRATION_METHODS) == ("max", "entropy", "mse", "percentile")  # what ptq tries by default
    assert tuple(WEIGHT_METHODS) == ("max", "mse", "percentile")  # entropy cannot set a weight's range
    assert get_method("max").statistics == ("max", "histogram") and get_method("max").calibrator == "max"
    assert {get_method(m).calibrator for m in ("entropy", "mse", "percentile", "auto")} == {"histogram"}
    assert dict(get_method("percentile").options) == {"percentile": 99.99}
    assert dict(get_method("entropy").options) == {"start_bin": 128, "stride": 1}
    auto = get_method("auto")
    assert auto.model_level and not auto.weights and auto.compute is None and isinstance(auto.select, LazyCallable)
    assert (auto.select.module, auto.select.name) == ("qdq.workflow.auto_calibration", "select_amax")
    assert [get_method(m).label() for m in BUILTINS] == ["max", "entropy", "mse", "percentile 99.99", "auto"]
    assert method_label("percentile", {"percentile": 99.9}) == "percentile 99.9"


def test_builtins_compute_what_the_calibrators_compute():
    x = torch.randn(4000)
    histogram = HistogramCalibrator()
    histogram.collect(x)
    maximum = MaxCalibrator()
    maximum.collect(x)
    values = x.numpy()
    assert float(get_method("max").compute_amax(maximum)) == float(np.abs(values).max())
    assert float(get_method("max").compute_amax(histogram)) == float(np.abs(values).max())
    assert float(get_method("percentile").compute_amax(histogram, percentile=99.0)) == pytest.approx(
        ref.percentile_amax(values, 99.0, num_bins=4096), rel=1e-6)  # fmt: skip
    assert float(get_method("mse").compute_amax(histogram)) == pytest.approx(ref.mse_amax(values, 4096), rel=1e-6)
    with pytest.raises(QdqConfigError, match=r"MaxCalibrator cannot give method 'entropy'.*histogram"):
        get_method("entropy").compute_amax(maximum)
    with pytest.raises(QdqConfigError, match="pass over the model"):
        get_method("auto").compute_amax(histogram)
    with pytest.raises(QdqTypeError, match=r"takes the options \['percentile'\].*Did you mean 'percentile'"):
        get_method("percentile").compute_amax(histogram, percentil=99.0)


def test_the_names_are_live_views_of_the_registry(registered):
    from qdq.calib.registry import CALIBRATION_METHODS as legacy  # the name migrating users import

    assert "p999" in METHOD_NAMES and "p999" in CALIBRATION_METHODS and "p999" in WEIGHT_METHODS
    assert legacy == (*BUILTINS[:4], "p999") and list(legacy) == list(CALIBRATION_METHODS)
    assert calibrator_registry.check_method("p999") == "p999"
    assert calibrator_registry.statistics_calibrator("p999") == "histogram"
    unregister_method("p999")
    assert legacy == BUILTINS[:4] and tuple(METHOD_NAMES) == BUILTINS


def test_a_registered_method_computes_its_range_and_sets_weights(registered):
    values = torch.randn(3, 2001) * torch.tensor([[1.0], [5.0], [0.5]])  # n * 0.999 is no integer: one rank
    histogram = make_calibrator(registered.calibrator)
    histogram.collect(values)
    assert float(registered.compute_amax(histogram)) == pytest.approx(
        ref.percentile_amax(values.numpy(), 99.9, num_bins=4096), rel=1e-6)  # fmt: skip
    assert registered.label() == "p999" and registered.weights  # a range from any tensor's statistics

    class Quantizer:  # what calibrate_weights reads of a weight quantizer
        axis, num_bits, unsigned, amax = (0,), 8, False, None

    layer = nn.Linear(2001, 3)
    with torch.no_grad():
        layer.weight.copy_(values)
    layer.weight_quantizer = Quantizer()
    calibrate_weights(layer, method="p999")
    expected = [ref.percentile_amax(row, 99.9, num_bins=4096) for row in values.numpy()]  # per output channel
    np.testing.assert_allclose(layer.weight_quantizer.amax.flatten().numpy(), expected, rtol=1e-6)


def test_an_unknown_name_lists_every_registered_method(registered):
    with pytest.raises(QdqConfigError) as caught:
        get_method("magic")
    assert "unknown calibration method 'magic'" in str(caught.value)
    assert f"{[*BUILTINS, 'p999']}" in str(caught.value)  # auto and the registered one included
    with pytest.raises(QdqConfigError, match="Did you mean 'entropy'"):
        get_method("entropi")
    with pytest.raises(QdqTypeError, match="named by a str"):
        get_method(3)
    with pytest.raises(QdqConfigError, match=r"'entropy' cannot set a weight's range.*'p999'"):
        calibrate_weights(nn.Linear(2, 2), method="entropy")


def test_unregistering_restores_the_builtins():
    def half_max(calibrator):
        return calibrator.compute_amax("max") / 2

    original = get_method("max")
    mine = CalibrationMethod("max", "max", half_max)
    with pytest.raises(QdqConfigError, match="already registered"):
        register_method(mine)
    register_method(mine, override=True)
    try:
        assert get_method("max") is mine and tuple(METHOD_NAMES) == BUILTINS  # replaced in its place
        calibrator = MaxCalibrator()
        calibrator.collect(torch.tensor([-4.0, 2.0]))
        assert float(get_method("max").compute_amax(calibrator)) == 2.0
    finally:
        assert unregister_method("max") is mine
    assert get_method("max") is original and tuple(METHOD_NAMES) == BUILTINS
    register_method(CalibrationMethod("extra", "max", half_max))
    unregister_method("extra")
    assert tuple(METHOD_NAMES) == BUILTINS
    with pytest.raises(QdqConfigError, match="unknown calibration method 'extra'"):
        unregister_method("extra")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": "", "statistics": "max", "compute": p999}, QdqConfigError, "non-empty str"),
        ({"name": "x", "statistics": (), "compute": p999}, QdqConfigError, "statistics must name"),
        ({"name": "x", "statistics": "max"}, QdqTypeError, "exactly one of compute"),
        ({"name": "x", "statistics": "max", "compute": p999, "select": p999}, QdqTypeError, "exactly one"),
        ({"name": "x", "statistics": "max", "compute": 3}, QdqTypeError, "callable"),
        ({"name": "x", "statistics": "max", "compute": p999, "labelled": ("q",)}, QdqConfigError, "labelled"),
        ({"name": "x", "statistics": "max", "select": p999, "weights": True}, QdqConfigError, "weights=False"),
    ],
)
def test_malformed_methods_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        CalibrationMethod(**kwargs)


def test_register_needs_a_method_object():
    with pytest.raises(QdqTypeError, match="CalibrationMethod"):
        register_method("p999")  # type: ignore[arg-type]

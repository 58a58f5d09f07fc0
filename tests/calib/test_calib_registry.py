"""Calibrators by name: built-ins, registration, errors."""

from __future__ import annotations

import pytest
import torch

from qdq.calib import (
    HistogramCalibrator,
    MaxCalibrator,
    calibrator_names,
    make_calibrator,
    register_calibrator,
    unregister_calibrator,
)
from qdq.errors import QdqConfigError, QdqTypeError


@pytest.fixture
def cleanup():
    names = []
    yield names
    for name in names:
        if name in calibrator_names():
            unregister_calibrator(name)


def test_builtins():
    assert {"max", "histogram", "entropy", "mse", "percentile"} <= set(calibrator_names())
    cal = make_calibrator("max", num_bits=8, axis=0, unsigned=True)
    assert isinstance(cal, MaxCalibrator) and cal.axis == (0,) and cal.unsigned
    assert make_calibrator("histogram").method == "entropy"
    for method in ("entropy", "mse", "percentile"):
        cal = make_calibrator(method, axis=1, num_bins=64, percentile=90.0)
        assert isinstance(cal, HistogramCalibrator) and cal.method == method and cal.num_bins == 64


def test_preset_histogram_percentile_is_used():
    cal = make_calibrator("percentile", percentile=90.0)
    cal.collect(torch.arange(100))
    assert float(cal.compute_amax()) == 89.0


def test_unknown_name_suggests():
    with pytest.raises(QdqConfigError, match="Did you mean 'entropy'"):
        make_calibrator("entropi")


def test_bad_keyword_suggests():
    with pytest.raises(QdqTypeError, match="Did you mean 'num_bins'"):
        make_calibrator("histogram", num_bin=10)
    with pytest.raises(QdqTypeError, match="method"):
        make_calibrator("mse", method="entropy")  # the name already fixes the method


def test_register_class_by_decorator(cleanup):
    cleanup.append("scaled-max")

    @register_calibrator("scaled-max")
    class ScaledMax(MaxCalibrator):
        def compute_amax(self, method=None, **kwargs):
            amax = super().compute_amax(method, **kwargs)
            return None if amax is None else amax * 0.5

    cal = make_calibrator("scaled-max", axis=0)
    cal.collect(torch.tensor([[4.0], [-2.0]]))
    assert cal.compute_amax().flatten().tolist() == [2.0, 1.0]
    assert "scaled-max" in calibrator_names()


def test_register_function_and_override(cleanup):
    cleanup.append("mine")
    register_calibrator("mine", lambda **kw: MaxCalibrator(**kw))
    with pytest.raises(QdqConfigError, match="already registered"):
        register_calibrator("mine", HistogramCalibrator)
    register_calibrator("mine", HistogramCalibrator, override=True)
    assert isinstance(make_calibrator("mine"), HistogramCalibrator)
    unregister_calibrator("mine")
    assert "mine" not in calibrator_names()


def test_unregister_builtin_restores_it(cleanup):
    register_calibrator("max", HistogramCalibrator, override=True)
    assert isinstance(make_calibrator("max"), HistogramCalibrator)
    unregister_calibrator("max")
    assert isinstance(make_calibrator("max"), MaxCalibrator)


def test_registration_errors():
    with pytest.raises(QdqConfigError, match="non-empty str"):
        register_calibrator("", MaxCalibrator)
    with pytest.raises(QdqTypeError, match="class or function"):
        register_calibrator("nope", 3)
    with pytest.raises(QdqConfigError, match=r"(?i)unknown calibrator"):
        unregister_calibrator("never-registered")

"""Calibrators: collect statistics of the tensors a quantizer sees and turn them into an amax.

* :class:`MaxCalibrator` - the largest magnitude, per tensor or per channel.
* :class:`HistogramCalibrator` - exact, mergeable histograms; amax by ``"entropy"``, ``"mse"``,
  ``"percentile"`` or ``"max"`` from one pass over the data.
* :func:`calibrate_weights` - set every weight quantizer's amax from its weight.
* :func:`make_calibrator` / :func:`register_calibrator` - calibrators by name.
* :class:`CalibrationMethod` / :func:`register_method` - calibration methods (max, entropy, mse, percentile, auto
  and any registered one) as registered objects: the statistics each reads, its options, how it computes a range
  (:mod:`qdq.calib.methods`).

Every calibrator has ``collect(x)``, ``reset()``, ``merge(other)``, ``sync(group=None)`` and
``compute_amax(method=None, **options)``; merging or syncing gives the same amax, bit for bit, as
collecting every batch in one calibrator.
"""

from .algorithms import entropy_amax, mse_amax, percentile_amax
from .base import Calibrator
from .histogram import HistogramCalibrator
from .max import MaxCalibrator
from .methods import (
    CALIBRATION_METHODS,
    METHOD_NAMES,
    WEIGHT_METHODS,
    CalibrationMethod,
    get_method,
    register_method,
    unregister_method,
)
from .registry import calibrator_names, make_calibrator, register_calibrator, unregister_calibrator
from .weights import calibrate_weights

__all__ = [
    "CALIBRATION_METHODS",
    "METHOD_NAMES",
    "WEIGHT_METHODS",
    "CalibrationMethod",
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "calibrate_weights",
    "calibrator_names",
    "entropy_amax",
    "get_method",
    "make_calibrator",
    "mse_amax",
    "percentile_amax",
    "register_calibrator",
    "register_method",
    "unregister_calibrator",
    "unregister_method",
]

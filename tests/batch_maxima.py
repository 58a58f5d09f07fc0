"""A calibration method registered from outside qdq, as a user would: the median of the batch maxima.

Its statistics are a registered calibrator of its own, ``"batch-max"`` (a max calibrator keeping every batch's
max); its range is the median over the batches of ``max |x|`` of each batch. :func:`median_of_maxima` is its numpy
oracle. Used by the workflow tests and the CLI test; it edits nothing in qdq.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from qdq.calib import (
    CalibrationMethod,
    MaxCalibrator,
    calibrator_names,
    register_calibrator,
    register_method,
    unregister_calibrator,
    unregister_method,
)
from qdq.calib.methods import METHOD_REGISTRY
from qdq.errors import QdqConfigError

NAME = "median-max"
STATISTICS = "batch-max"


def _batch_max_calibrator(**kwargs: object) -> MaxCalibrator:
    return MaxCalibrator(track_amax=True, **kwargs)


def median_of_batch_maxima(calibrator: object) -> torch.Tensor | None:
    """The median over the batches of each batch's max (an odd number of batches: the middle one)."""
    maxima = getattr(calibrator, "amaxs", None)
    if maxima is None:
        raise QdqConfigError(f"{NAME} needs the per-batch maxima of the {STATISTICS!r} calibrator.")
    return torch.stack(maxima).median(dim=0).values if maxima else None


def median_of_maxima(batches: list[np.ndarray]) -> float:
    """The oracle: ``median_b max |x_b|`` in float64."""
    return float(np.median([np.abs(np.asarray(b, dtype=np.float64)).max() for b in batches]))


@contextlib.contextmanager
def registered() -> Iterator[CalibrationMethod]:
    """Register the calibrator and the method for the block; unregister both after it, whatever happens."""
    register_calibrator(STATISTICS, _batch_max_calibrator)
    method = register_method(CalibrationMethod(NAME, statistics=STATISTICS, compute=median_of_batch_maxima,
                                               description="the median of the batch maxima"))  # fmt: skip
    try:
        yield method
    finally:
        if NAME in METHOD_REGISTRY:
            unregister_method(NAME)
        if STATISTICS in calibrator_names():
            unregister_calibrator(STATISTICS)

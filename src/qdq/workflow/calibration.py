"""Calibration of a whole model: run data through it, turn statistics into ranges, load them.

Two steps, usable separately:

* :func:`collect_stats` (:mod:`qdq.workflow.collection`, re-exported here) puts every enabled quantizer in
  calibration mode (quantization off), runs the data once with a progress bar, and restores the modes. Each
  activation quantizer collects with the calibrator its descriptor names (``QuantDescriptor(calib_method=...)``)
  unless the call names one; histogram statistics serve every built-in method afterwards (max, entropy, mse,
  percentiles) without re-running the data.
* :func:`load_amax` computes amax for one method from the collected statistics and loads it into the
  quantizers. (A calibrator's own ``compute_amax()`` returns the range of one quantizer; this function
  sets the ranges of a whole model.)

:func:`calibrate` does both, for any registered method (:mod:`qdq.calib.methods`): it collects the statistics the
method reads, then computes the ranges from them, or, for a model-level method (``auto``), runs the method's own
pass over the model. Weight quantizers need no data: their range comes from the weights themselves
(``weight_method``, per channel, max by default: :func:`qdq.calib.calibrate_weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from qdq.calib.methods import CalibrationMethod, get_method, method_label
from qdq.calib.weights import calibrate_weights
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.quantizer import NO_CALIBRATION_DATA
from qdq.workflow.collection import (
    ForwardFn,
    batch_total,
    check_reiterable,
    collect_stats,
    default_forward,
    named_quantizers,
)
from qdq.workflow.diagnostics import warn_clipping
from qdq.workflow.distributed import assert_same_across_ranks, collective, unwrap
from qdq.workflow.progress import Progress

__all__ = [
    "ForwardFn",
    "batch_total",
    "calibrate",
    "calibrate_weights",
    "collect_stats",
    "default_forward",
    "load_amax",
    "method_label",
    "named_quantizers",
]

_log = logging.getLogger(__name__)


def load_amax(
    model: nn.Module,
    method: str = "max",
    *,
    weight_method: str | None = "max",
    strict: bool = True,
    warn: bool = True,
    **method_options: Any,
) -> nn.Module:
    """Compute amax with ``method`` from the statistics :func:`collect_stats` left in every activation
    quantizer, and load it (the seed toolkit's ``compute_amax(model, method)`` recipe step).

    Args:
        method: a registered method computed from statistics (:data:`qdq.calib.CALIBRATION_METHODS`: ``"max"``,
            ``"entropy"``, ``"mse"``, ``"percentile"``, and any registered one); the built-ins but max need
            histogram statistics.
        weight_method: how weight quantizers get their range: ``"max"`` (per channel, the default),
            ``"percentile"``, ``"mse"`` (:data:`qdq.calib.WEIGHT_METHODS`), or None to leave them as they are.
        strict: a quantizer that saw no data is an error (else a warning, and it stays dynamic).
        warn: afterwards, warn (:class:`~qdq.errors.QdqCalibrationWarning`) naming the quantizers whose range
            clips a large share of their activation's energy (:func:`qdq.calibration_report`).
        method_options: the method's options over its defaults (``percentile=99.9``; ``start_bin``...).

    Raises:
        QdqConfigError: an unknown method (the message lists every registered one), a model-level method
            (``auto``: use :func:`calibrate`), or a method the collected statistics cannot give (entropy from
            a max calibrator); the message names the quantizer.
        QdqTypeError: an option the method does not take.
        QdqCalibrationError: a quantizer saw no data (with ``strict=True``).

    Statistics are first synchronised across processes when ``torch.distributed`` is initialised, so every
    rank loads the same amax (a collective: every rank must call it; a quantizer that saw no data on any
    rank raises on every rank). Each quantizer records the method's label in ``amax_method``.
    """
    chosen = get_method(method)
    if chosen.model_level:
        raise QdqConfigError(
            f"load_amax: calibration method {chosen.name!r} chooses its ranges with a pass over the model, not from "
            f"the statistics alone; use qdq.calibrate(model, data, method={chosen.name!r}) or qdq.ptq."
        )
    options = chosen.resolve_options(method_options)
    label = chosen.label(options)
    quantizers = [(n, q) for n, q in named_quantizers(unwrap(model), weights=False) if q._calibrator is not None]
    assert_same_across_ranks([n for n, _ in quantizers], "the quantizers to calibrate")
    for name, quantizer in quantizers:
        calibrator = quantizer._calibrator
        if hasattr(calibrator, "sync"):
            with collective(f"synchronising the calibration statistics of {name}"):
                calibrator.sync()
        try:
            amax = chosen.compute_amax(calibrator, **options)
            if amax is None:
                raise QdqCalibrationError(NO_CALIBRATION_DATA)
            quantizer.amax = amax
            quantizer.amax_method = label
        except QdqCalibrationError as err:
            message = f"{name}: {err}"
            if strict:
                raise QdqCalibrationError(message) from err
            _log.warning(message)
        except QdqConfigError as err:
            raise QdqConfigError(f"{name}: {err}{_collect_hint(chosen)}") from err
    if weight_method is not None:
        calibrate_weights(unwrap(model), method=weight_method)
    if warn:
        warn_clipping(model, stacklevel=2)
    return model


def _collect_hint(method: CalibrationMethod) -> str:
    return (f" Method {method.name!r} reads {' or '.join(map(repr, method.statistics))} statistics: "
            f"collect_stats(..., calibrator={method.calibrator!r}), or calib_method={method.calibrator!r} in the "
            "quantizer's descriptor.")  # fmt: skip


def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    method: str = "auto",
    *,
    num_batches: int | None = None,
    percentile: float | None = None,
    weight_method: str | None = "max",
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    strict: bool = True,
    **method_options: Any,
) -> nn.Module:
    """Calibrate ``model`` on ``data``: collect statistics, compute amax with ``method``, load it.

    ``method`` is any registered calibration method (:data:`qdq.calib.METHOD_NAMES`: ``"auto"``, the default,
    ``"max"``, ``"entropy"``, ``"mse"``, ``"percentile"``, and those registered with
    :func:`qdq.calib.register_method`). The calibrator is the one the method reads
    (:attr:`~qdq.calib.CalibrationMethod.calibrator`: a max calibrator for ``"max"``, a histogram for the other
    built-ins), whatever the descriptors' ``calib_method``; use :func:`collect_stats` and :func:`load_amax` to
    calibrate with the descriptors' own calibrators.

    ``"auto"`` chooses the method for the whole model: every method computed from statistics sets the ranges from
    most of the batches, the quantized model runs on the batches held out, and the method whose outputs stay
    closest to the float model's is kept (:mod:`qdq.workflow.auto_calibration`). It reads ``data`` once.

    Args:
        percentile: for a method with a ``percentile`` option (``"percentile"``; None: its default, 99.99);
            ignored by the others.
        method_options: the method's options over its defaults (:attr:`~qdq.calib.CalibrationMethod.options`).

    Afterwards a :class:`~qdq.errors.QdqCalibrationWarning` names the quantizers whose range clips a large
    share of their activation's energy (see :func:`qdq.calibration_report`).

    Raises:
        QdqConfigError: an unknown method: one error listing every registered method.

    Example:
        >>> model = qdq.quantize_model(model)
        >>> qdq.calibrate(model, calib_loader, method="entropy", num_batches=8)
    """
    chosen = get_method(method)
    given = {"percentile": percentile} if percentile is not None and "percentile" in chosen.options else {}
    options = chosen.resolve_options({**given, **method_options})
    if chosen.model_level and not chosen.collects:
        check_reiterable(data, chosen.name)
    if not chosen.collects:
        collect_stats(model, data, num_batches=num_batches, calibrator=chosen.calibrator, forward_fn=forward_fn,
                      progress=progress)  # fmt: skip
    if chosen.select is not None:
        chosen.select(model, data, num_batches=num_batches, weight_method=weight_method, forward_fn=forward_fn,
                      progress=progress, strict=strict, **options)  # fmt: skip
    else:
        load_amax(model, chosen.name, weight_method=weight_method, strict=strict, warn=False, **options)
    warn_clipping(model, stacklevel=2)
    return model

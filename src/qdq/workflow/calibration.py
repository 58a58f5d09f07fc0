"""Calibration of a whole model: run data through it, turn statistics into ranges, load them.

Two steps, usable separately:

* :func:`collect_stats` puts every enabled quantizer in calibration mode (quantization off), runs the
  data once with a progress bar, and restores the modes. Each activation quantizer collects with the
  calibrator its descriptor names (``QuantDescriptor(calib_method=...)``) unless the call names one;
  histogram statistics serve every method afterwards (max, entropy, mse, percentiles) without re-running
  the data.
* :func:`load_amax` computes amax for one method from the collected statistics and loads it into the
  quantizers. (A calibrator's own ``compute_amax()`` returns the range of one quantizer; this function
  sets the ranges of a whole model.)

:func:`calibrate` does both. Weight quantizers need no data: their range comes from the weights
themselves (``weight_method``, per channel, max by default: :func:`qdq.calib.calibrate_weights`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from qdq.calib.registry import check_method, statistics_calibrator
from qdq.calib.weights import calibrate_weights
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.placement.capture import forget_attention_shapes, settle_attention
from qdq.quantizer import TensorQuantizer
from qdq.utils.batches import call_model
from qdq.workflow.distributed import assert_same_across_ranks, collective, rank, unwrap, world_size
from qdq.workflow.progress import Progress, progress_bar

__all__ = ["calibrate", "collect_stats", "default_forward", "load_amax", "method_label", "named_quantizers"]

_log = logging.getLogger(__name__)

ForwardFn = Callable[[nn.Module, Any], Any]


def named_quantizers(model: nn.Module, weights: bool | None = None) -> list[tuple[str, TensorQuantizer]]:
    """Enabled quantizers of ``model`` with their names; ``weights`` True/False keeps only the weight / the other
    ones (by each quantizer's :attr:`~qdq.quantizer.TensorQuantizer.role`)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or not module.is_enabled:
            continue
        if weights is None or module.is_weight == weights:
            found.append((name, module))
    return found


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Feed a batch to the model by qdq's batch convention (:mod:`qdq.utils.batches`): a tensor, a tuple of
    positional arguments, a dict of keyword arguments, or an ``(inputs, labels)`` pair (labels unused)."""
    return call_model(model, batch)


def _batches(data: Iterable[Any], num_batches: int | None) -> Iterator[Any]:
    if num_batches is not None and num_batches < 1:
        raise QdqConfigError(f"num_batches must be at least 1, got {num_batches}.")
    if hasattr(data, "__len__") and len(data) == 0:  # type: ignore[arg-type]
        raise QdqCalibrationError("the calibration data is empty: it yields no batch.")
    iterator = iter(data)
    try:
        first = next(iterator)
    except StopIteration:
        raise QdqCalibrationError("the calibration data is empty: it yields no batch.") from None
    stream = itertools.chain([first], iterator)
    return itertools.islice(stream, num_batches) if num_batches is not None else stream


class _NamedCollector:
    """Wraps a calibrator so that data errors name the quantizer they happened in."""

    def __init__(self, calibrator: Any, name: str) -> None:
        self.calibrator, self.name = calibrator, name

    def collect(self, x: torch.Tensor) -> None:
        try:
            self.calibrator.collect(x)
        except QdqCalibrationError as err:
            raise QdqCalibrationError(f"while calibrating {self.name}: {err}") from err


def _make_calibrator(quantizer: TensorQuantizer, kind: str | None, **options: Any) -> Any:
    """A fresh calibrator of ``kind``, or of the quantizer's descriptor ``calib_method`` when ``kind`` is None."""
    from qdq.calib import make_calibrator

    return make_calibrator(
        kind or quantizer.calib_method,
        num_bits=quantizer.num_bits,
        axis=quantizer.axis,
        unsigned=quantizer.unsigned,
        **options,
    )


@contextlib.contextmanager
def _calibration_mode(model: nn.Module, quantizers: list[tuple[str, TensorQuantizer]]) -> Iterator[None]:
    """Quantization off everywhere (the statistics are those of the float model, as in the seed);
    the given activation quantizers collect; eval mode (BatchNorm uses its running statistics)."""
    everything = [q for _, q in named_quantizers(model)]
    saved = [(q.quant_enabled, q.calib_enabled, q._calibrator) for q in everything]  # None: not built yet
    was_training = model.training
    try:
        for quantizer in everything:
            quantizer.disable_quant()
        for name, quantizer in quantizers:
            quantizer.calibrator = _NamedCollector(quantizer.calibrator, name)
            quantizer.enable_calib()
        model.eval()
        yield
    finally:
        for quantizer, (quant, calib, calibrator) in zip(everything, saved):
            quantizer.calibrator = calibrator
            _set_modes(quantizer, quant=quant, calib=calib)
        model.train(was_training)


def _set_modes(quantizer: TensorQuantizer, *, quant: bool, calib: bool) -> None:
    if quant:
        quantizer.enable_quant()
    else:
        quantizer.disable_quant()
    if calib:
        quantizer.enable_calib()
    else:
        quantizer.disable_calib()


def collect_stats(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_batches: int | None = None,
    calibrator: str | None = None,
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    **calibrator_options: Any,
) -> nn.Module:
    """Run ``data`` through ``model`` and collect range statistics in every enabled activation quantizer.

    Args:
        model: a model with quantizers (after :func:`qdq.quantize_model`).
        data: an iterable of batches (a DataLoader, a list of tensors...): a tensor, a tuple of positional
            arguments, a dict of keyword arguments (Hugging Face), or an ``(inputs, labels)`` pair
            (:mod:`qdq.utils.batches`); each goes through ``forward_fn(model, batch)`` (default:
            :func:`default_forward`).
        num_batches: stop after this many batches (default: all).
        calibrator: the calibrator every activation quantizer collects with: ``"histogram"`` (serves
            every method), ``"max"`` (cheaper; max only) or another registered name. Precedence: a
            name given here wins for every quantizer; ``None`` (the default) uses each quantizer's own
            descriptor ``calib_method`` (``"max"`` unless the descriptor says otherwise, as in the seed
            toolkit). Previous statistics are discarded.
        progress: show a progress bar; a string names it after the run (:mod:`qdq.workflow.progress`).
        calibrator_options: passed to every calibrator (e.g. ``num_bins=4096``, ``skip_zeros=True``).

    Under ``torch.distributed`` each rank collects on its own ``data`` (``num_batches`` is per rank; a
    rank may have no batch) through the module inside a DistributedDataParallel wrapper, so ranks need
    not have the same number of batches; :func:`load_amax` then combines the statistics.

    Attention placed for a target with shape conditions (TensorRT: head size, sequence length;
    :class:`~qdq.targets.AttentionFacts`) is settled here on the shapes the data had: where they fall
    outside, its four quantizers are disabled, with one warning.

    Raises:
        QdqCalibrationError: empty data, or NaN/Inf in a quantizer's input (named).
    """
    wrapper, model = model, unwrap(model)
    batches = _local_batches(data, num_batches)
    quantizers = named_quantizers(model, weights=False)
    if not quantizers:
        raise QdqConfigError("the model has no enabled activation quantizer; call qdq.quantize_model first.")
    for _, quantizer in quantizers:
        quantizer.calibrator = _make_calibrator(quantizer, calibrator, **calibrator_options)
    forward = forward_fn or default_forward
    total = batch_total(data, num_batches)
    forget_attention_shapes(model)
    with _calibration_mode(model, quantizers), torch.no_grad():
        for batch in progress_bar(batches, progress, "calibrating", total=total):
            forward(model, batch)
    message = settle_attention(model)  # the target's shape conditions on attention, now that shapes are known
    if message is not None:
        warnings.warn(message, stacklevel=2)
    return wrapper


def batch_total(data: Iterable[Any], num_batches: int | None) -> int | None:
    """How many batches a pass over the first ``num_batches`` of ``data`` reads, where that is known (for progress
    bars): ``len(data)`` capped at ``num_batches``."""
    total = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]
    return total if num_batches is None else num_batches if total is None else min(total, num_batches)


def _local_batches(data: Iterable[Any], num_batches: int | None) -> Iterator[Any]:
    """:func:`_batches`, except that one rank of several may have no data (the others' statistics reach it)."""
    try:
        return _batches(data, num_batches)
    except QdqCalibrationError:
        if world_size() < 2:
            raise
        _log.warning("rank %d has no calibration batch; it will receive the other ranks' statistics.", rank())
        return iter(())


def method_label(method: str, options: dict[str, Any] | None = None) -> str:
    """How reports name a method with its options: ``"entropy"``, ``"percentile 99.99"``."""
    percentile = (options or {}).get("percentile")
    return f"{method} {percentile}" if method == "percentile" and percentile is not None else method


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
        method: ``"max"``, ``"entropy"``, ``"mse"`` or ``"percentile"`` (``percentile=99.99`` by default);
            all but max need histogram statistics.
        weight_method: how weight quantizers get their range: ``"max"`` (per channel, the default),
            ``"percentile"``, ``"mse"``, or None to leave them as they are.
        strict: a quantizer that saw no data is an error (else a warning, and it stays dynamic).
        warn: afterwards, warn (:class:`~qdq.errors.QdqCalibrationWarning`) naming the quantizers whose range
            clips a large share of their activation's energy (:func:`qdq.calibration_report`).
        method_options: passed to ``compute_amax`` of the calibrators (``percentile``, ``start_bin``...).

    Raises:
        QdqConfigError: unknown method, or a method the collected statistics cannot give (entropy from
            a max calibrator); the message names the quantizer.
        QdqCalibrationError: a quantizer saw no data (with ``strict=True``).

    Statistics are first synchronised across processes when ``torch.distributed`` is initialised, so every
    rank loads the same amax (a collective: every rank must call it; a quantizer that saw no data on any
    rank raises on every rank). Each quantizer records the method in ``amax_method``.
    """
    check_method(method)
    quantizers = [(n, q) for n, q in named_quantizers(unwrap(model), weights=False) if q._calibrator is not None]
    assert_same_across_ranks([n for n, _ in quantizers], "the quantizers to calibrate")
    for name, quantizer in quantizers:
        calibrator = quantizer._calibrator
        if hasattr(calibrator, "sync"):
            with collective(f"synchronising the calibration statistics of {name}"):
                calibrator.sync()
        try:
            quantizer.load_calib_amax(method=method, strict=True, **method_options)
            quantizer.amax_method = method_label(method, method_options)
        except QdqCalibrationError as err:
            message = f"{name}: {err}"
            if strict:
                raise QdqCalibrationError(message) from err
            _log.warning(message)
        except QdqConfigError as err:
            raise QdqConfigError(f"{name}: {err}{_collect_hint(method)}") from err
    if weight_method is not None:
        calibrate_weights(unwrap(model), method=weight_method)
    if warn:
        from qdq.workflow.diagnostics import warn_clipping

        warn_clipping(model, stacklevel=2)
    return model


def _collect_hint(method: str) -> str:
    if method == "max":
        return ""
    return (f" Method {method!r} needs histogram statistics: collect_stats(..., calibrator='histogram'), "
            "or calib_method='histogram' in the quantizer's descriptor.")  # fmt: skip


def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    method: str = "max",
    *,
    num_batches: int | None = None,
    percentile: float = 99.99,
    weight_method: str | None = "max",
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    strict: bool = True,
) -> nn.Module:
    """Calibrate ``model`` on ``data``: collect statistics, compute amax with ``method``, load it.

    The calibrator is the one ``method`` needs (a max calibrator for ``"max"``, a histogram for the
    others), whatever the descriptors' ``calib_method``; use :func:`collect_stats` and
    :func:`load_amax` to calibrate with the descriptors' own calibrators.

    ``method="auto"`` chooses per activation quantizer, among the ranges of every method, the one with the
    smallest error at the output of the layer it feeds (:func:`qdq.workflow.auto_calibration.select_amax`):
    one more pass over the first batches of ``data``, which must then be re-iterable (a list or a DataLoader,
    not an iterator).

    Afterwards a :class:`~qdq.errors.QdqCalibrationWarning` names the quantizers whose range clips a large
    share of their activation's energy (see :func:`qdq.calibration_report`).

    Example:
        >>> model = qdq.quantize_model(model)
        >>> qdq.calibrate(model, calib_loader, method="entropy", num_batches=8)
    """
    if method == "auto":
        from qdq.workflow.auto_calibration import calibrate_auto

        return calibrate_auto(model, data, num_batches=num_batches, weight_method=weight_method,
                              forward_fn=forward_fn, progress=progress, strict=strict)  # fmt: skip
    kind = statistics_calibrator(check_method(method))
    collect_stats(model, data, num_batches=num_batches, calibrator=kind, forward_fn=forward_fn, progress=progress)
    options = {"percentile": percentile} if method == "percentile" else {}
    return load_amax(model, method, weight_method=weight_method, strict=strict, **options)

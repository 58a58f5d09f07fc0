"""Collecting calibration statistics: run data through a quantized model, every activation quantizer feeding its
calibrator.

The lowest of the calibration modules of the workflow (they import in one direction: ``post_training`` ->
``auto_calibration`` -> ``calibration`` -> ``diagnostics`` -> ``collection``): which quantizers a model has
(:func:`named_quantizers`), how a batch is fed (:func:`default_forward`), how the batches are read
(:func:`local_batches`, :func:`batch_total`, :func:`check_reiterable`), and :func:`collect_stats`. Computing the
ranges from the statistics is :mod:`qdq.workflow.calibration`'s.

Before and after its pass :func:`collect_stats` calls the calibration hooks of the model's quantized modules
(:func:`qdq.nn.base.calibration_started`, :func:`~qdq.nn.base.calibration_finished`): a module that must act on
what the data showed (attention, on the shapes its target's fused kernel takes) does it there, and calibration
knows nothing of placement.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.calib.registry import make_calibrator
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.nn.base import calibration_finished, calibration_started
from qdq.quantizer import TensorQuantizer
from qdq.utils.batches import call_model, sample_count, sample_slice
from qdq.utils.modes import eval_mode
from qdq.workflow.distributed import rank, unwrap, world_size
from qdq.workflow.progress import Progress, progress_bar

__all__ = [
    "MAX_KEPT",
    "ForwardFn",
    "HeldOut",
    "batch_total",
    "check_reiterable",
    "collect_split",
    "collect_stats",
    "default_forward",
    "first_batches",
    "local_batches",
    "named_quantizers",
    "split_batch",
]

_log = logging.getLogger(__name__)

#: ``forward_fn(model, batch)``: how a batch is fed to the model (:func:`default_forward` by default).
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
    if hasattr(data, "__len__") and len(data) == 0:  # type: ignore[arg-type]  # hasattr-checked: sized
        raise QdqCalibrationError("the calibration data is empty: it yields no batch.")
    iterator = iter(data)
    try:
        first = next(iterator)
    except StopIteration:
        raise QdqCalibrationError("the calibration data is empty: it yields no batch.") from None
    stream = itertools.chain([first], iterator)
    return itertools.islice(stream, num_batches) if num_batches is not None else stream


def local_batches(data: Iterable[Any], num_batches: int | None) -> Iterator[Any]:
    """The first ``num_batches`` batches of ``data`` (all: None); empty data raises, except on one rank of several
    (the others' statistics reach it).

    Raises:
        QdqConfigError: ``num_batches`` below 1.
        QdqCalibrationError: no batch (in one process).
    """
    try:
        return _batches(data, num_batches)
    except QdqCalibrationError:
        if world_size() < 2:
            raise
        _log.warning("rank %d has no calibration batch; it will receive the other ranks' statistics.", rank())
        return iter(())


def first_batches(data: Iterable[Any], count: int) -> tuple[Iterable[Any], list[Any]]:
    """``data`` to read again as it was, and its first batches: a list's first ``count``; a re-iterable's first
    ``min(count, 8)`` (a ``DataLoader``: it is iterated again from its start); a one-shot iterator's first
    ``min(count, 8)``, kept and chained before the rest of it."""
    if isinstance(data, list | tuple):
        return data, list(data[:count])
    if iter(data) is not data:
        return data, list(itertools.islice(data, min(count, _KEPT_FROM_ITERATORS)))
    first = list(itertools.islice(data, min(count, _KEPT_FROM_ITERATORS)))
    return itertools.chain(first, data), first


_KEPT_FROM_ITERATORS = 8  # the batches first_batches keeps in memory from data that is not a list


def batch_total(data: Iterable[Any], num_batches: int | None) -> int | None:
    """How many batches a pass over the first ``num_batches`` of ``data`` reads, where that is known (for progress
    bars): ``len(data)`` capped at ``num_batches``."""
    total = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]  # hasattr-checked: sized
    return total if num_batches is None else num_batches if total is None else min(total, num_batches)


def check_reiterable(data: Iterable[Any], method: str) -> None:
    """Raise unless ``data`` can be iterated again: the model-level ``method`` (``auto``) passes over it twice.

    Raises:
        QdqConfigError: ``data`` is a one-shot iterator.
    """
    if iter(data) is data:
        raise QdqConfigError(
            f"method {method!r} passes over the calibration data twice, but got a one-shot {type(data).__name__}; "
            "pass a list of batches or a DataLoader."
        )


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
    try:
        for quantizer in everything:
            quantizer.disable_quant()
        for name, quantizer in quantizers:
            quantizer.calibrator = _NamedCollector(quantizer.calibrator, name)
            quantizer.enable_calib()
        with eval_mode(model):
            yield
    finally:
        for quantizer, (quant, calib, calibrator) in zip(everything, saved):
            quantizer.calibrator = calibrator
            (quantizer.enable_quant if quant else quantizer.disable_quant)()
            (quantizer.enable_calib if calib else quantizer.disable_calib)()


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
        calibrator: the registered calibrator every activation quantizer collects with: ``"histogram"`` (serves
            every built-in method), ``"max"`` (cheaper; max only) or another registered name (what a
            method reads: :attr:`qdq.calib.CalibrationMethod.statistics`). Precedence: a name given here wins for
            every quantizer; ``None`` (the default) uses each quantizer's own descriptor ``calib_method`` (``"max"``
            unless the descriptor says otherwise, as in the seed toolkit). Previous statistics are discarded.
        progress: show a progress bar; a string names it after the run (:mod:`qdq.workflow.progress`).
        calibrator_options: passed to every calibrator (e.g. ``num_bins=4096``, ``skip_zeros=True``).

    Under ``torch.distributed`` each rank collects on its own ``data`` (``num_batches`` is per rank; a
    rank may have no batch) through the module inside a DistributedDataParallel wrapper, so ranks need
    not have the same number of batches; :func:`qdq.load_amax` then combines the statistics.

    Before and after the pass every quantized module's calibration hooks run
    (:meth:`qdq.nn.base.QuantModule.start_calibration`, :meth:`~qdq.nn.base.QuantModule.finish_calibration`); each
    message they return is one warning. Attention placed for a target with shape conditions (TensorRT: head size,
    sequence length; :class:`~qdq.targets.AttentionFacts`) is settled there on the shapes the data had: where they
    fall outside, its four quantizers are disabled, with one warning.

    Raises:
        QdqCalibrationError: empty data, or NaN/Inf in a quantizer's input (named).
    """
    return _collect(model, data, None, num_batches, calibrator, forward_fn, progress, calibrator_options).model


@dataclass
class HeldOut:
    """What :func:`collect_split` held out.

    Attributes:
        model: the model given (a DistributedDataParallel wrapper stays one).
        calibrators: activation quantizer name -> the statistics of the held-out batches (the quantizer's own
            calibrator has the other batches').
        batches: the held-out samples, batch by batch, each with the float model's output on them.
        first: when no batch was held out, the first batches with their float outputs (as many as ``MAX_KEPT``).
        fit: the first batches' samples not held out (as many as ``MAX_KEPT``), for a measurement made after the
            statistics (bias correction).
    """

    model: nn.Module
    calibrators: dict[str, Any] = field(default_factory=dict)
    batches: list[tuple[Any, Any]] = field(default_factory=list)
    first: list[tuple[Any, Any]] = field(default_factory=list)
    fit: list[Any] = field(default_factory=list)


#: :func:`collect_split` keeps at most this many of the first batches when none is held out
MAX_KEPT = 8


def collect_split(
    model: nn.Module,
    data: Iterable[Any],
    held_out: Callable[[int, int, int | None], int],
    *,
    num_batches: int | None = None,
    calibrator: str | None = None,
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    **calibrator_options: Any,
) -> HeldOut:
    """:func:`collect_stats`, with the samples ``held_out(index, batches held out so far, samples)`` picks (the last
    ones of the batch: dimension 0 of its tensors, :func:`qdq.utils.batches.sample_slice`) collected apart: their
    statistics go to a second calibrator per quantizer and the float model's outputs on them are kept."""
    return _collect(model, data, held_out, num_batches, calibrator, forward_fn, progress, calibrator_options)


def _collect(
    model: nn.Module,
    data: Iterable[Any],
    held_out: Callable[[int, int, int | None], int] | None,
    num_batches: int | None,
    calibrator: str | None,
    forward_fn: ForwardFn | None,
    progress: Progress,
    calibrator_options: dict[str, Any],
) -> HeldOut:
    wrapper, model = model, unwrap(model)
    batches = local_batches(data, num_batches)
    quantizers = named_quantizers(model, weights=False)
    if not quantizers:
        raise QdqConfigError("the model has no enabled activation quantizer; call qdq.quantize_model first.")
    for _, quantizer in quantizers:
        quantizer.calibrator = _make_calibrator(quantizer, calibrator, **calibrator_options)
    result = HeldOut(wrapper)
    if held_out is not None:
        result.calibrators = {n: _make_calibrator(q, calibrator, **calibrator_options) for n, q in quantizers}
    forward = forward_fn or default_forward
    total = batch_total(data, num_batches)
    calibration_started(model)
    with _calibration_mode(model, quantizers), torch.no_grad():
        for index, batch in enumerate(progress_bar(batches, progress, "calibrating", total=total)):
            if held_out is None:
                forward(wrapper, batch)
                continue
            fit, held = split_batch(batch, held_out(index, len(result.batches), sample_count(batch)))
            if fit is not None:
                if len(result.fit) < MAX_KEPT:
                    result.fit.append(fit)
                output = forward(wrapper, fit)
                if len(result.first) < MAX_KEPT:
                    result.first.append((fit, output))
            if held is not None:
                with _collecting_into(quantizers, result.calibrators):
                    result.batches.append((held, forward(wrapper, held)))
    if result.batches:
        result.first = []
    for message in calibration_finished(model):  # e.g. the target's shape conditions on attention, now known
        warnings.warn(message, stacklevel=3)
    return result


def split_batch(batch: Any, aside: int) -> tuple[Any | None, Any | None]:
    """``batch`` as (the samples kept, the last ``aside`` held out); None for an empty part. A batch whose samples
    cannot be counted (:func:`qdq.utils.batches.sample_count`) is held out whole when ``aside`` > 0."""
    size = sample_count(batch)
    if not aside:
        return batch, None
    if size is None or aside >= size:
        return None, batch
    return sample_slice(batch, 0, size - aside), sample_slice(batch, size - aside, size)


@contextlib.contextmanager
def _collecting_into(quantizers: list[tuple[str, TensorQuantizer]], calibrators: dict[str, Any]) -> Iterator[None]:
    """The quantizers collect into ``calibrators`` (by name) instead of their own, inside the context."""
    saved = [q._calibrator for _, q in quantizers]
    try:
        for name, quantizer in quantizers:
            quantizer.calibrator = _NamedCollector(calibrators[name], name)
        yield
    finally:
        for (_, quantizer), calibrator in zip(quantizers, saved):
            quantizer.calibrator = calibrator

"""Weight calibration: set every weight quantizer's amax from the weight itself (no data needed)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qdq.errors import QdqCalibrationError, QdqConfigError, QdqError, QdqTypeError

from .histogram import DEFAULT_NUM_BINS, DEFAULT_PERCENTILE
from .methods import WEIGHT_METHODS, CalibrationMethod, get_method
from .registry import calibrator_parameters, make_calibrator

__all__ = ["calibrate_weights"]


def calibrate_weights(
    model: nn.Module,
    method: str = "max",
    perchannel: bool = True,
    percentile: float = DEFAULT_PERCENTILE,
    num_bins: int = DEFAULT_NUM_BINS,
) -> dict[str, torch.Tensor]:
    """Set ``weight_quantizer.amax`` of every module that has ``weight`` and ``weight_quantizer``, and of
    every weight a module lists in ``quantized_weights()`` (``QuantLSTM`` / ``QuantLSTMCell``: the fused
    ``cat([W_ih, W_hh])`` of each layer and direction).

    The amax is computed from the module's weight with the quantizer's own ``axis``, ``num_bits`` and
    ``unsigned`` (so a ConvTranspose quantizer keeping axis 1 is calibrated on axis 1): the amax has
    the keepdims shape of that axis, or is 0-d for a per-tensor quantizer or ``perchannel=False``.

    Args:
        model: the model; its modules are duck-typed (``weight`` tensor, ``weight_quantizer`` with
            ``axis`` (tuple or None), ``num_bits``, ``unsigned`` and a settable ``amax``).
        method: a registered method that can set a weight's range (:data:`qdq.calib.WEIGHT_METHODS`: ``"max"``,
            the default, ``"percentile"``, ``"mse"``; entropy is an activation method). The default is the
            range the seed toolkit's recipe gives weights (its weight descriptors calibrate with max, per
            channel); the seed's ``calibrate_weights`` function itself defaulted to percentile, so pass
            ``method="percentile"`` to reproduce a script that relied on that default.
        perchannel: use the quantizer's axis; ``False`` computes one amax per weight tensor.
        percentile: for a method with a ``percentile`` option (``"percentile"``), in [0, 100].
        num_bins: histogram bins, for a method that reads a histogram (``"percentile"``, ``"mse"``).

    Returns:
        The amax set, by module name (float32, on the weight's device).

    Raises:
        QdqTypeError: ``model`` is not an ``nn.Module``.
        QdqConfigError: unknown method, or a quantizer/option the calibrators reject (the message
            names the module).
        QdqCalibrationError: an empty weight (named).
    """
    chosen = _check_arguments(model, method)
    done: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for suffix, weight, quantizer in _quantized_weights(module):
            name = f"{module_name}.{suffix}" if suffix and module_name else module_name or suffix
            try:
                amax = _weight_amax(weight, quantizer, chosen, perchannel, percentile, num_bins)
            except QdqError as err:
                raise type(err)(f"calibrate_weights: module {name!r}: {err}") from err
            quantizer.amax = amax
            done[name] = amax
    if not done:
        warnings.warn(
            "calibrate_weights found no module with both `weight` and `weight_quantizer`; "
            "nothing was calibrated. Quantize the model first.",
            stacklevel=2,
        )
    return done


def _quantized_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """``(name suffix, weight, quantizer)`` of each quantized weight of ``module``: its own
    ``quantized_weights()`` when it has one (an LSTM quantizes ``cat([W_ih, W_hh])`` per layer), else its
    ``weight`` and ``weight_quantizer``."""
    custom = getattr(module, "quantized_weights", None)
    if callable(custom):
        yield from custom()
        return
    weight = getattr(module, "weight", None)
    quantizer = getattr(module, "weight_quantizer", None)
    if quantizer is not None and isinstance(weight, torch.Tensor):
        yield "", weight, quantizer


def _check_arguments(model: object, method: str) -> CalibrationMethod:
    if not isinstance(model, nn.Module):
        raise QdqTypeError(f"calibrate_weights expects an nn.Module, got {type(model).__name__}.")
    chosen = get_method(method, who="calibrate_weights: ")
    if not chosen.weights:
        raise QdqConfigError(
            f"calibrate_weights: method {method!r} cannot set a weight's range; choose one of {list(WEIGHT_METHODS)}."
        )
    return chosen


def _weight_amax(
    weight: torch.Tensor,
    quantizer: object,
    method: CalibrationMethod,
    perchannel: bool,
    percentile: float,
    num_bins: int,
) -> torch.Tensor:
    axis = getattr(quantizer, "axis", None) if perchannel else None
    num_bits = getattr(quantizer, "num_bits", 8)
    unsigned = getattr(quantizer, "unsigned", False)
    bins = {"num_bins": num_bins} if "num_bins" in calibrator_parameters(method.calibrator) else {}
    calibrator = make_calibrator(method.calibrator, num_bits=num_bits, axis=axis, unsigned=unsigned, **bins)
    calibrator.collect(weight)
    options = {"percentile": percentile} if "percentile" in method.options else {}
    amax = method.compute_amax(calibrator, **options)
    if amax is None:
        raise QdqCalibrationError(f"the weight is empty (shape {tuple(weight.shape)}); there is no range to set.")
    return amax.to(weight.device)

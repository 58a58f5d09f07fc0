"""Bias correction for PyTorch models: each quantized Conv and Linear layer's bias absorbs the mean error its own
input and weight quantization add, as the ONNX door's (:mod:`qdq.onnx_in.bias_correction`) does, and the rule
both doors share for which shifts are measured.

For each :class:`~qdq.nn.QuantConv1d`/``2d``/``3d`` and :class:`~qdq.nn.QuantLinear` whose input and weight
quantizers are on, :func:`correct_biases` runs the model **float** (every quantizer off) over calibration batches and
measures, on each layer's own float input ``x``::

    shift[c] = mean over samples and positions of ( layer(Q(x), Q(W))[c] - layer(x, W)[c] )

(the layer computed once more with its two quantizers on; the bias cancels), then subtracts ``shift`` from the
layer's bias; a layer without one whose output a BatchNorm reads (a conv before its norm) has ``shift`` added to the
norm's running mean, the same correction with the model's ``state_dict`` keys unchanged. Each layer is corrected in
isolation on the float model's input, as NNCF's fast bias correction does: an upstream shift is not counted again
downstream.

**Only measured shifts are applied** (:func:`measured`): a channel's shift is a mean over samples of each sample's
own mean error ``m_i``, with sampling error ``SE = std(m_i) / sqrt(n)``; it is applied when ``n >= 2`` and
``|shift| >= SIGNIFICANCE * SE``. A channel whose float output does not vary on the first batch (its spread at most
:data:`CONSTANT_SPREAD` of the layer's largest: a dead channel) is named in ``BiasShift.constant`` and left out of
``BiasShift.relative``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.nn.conv import QuantConv1d, QuantConv2d, QuantConv3d
from qdq.nn.linear import QuantLinear
from qdq.quantizer import TensorQuantizer, disabled_quantizers
from qdq.utils.modes import eval_mode
from qdq.workflow.collection import ForwardFn, default_forward
from qdq.workflow.distributed import all_reduce_sum, unwrap

__all__ = ["CONSTANT_SPREAD", "SIGNIFICANCE", "BiasShift", "correct_biases", "measured", "undo"]

#: standard errors of the mean a channel's shift must reach to be applied
SIGNIFICANCE = 3.0
#: a channel whose output spread is at most this fraction of its layer's largest is a constant (dead) channel
CONSTANT_SPREAD = 1e-6

_CORRECTED = (QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear)


@dataclass(frozen=True)
class BiasShift:
    """One corrected bias: the op, its bias tensor, the shift subtracted (float32, per output channel: 0 where it
    was not measured), the shift relative to the spread of the layer's float output (``|shift| / std`` on the first
    calibration batch, the largest over the channels that vary; the spread averaged over the ranks of a sharded
    run), the channels whose output does not vary (``constant``) and those whose shift was not significant against
    its sampling error (``unmeasured``: left at 0). PyTorch: ``bias`` is ``"<layer>.bias"``, or
    ``"<norm>.running_mean"`` of the BatchNorm reading a layer that has no bias."""

    op: str
    bias: str
    shift: np.ndarray
    relative: float
    constant: tuple[int, ...] = ()
    unmeasured: tuple[int, ...] = ()

    @property
    def applied(self) -> bool:
        """Does the shift change the bias (some channel measured with a non-zero shift)?"""
        return bool(np.any(self.shift != 0))


def measured(shift: np.ndarray, sample_sum: np.ndarray, sample_squares: np.ndarray, samples: int) -> np.ndarray:
    """Which channels' ``shift`` is significant against its sampling error: ``|shift| >= SIGNIFICANCE * SE``, with
    ``SE = std(m_i) / sqrt(n)`` from the ``n = samples`` per-sample mean errors ``m_i`` (given as their sum and the
    sum of their squares, per channel). With fewer than 2 samples nothing is measured."""
    if samples < 2:
        return np.zeros(shift.shape, bool)
    mean = sample_sum / samples
    variance = np.maximum(sample_squares - samples * mean**2, 0.0) / (samples - 1)
    return np.abs(shift) >= SIGNIFICANCE * np.sqrt(variance / samples)


@dataclass
class _Sums:
    """A layer's per-sample mean errors summed (and squared), the samples, its float output's spread on the first
    batch (``spreads``: how many such spreads are summed in it, one per rank that saw a batch)."""

    channels: int
    total: np.ndarray = field(init=False)
    squares: np.ndarray = field(init=False)
    spread: np.ndarray = field(init=False)
    samples: int = 0
    spreads: int = 0
    busy: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.total, self.squares, self.spread = (np.zeros(self.channels) for _ in range(3))

    def add(self, errors: torch.Tensor, output: torch.Tensor, channel_dim: int) -> None:
        """Add one batch's errors (quantized minus float output) and float output, on their own device: only the
        ``[N, C]`` means and the ``C`` spreads reach the host."""
        channel = channel_dim % errors.dim()
        inner = [d for d in range(1, errors.dim()) if d != channel]  # reduced in place: no channel-last copy
        per_sample = (errors.mean(dim=inner, dtype=torch.float64) if inner else errors.double()).cpu().numpy()
        if not self.spreads:
            spread = output.double().std(dim=[0, *inner], correction=0)
            self.spread, self.spreads = spread.cpu().numpy(), 1
        self.total += per_sample.sum(axis=0)
        self.squares += (per_sample**2).sum(axis=0)
        self.samples += per_sample.shape[0]

    def flat(self) -> list[float]:
        return [*self.total, *self.squares, *self.spread, float(self.samples), float(self.spreads)]

    def load(self, flat: Sequence[float]) -> None:
        """These sums from :meth:`flat` values (summed over the ranks): every rank then holds every rank's batches."""
        c = self.channels
        self.total, self.squares = np.asarray(flat[:c]), np.asarray(flat[c : 2 * c])
        self.samples, self.spreads = int(flat[3 * c]), int(flat[3 * c + 1])
        self.spread = np.asarray(flat[2 * c : 3 * c]) / max(self.spreads, 1)


def correct_biases(model: nn.Module, batches: Sequence[Any], forward: ForwardFn | None = None, *,
                   norms: Mapping[str, str] | None = None) -> list[BiasShift]:  # fmt: skip
    """Subtract from each quantized Conv and Linear layer's bias the mean output shift its own input and weight
    quantization cause on ``batches`` (run with ``forward``); returns the shifts, one per layer measured (see the
    module docstring). A layer without a bias whose output only a BatchNorm reads (``norms``: layer name -> that
    BatchNorm's name; the model in eval mode) has the shift added to the norm's running mean instead, the same
    correction; other
    layers without a bias are left as they are (a new bias would change the model's ``state_dict`` keys).
    :func:`undo` takes them back."""
    root = unwrap(model)
    norms = norms or {}
    modules = dict(root.named_modules())
    layers = {name: module for name, module in modules.items() if _corrected(module)
              and (getattr(module, "bias", None) is not None or name in norms)}  # fmt: skip
    if not layers or not batches:
        return []
    sums = {name: _Sums(_channels(module)) for name, module in layers.items()}
    run = forward or default_forward
    with eval_mode(root), disabled_quantizers(root), torch.no_grad(), _hooks(layers, sums):
        for batch in batches:
            run(model, batch)
    flat = all_reduce_sum([v for name in layers for v in sums[name].flat()])  # every rank the same shifts
    start = 0
    for name in layers:
        size = 3 * sums[name].channels + 2
        sums[name].load(flat[start : start + size])
        start += size
    return [_subtract(name, layers[name], sums[name], norms.get(name), modules) for name in layers
            if sums[name].samples]  # fmt: skip


def undo(model: nn.Module, shifts: Sequence[BiasShift]) -> None:
    """Take back the ``shifts`` :func:`correct_biases` applied."""
    modules = dict(unwrap(model).named_modules())
    for shift in shifts:
        if shift.applied:
            _move(modules, shift.bias, shift.shift, undo=True)


def _move(modules: Mapping[str, nn.Module], where: str, shift: np.ndarray, *, undo: bool = False) -> None:
    """Apply ``shift`` (or take it back) at ``where``: a bias takes ``-shift``; the running mean of the norm reading
    the layer's output takes ``+shift`` (the norm computes ``y + shift - mean``)."""
    target = _target(modules, where)
    assert target is not None, where
    sign = (1.0 if where.endswith(".running_mean") else -1.0) * (-1.0 if undo else 1.0)
    with torch.no_grad():
        target.add_(torch.from_numpy(sign * shift).to(target))


def _target(modules: Mapping[str, nn.Module], where: str) -> torch.Tensor | None:
    """The tensor at ``where`` (``"<module>.bias"``, ``"<module>.running_mean"``)."""
    owner, _, attribute = where.rpartition(".")
    found = getattr(modules.get(owner), attribute, None)
    return found if isinstance(found, torch.Tensor) else None


def _channels(module: nn.Module) -> int:
    return int(getattr(module, "out_features" if isinstance(module, QuantLinear) else "out_channels"))


def _corrected(module: nn.Module) -> bool:
    quantizers = (getattr(module, "_input_quantizer", None), getattr(module, "_weight_quantizer", None))
    return isinstance(module, _CORRECTED) and all(isinstance(q, TensorQuantizer) and q.is_quantizing
                                                  for q in quantizers)  # fmt: skip


@contextlib.contextmanager
def _hooks(layers: dict[str, nn.Module], sums: dict[str, _Sums]) -> Iterator[None]:
    handles = [module.register_forward_hook(_observer(module, sums[name])) for name, module in layers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _observer(module: nn.Module, sums: _Sums) -> Any:
    channel_dim = -1 if isinstance(module, QuantLinear) else 1
    own = [q for q in (getattr(module, "_input_quantizer", None), getattr(module, "_weight_quantizer", None))
           if isinstance(q, TensorQuantizer)]  # fmt: skip

    def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if sums.busy or not args or not torch.is_tensor(args[0]):
            return
        sums.busy = True
        try:
            for quantizer in own:
                quantizer.enable()
            quantized = module(args[0])
        finally:
            for quantizer in own:
                quantizer.disable()
            sums.busy = False
        sums.add(quantized - output, output, channel_dim)

    return hook


def _subtract(name: str, module: nn.Module, sums: _Sums, norm: str | None,
              modules: Mapping[str, nn.Module]) -> BiasShift:  # fmt: skip
    mean = sums.total / sums.samples
    constant = sums.spread <= CONSTANT_SPREAD * max(float(sums.spread.max()), 1e-30)
    keep = measured(mean, sums.total, sums.squares, sums.samples)
    shift = np.where(keep, mean, 0.0).astype(np.float32)
    where = f"{name}.bias" if isinstance(module.bias, torch.Tensor) else f"{norm}.running_mean"
    _move(modules, where, shift)
    varying = ~constant
    relative = float(np.max(np.abs(shift[varying]) / sums.spread[varying])) if varying.any() else 0.0
    return BiasShift(name, where, shift, relative, tuple(int(c) for c in np.flatnonzero(constant)),
                     tuple(int(c) for c in np.flatnonzero(~keep)))  # fmt: skip

"""Histogram calibration: one power-of-two histogram per channel, amax by max/entropy/mse/percentile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean

from . import algorithms, binning, distributed
from .base import Axis, Calibrator, CalibState, ChannelLayout

__all__ = ["DEFAULT_NUM_BINS", "DEFAULT_PERCENTILE", "DEFAULT_START_BIN", "DEFAULT_STRIDE", "HistogramCalibrator"]

_MAX_BINS = 1 << 24  # bin indices stay exact in float32 arithmetic
#: Default bins per channel. The data max lies in the upper half of the power-of-two range, so 2048 to
#: 4096 bins cover ``[0, max]``: at least the seed's 2048 (whose bins end at the max). 4096 bins put mse's
#: amax closer to the best than 2048 (benchmarks/RESULTS.md, code_figures); compute_amax stays in milliseconds.
DEFAULT_NUM_BINS = 4096
#: Default options of :meth:`HistogramCalibrator.compute_amax` (and of the registered methods that use them,
#: :mod:`qdq.calib.methods`): the percentile, and the first candidate bin and the step of entropy and mse.
DEFAULT_PERCENTILE = 99.99
DEFAULT_START_BIN = 128
DEFAULT_STRIDE = 1
_OPTIONS = ("percentile", "start_bin", "stride")


def _max(cal: HistogramCalibrator, hist: _Hist, width: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    return hist.max.clone()


def _percentile(cal: HistogramCalibrator, hist: _Hist, width: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    return algorithms.percentile_amax(hist.counts, width, options["percentile"])


def _searched(search: Any) -> Any:
    """An algorithm that searches the candidate bins from ``start_bin`` by ``stride`` (entropy, mse)."""

    def amax(cal: HistogramCalibrator, hist: _Hist, width: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        found: torch.Tensor = search(hist.counts, width, num_bits=cal.num_bits, unsigned=cal.unsigned,
                                     start_bin=options["start_bin"], stride=options["stride"])  # fmt: skip
        return found

    return amax


#: method -> ``amax(calibrator, histogram, bin width, options)``: what :meth:`HistogramCalibrator.compute_amax` runs
_ALGORITHMS = {
    "entropy": _searched(algorithms.entropy_amax),
    "mse": _searched(algorithms.mse_amax),
    "percentile": _percentile,
    "max": _max,
}
_SEARCHES = ("entropy", "mse")  # the methods with start_bin and stride


class HistogramCalibrator(Calibrator):
    """Histogram of magnitudes per tensor or per kept channel; amax by ``max``, ``entropy``, ``mse``, ``percentile``.

    The histogram of each channel has ``num_bins`` int64 bins over ``[0, 2**k)``, ``k`` the smallest
    integer above every magnitude seen (see :mod:`qdq.calib.binning`): a larger later batch re-bins
    exactly instead of adding bins, and the histogram of a set of batches does not depend on their
    order or on how they were split, so :meth:`merge` and :meth:`sync` give bit-identical amax. The
    exact running max is kept too (method ``"max"``); no method returns an amax above it (a bin's upper edge can
    lie above every value seen). Channels whose data is all zero get amax 0.

    Args:
        num_bits: bit width of the target format (entropy levels and mse quantization).
        axis: axes to keep; ``None`` is one histogram per tensor.
        unsigned: histogram ``max(x, 0)`` instead of ``|x|``.
        num_bins: bins per channel, in [2, 2**24].
        skip_zeros: leave exact zeros out of the histogram (they still count for ``"max"``).
        method: default method of :meth:`compute_amax`.
        percentile: default percentile, in [0, 100].
        start_bin: first candidate bin of entropy and mse.
        stride: step between candidate bins of entropy and mse.

    Example:
        >>> cal = HistogramCalibrator(method="percentile", percentile=90)
        >>> cal.collect(torch.arange(100.0))
        >>> float(cal.compute_amax())
        89.0
    """

    methods = tuple(_ALGORITHMS)  # ("entropy", "mse", "percentile", "max")

    def __init__(
        self,
        num_bits: int = 8,
        axis: Axis = None,
        unsigned: bool = False,
        num_bins: int = DEFAULT_NUM_BINS,
        skip_zeros: bool = False,
        method: str = "entropy",
        *,
        percentile: float = DEFAULT_PERCENTILE,
        start_bin: int = DEFAULT_START_BIN,
        stride: int = DEFAULT_STRIDE,
    ) -> None:
        super().__init__(num_bits, axis, unsigned)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or not 2 <= num_bins <= _MAX_BINS:
            raise QdqConfigError(f"num_bins must be an int in [2, {_MAX_BINS}], got {num_bins!r}.")
        self._num_bins = num_bins
        self._skip_zeros = bool(skip_zeros)
        self._method = self._check_method(method, "entropy")
        self._defaults = self._check_options({"percentile": percentile, "start_bin": start_bin, "stride": stride})

    @property
    def method(self) -> str:
        """Default method of :meth:`compute_amax`."""
        return self._method

    @property
    def num_bins(self) -> int:
        """Bins per channel."""
        return self._num_bins

    @property
    def bin_counts(self) -> torch.Tensor | None:
        """A copy of the int64 counts, shape ``(C, num_bins)`` (``C = 1`` per tensor), or ``None``."""
        state = self._state
        return None if state is None else state.counts.clone()

    @property
    def bin_width(self) -> torch.Tensor | None:
        """Bin width per channel (float64, shape ``(C,)``; bin ``j`` is ``[j*w, (j+1)*w)``), or ``None``."""
        state = self._state
        return None if state is None else binning.bin_width(state.exponent, self._num_bins)

    def compute_amax(self, method: str | None = None, **kwargs: Any) -> torch.Tensor | None:
        """Return the amax (float32, keepdims shape; 0-d per tensor), or ``None`` if nothing was collected.

        Args:
            method: ``"entropy"``, ``"mse"``, ``"percentile"``, ``"max"``, or ``None`` for the default.
            **kwargs: ``percentile`` (used by percentile), ``start_bin`` and ``stride`` (entropy and
                mse) override the constructor's defaults; options a method does not use are ignored,
                so one set of options can be passed to every method.

        Raises:
            QdqConfigError: unknown method or an option out of range.
            QdqTypeError: an unknown option name.
        """
        method = self._check_method(method, self._method)
        options = {**self._defaults, **self._check_options(kwargs)}
        if options["start_bin"] > self._num_bins and method in _SEARCHES:
            raise QdqConfigError(
                f"start_bin={options['start_bin']} is beyond num_bins={self._num_bins}; "
                "use a start_bin below the number of bins."
            )
        state = self._state
        if state is None or self._layout is None:
            return None
        self._check_finite()
        # A bin's upper edge can lie above every value seen (the range is [0, 2**k)): no range beyond the max
        amax = torch.minimum(self._amax_by(state, method, options), state.max)
        amax = torch.where(state.max > 0, amax, torch.zeros_like(amax))
        return amax.reshape(self._layout.shape)

    def _amax_by(self, hist: _Hist, method: str, options: dict[str, Any]) -> torch.Tensor:
        return _ALGORITHMS[method](self, hist, binning.bin_width(hist.exponent, self._num_bins), options)

    def _check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise QdqTypeError(
                f"HistogramCalibrator got unknown option(s) {unknown}; valid options are {list(_OPTIONS)}."
                f"{did_you_mean(unknown[0], _OPTIONS)}"
            )
        if "percentile" in options:
            algorithms.check_percentile(options["percentile"])
        for name in ("start_bin", "stride"):
            if name in options:
                algorithms.check_positive_int(options[name], name)
        return dict(options)

    def _config(self) -> tuple[Any, ...]:
        return (*super()._config(), self._num_bins, self._skip_zeros)

    def _batch_state(self, x: torch.Tensor, layout: ChannelLayout, batch_max: torch.Tensor) -> _Hist:
        batch_max = batch_max.reshape(-1)
        exponent = binning.range_exponent(batch_max)
        counts = binning.histogram(
            x, exponent, layout, self._num_bins, unsigned=self._unsigned, skip_zeros=self._skip_zeros
        )
        return _Hist(counts, exponent, batch_max)

    def _empty_state(self, layout: ChannelLayout) -> _Hist:
        channels = layout.num_channels
        return _Hist(
            torch.zeros(channels, self._num_bins, dtype=torch.int64),
            torch.full((channels,), binning.MIN_EXPONENT, dtype=torch.int64),
            torch.zeros(channels, dtype=torch.float32),
        )

    def _all_reduce(self, state: CalibState, group: Any) -> _Hist:
        """Common range first (max of the exponents), then exact re-binning, then the integer sum."""
        assert isinstance(state, _Hist)
        exponent = distributed.all_reduce(state.exponent, "max", group)
        counts = binning.rebin(state.counts, exponent - state.exponent)
        return _Hist(
            distributed.all_reduce(counts, "sum", group), exponent, distributed.all_reduce(state.max, "max", group)
        )

    def _repr_fields(self) -> list[str]:
        return [*super()._repr_fields(), f"num_bins={self._num_bins}", f"method={self._method!r}"]


@dataclass
class _Hist:
    """Histogram state of all channels, kept on one device.

    Attributes:
        counts: int64 ``(C, num_bins)``; channel ``c`` covers ``[0, 2**exponent[c])``.
        exponent: int64 ``(C,)`` range exponents.
        max: float32 ``(C,)`` exact largest magnitude.
    """

    counts: torch.Tensor
    exponent: torch.Tensor
    max: torch.Tensor

    def clone(self) -> _Hist:
        return _Hist(self.counts.clone(), self.exponent.clone(), self.max.clone())

    def add(self, other: _Hist) -> None:
        """Add ``other`` in place, re-binning both to the larger range per channel (exact)."""
        device = self.counts.device
        theirs = other.exponent.to(device)
        exponent = torch.maximum(self.exponent, theirs)
        counts = binning.rebin(self.counts, exponent - self.exponent)
        counts += binning.rebin(other.counts.to(device), exponent - theirs)
        self.counts, self.exponent = counts, exponent
        self.max = torch.maximum(self.max, other.max.to(device))

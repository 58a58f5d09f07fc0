"""Calibration diagnostics: how much of each activation its calibrated range clips, and a warning when too much.

Everything here is computed from the statistics calibration already collected (no pass over the data). For
each activation quantizer, with ``m = |x|`` (``x`` for an unsigned quantizer) over the values calibration saw:

* **values clipped**: the share of the values with ``m > amax``; they saturate at amax;
* **energy above amax**: their share of the energy ``sum(m**2)``. A range that cuts off a sparse tail can clip
  1 % of the values and most of the energy, which is where the signal of a post-ReLU activation often is (the
  text of a detector's score map, the strokes of a digit). But values *just* above amax carry their energy
  too while losing little to clipping, so this share alone flags harmless ranges (a percentile 99 range can put
  a large share of the energy above amax at no cost in accuracy: benchmarks/RESULTS.md, calibration_quality);
* **clipping error**: ``sum((m - amax)**2)`` over the clipped values, relative to ``sum(m**2)``: the share of
  the activation's energy that clipping removes (the clipping half of what the mse method weighs against
  rounding). A quantizer is flagged when it reaches :data:`CLIPPED_ENERGY_LIMIT`;
* **amax / max**: the range against the largest magnitude seen (the smallest ratio over channels);
* **method**: how the range was set (:attr:`qdq.TensorQuantizer.amax_method`).

From a histogram calibrator the shares are estimates: each bin's values are taken as spread evenly over the
bin (the last non-empty bin ends at the exact max), so the only approximation is the split of the one bin
that amax falls in and the mean of ``m**2`` within each bin; with the default 4096 bins the shares are within
0.1 point of the exact ones (tested against sums over the raw data). Keeping an exact per-bin sum of ``m**2``
instead would add a weighted histogram to every calibration batch for no visible gain. A max calibrator clips
nothing when the range is its max; with a smaller range set by hand its shares are unknown (``None``).
Per-channel statistics are summed over channels. Statistics synchronised across processes
(:func:`qdq.load_amax` does it) give the same report on every rank.

:func:`calibration_report` returns the table; :func:`qdq.load_amax` (and so :func:`qdq.calibrate`) and
:func:`qdq.ptq` call :func:`warn_clipping` after calibrating, which emits one
:class:`~qdq.errors.QdqCalibrationWarning` naming each flagged quantizer.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from qdq.errors import QdqCalibrationWarning, QdqConfigError
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer
from qdq.workflow.collection import named_quantizers
from qdq.workflow.distributed import is_main_process, unwrap

__all__ = [
    "CLIPPED_ENERGY_LIMIT",
    "CalibrationReport",
    "QuantizerDiagnostics",
    "Shares",
    "calibration_report",
    "clipped_shares",
    "warn_clipping",
]

#: A quantizer whose clipping removes at least this share of its activation's energy is flagged. On the digits
#: CNNs, one quantizer at a time with every other range at max, the ranges that cost 5 points of accuracy or more
#: on their own and those that cost nothing (max, mse, percentiles) form two populations of clipping error with
#: this limit between them, with a margin either side (benchmarks/RESULTS.md, calibration_quality: the
#: per-quantizer sweep). It cannot see how sensitive a layer is (a squeeze-excitation gate lost 5 points far below
#: it; entropy ranges far above it cost nothing on insensitive layers); ``method="auto"`` measures each layer's
#: output instead.
CLIPPED_ENERGY_LIMIT = 0.1
#: At most this many quantizers are named in the warning; the others are counted.
WARNING_LINES = 5


@dataclass(frozen=True)
class QuantizerDiagnostics:
    """What one activation quantizer's range does to the data calibration saw.

    Attributes:
        name: the quantizer's module name.
        method: how its range was set (``None``: unknown, e.g. set by hand).
        calibrator: the class of its calibrator (``"HistogramCalibrator"``, ``"MaxCalibrator"``).
        amax: its range (the largest channel's), in the data's units.
        data_max: the largest magnitude seen.
        amax_ratio: the smallest ``amax / max`` over channels that saw non-zero data.
        clipped_values: share (0-1) of the values above amax, or ``None`` if unknown.
        energy_above: share (0-1) of ``sum(m**2)`` carried by those values, or ``None`` if unknown.
        clipping_error: ``sum((m - amax)**2)`` over them relative to ``sum(m**2)`` (0-1), or ``None`` if unknown.
        channels: number of channels of the statistics (1 per tensor).
    """

    name: str
    method: str | None
    calibrator: str
    amax: float
    data_max: float
    amax_ratio: float | None
    clipped_values: float | None
    energy_above: float | None
    clipping_error: float | None
    channels: int = 1


_LEGEND = (
    "amax: the quantizer's range (largest channel); max: the largest magnitude m calibration saw; values clipped: "
    "share of the calibration values above amax; energy above amax: their share of the energy sum(m²); clipping "
    "error: sum((m - amax)²) over them / sum(m²), the share of the energy clipping removes; shares estimated from "
    "the histogram (values spread evenly within a bin). check: FAIL when the clipping error is {limit} or more: "
    "the range cuts off a tail that may carry the signal."
)


@dataclass
class CalibrationReport:
    """Diagnostics of every calibrated activation quantizer of a model, in model order.

    Attributes:
        quantizers: one :class:`QuantizerDiagnostics` per activation quantizer with statistics and a range.
        limit: the clipping error from which a quantizer is flagged.
    """

    quantizers: list[QuantizerDiagnostics] = field(default_factory=list)
    limit: float = CLIPPED_ENERGY_LIMIT

    def flagged(self) -> list[QuantizerDiagnostics]:
        """Quantizers whose clipping error is at least ``limit``, the worst first."""
        return [d for error, d in self._ranked() if error >= self.limit]

    def worst(self, count: int | None = None) -> list[QuantizerDiagnostics]:
        """The ``count`` quantizers (all by default) with the largest known clipping error, the worst first."""
        ranked = [d for _, d in self._ranked()]
        return ranked if count is None else ranked[:count]

    def _ranked(self) -> list[tuple[float, QuantizerDiagnostics]]:
        """``(clipping error, diagnostics)`` of the quantizers whose clipping error is known, the worst first."""
        known = [(d.clipping_error, d) for d in self.quantizers if d.clipping_error is not None]
        return sorted(known, key=lambda pair: -pair[0])

    @property
    def legend(self) -> str:
        """What the table's columns mean."""
        return _LEGEND.format(limit=_share(self.limit, "g"))

    def rows(self) -> list[list[str]]:
        """The table's cells, one row per quantizer."""
        return [
            [d.name, d.method or "?", f"{d.amax:.4g}", f"{d.data_max:.4g}", _ratio(d.amax_ratio),
             _share(d.clipped_values), _share(d.energy_above), _share(d.clipping_error), self._check(d)]
            for d in self.quantizers
        ]  # fmt: skip

    headers = ("quantizer", "method", "amax", "max", "amax/max", "values clipped", "energy above amax",
               "clipping error", "check")  # fmt: skip

    def table(self, *, escape_all: bool = False) -> str:
        """Markdown table (see :attr:`legend`)."""
        return markdown_table(self.headers, self.rows(), escape_all=escape_all)

    def __str__(self) -> str:
        return f"{self.table()}\n\n{self.legend}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values: ``{"limit", "flagged": [names], "quantizers": [one dict per quantizer]}``."""
        return {
            "limit": self.limit,
            "flagged": [d.name for d in self.flagged()],
            "quantizers": [asdict(d) for d in self.quantizers],
        }

    def warning_text(self, max_lines: int = WARNING_LINES) -> str | None:
        """The warning for the flagged quantizers (one line each, ``max_lines`` at most), or ``None``."""
        flagged = self.flagged()
        if not flagged:
            return None
        count = len(flagged)
        lines = [
            f"{count} activation quantizer{'s' if count > 1 else ''} clip{'' if count > 1 else 's'} away "
            f"{_share(self.limit, 'g')} or more of the activation's energy (sum((|x| - amax)²) over the values above "
            "amax, against sum(x²)), which usually costs accuracy:"
        ]
        lines += [f"  {_describe(d)}" for d in flagged[:max_lines]]
        if count > max_lines:
            lines.append(f"  ... and {count - max_lines} more; qdq.calibration_report(model) lists every quantizer.")
        lines.append(
            'method="auto" (the default) keeps such a range only when the model\'s outputs on held-out calibration '
            "samples stay clearly closer to float with it than with any range that does not clip this much; compare "
            "methods on your own metric with qdq.ptq."
        )
        return "\n".join(lines)

    def _check(self, d: QuantizerDiagnostics) -> str:
        if d.clipping_error is None:
            return "?"
        return "FAIL" if d.clipping_error >= self.limit else "PASS"


def _describe(d: QuantizerDiagnostics) -> str:
    ratio = "" if d.amax_ratio is None else f" ({d.amax_ratio:.2f} x the max {d.data_max:.4g})"
    return (
        f"{d.name} ({d.method or 'method unknown'}): amax {d.amax:.4g}{ratio} clips away "
        f"{_share(d.clipping_error)} of the energy ({_share(d.clipped_values)} of the values are above it)"
    )


def _share(value: float | None, spec: str = ".2f") -> str:
    """A share as a percentage (``"12.34 %"``; three significant digits below 0.01 %)."""
    if value is None:
        return "?"
    percent = 100 * value
    return f"{percent:.3g} %" if 0 < percent < 0.01 else f"{percent:{spec}} %"


def _ratio(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


# -- the numbers ----------------------------------------------------------------------------------------


class Shares(NamedTuple):
    """Sums over a histogram per channel (float64 tensors of shape ``(C,)``)."""

    count: torch.Tensor  # type: ignore[assignment]  # hides tuple.count: a public field, kept  #: values
    energy: torch.Tensor  #: sum of x**2
    clipped_count: torch.Tensor  #: values above amax
    clipped_energy: torch.Tensor  #: sum of x**2 over the values above amax
    clipping_error: torch.Tensor  #: sum of (|x| - amax)**2 over the values above amax: what clipping removes


def clipped_shares(counts: torch.Tensor, bin_width: torch.Tensor, amax: torch.Tensor, data_max: torch.Tensor) -> Shares:
    """Values and energy of a histogram of magnitudes, in total and above ``amax``, per channel.

    Args:
        counts: integer counts ``(C, n)``; bin ``j`` of channel ``c`` is ``[j * w_c, (j + 1) * w_c)``.
        bin_width: ``w_c``, shape ``(C,)``.
        amax: the range per channel, shape ``(C,)``.
        data_max: the exact largest magnitude per channel, shape ``(C,)`` (the last non-empty bin ends there).

    Returns:
        :class:`Shares`. Within a bin values are taken as spread evenly; nothing is above amax where
        ``amax >= data_max``.
    """
    device = counts.device
    n = counts.shape[-1]
    counts = counts.reshape(-1, n).to(torch.float64)
    width = bin_width.reshape(-1, 1).to(device, torch.float64)
    top = data_max.reshape(-1, 1).to(device, torch.float64)
    a = amax.reshape(-1, 1).to(device, torch.float64)
    lo = torch.arange(n, dtype=torch.float64, device=device) * width
    hi = torch.minimum(lo + width, top).clamp(min=lo)
    cut = torch.minimum(torch.maximum(a, lo), hi)  # where the clipped part of each bin starts
    span = hi - lo
    above = torch.where(span > 0, (hi - cut) / span.clamp(min=torch.finfo(torch.float64).tiny), (lo > a).double())
    clipped = torch.where(a < top, counts * above, torch.zeros_like(counts))
    return Shares(
        counts.sum(1),
        (counts * _mean_square(lo, hi)).sum(1),
        clipped.sum(1),
        (clipped * _mean_square(cut, hi)).sum(1),
        (clipped * _mean_square(cut - a, hi - a)).sum(1),
    )


def _mean_square(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Mean of ``x**2`` for ``x`` uniform on ``[lo, hi]`` (``lo**2`` when ``hi == lo``)."""
    return (lo * lo + lo * hi + hi * hi) / 3


def _per_channel(value: torch.Tensor, channels: int) -> torch.Tensor | None:
    flat = value.detach().reshape(-1).to(torch.float64)
    if flat.numel() == channels:
        return flat
    return flat.expand(channels) if flat.numel() == 1 else None


def diagnose(name: str, quantizer: TensorQuantizer) -> QuantizerDiagnostics | None:
    """Diagnostics of one quantizer from its calibrator, or ``None`` without statistics or range."""
    calibrator = getattr(quantizer, "_calibrator", None)
    return diagnose_statistics(name, calibrator, quantizer.effective_amax(), quantizer.amax_method)


def diagnose_statistics(name: str, calibrator: Any, amax: Any, method: str | None) -> QuantizerDiagnostics | None:
    """Diagnostics of a range ``amax`` (a tensor or array) against the statistics of ``calibrator`` (any front end:
    the ONNX front end calls it with its own calibrators), or ``None`` without statistics or range."""
    if amax is not None and not torch.is_tensor(amax):
        amax = torch.as_tensor(amax)
    if calibrator is None or not getattr(calibrator, "has_data", False) or amax is None:
        return None
    data_max = calibrator.compute_amax("max").detach().reshape(-1).to(torch.float64)
    channels = data_max.numel()
    ranges = _per_channel(amax, channels)
    if ranges is None:  # a range whose shape does not match the statistics: nothing to compare
        return None
    ranges = ranges.to(data_max.device)
    seen = data_max > 0
    ratio = torch.where(seen, ranges / data_max.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(ranges))
    counts = getattr(calibrator, "bin_counts", None)
    shares: list[float | None]
    if counts is not None:
        sums = clipped_shares(counts, calibrator.bin_width, ranges, data_max)
        total, energy, *clipped = (float(s.sum()) for s in sums)
        shares = [clipped[0] / total if total else 0.0, *(c / energy if energy else 0.0 for c in clipped[1:])]
    elif bool((ranges >= data_max).all()):
        shares = [0.0, 0.0, 0.0]
    else:
        shares = [None, None, None]
    return QuantizerDiagnostics(
        name=name,
        method=method,
        calibrator=type(calibrator).__name__,
        amax=float(ranges.max()),
        data_max=float(data_max.max()),
        amax_ratio=float(ratio.min()) if bool(seen.any()) else None,
        clipped_values=shares[0],
        energy_above=shares[1],
        clipping_error=shares[2],
        channels=channels,
    )


def calibration_report(model: nn.Module, *, limit: float = CLIPPED_ENERGY_LIMIT) -> CalibrationReport:
    """Diagnostics of every calibrated activation quantizer of ``model`` (see the module docstring).

    Call it after :func:`qdq.calibrate`, :func:`qdq.ptq` or :func:`qdq.load_amax`, while the calibrators
    still hold their statistics. Quantizers without statistics or without a range are left out.

    Example:
        >>> qdq.calibrate(model, loader, method="entropy")
        >>> print(qdq.calibration_report(model))        # a Markdown table and its legend

    Raises:
        QdqConfigError: ``limit`` is not in (0, 1].
    """
    if isinstance(limit, bool) or not isinstance(limit, int | float) or math.isnan(limit) or not 0 < limit <= 1:
        raise QdqConfigError(f"limit must be a share of the energy in (0, 1], got {limit!r}.")
    rows = [diagnose(name, q) for name, q in named_quantizers(unwrap(model), weights=False)]
    return CalibrationReport([r for r in rows if r is not None], float(limit))


def warn_clipping(model: nn.Module, *, limit: float = CLIPPED_ENERGY_LIMIT, stacklevel: int = 2) -> CalibrationReport:
    """Emit one :class:`~qdq.errors.QdqCalibrationWarning` naming the quantizers of ``model`` that clip at
    least ``limit`` of their energy (on the main process only); return the report."""
    report = calibration_report(model, limit=limit)
    text = report.warning_text()
    if text is not None and is_main_process():
        warnings.warn(text, QdqCalibrationWarning, stacklevel=stacklevel + 1)
    return report

"""Activation histograms for the report, read from a calibrated model's histogram calibrators."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.app.report.inputs import LayerHistogram

if TYPE_CHECKING:
    import torch
    from torch import nn

    from qdq.workflow.post_training import PTQResult

__all__ = ["collect_histograms", "read_histogram"]


def read_histogram(calibrator: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``(counts, edges)`` of a :class:`~qdq.calib.HistogramCalibrator`, or ``None`` if it holds none.

    Uses the public ``bin_counts`` / ``bin_width`` properties; edges are in the data's units, from 0.
    A per-channel histogram is summed into one at the widest channel's bin width, re-binned with
    :func:`qdq.calib.binning.rebin` (channel ranges are powers of two apart, so this is exact).
    """
    counts, widths = getattr(calibrator, "bin_counts", None), getattr(calibrator, "bin_width", None)
    if counts is None or widths is None:
        return None
    merged, width = _merge_channels(counts.reshape(-1, counts.shape[-1]), widths.reshape(-1))
    return merged, np.arange(merged.size + 1, dtype=np.float64) * width


def _merge_channels(counts: torch.Tensor, widths: torch.Tensor) -> tuple[np.ndarray, float]:
    """Sum per-channel histograms (rows of int64 ``counts``) into one at the largest bin width."""
    import torch

    from qdq.calib import binning

    widths = widths.detach().to(torch.float64).cpu()
    widest = widths.max()
    # widths are 2**k / num_bins: their ratio is a power of two, the difference of their binary exponents
    shift = torch.frexp(widest).exponent - torch.frexp(widths).exponent
    merged = binning.rebin(counts.detach().cpu().to(torch.int64), shift.to(torch.int64)).sum(0)
    return merged.numpy(), float(widest)


def collect_histograms(
    model: nn.Module, ptq: PTQResult | None = None, *, max_layers: int | None = 8, include: Sequence[str] = ()
) -> dict[str, LayerHistogram]:
    """Activation histograms held by ``model``'s calibrators, with each PTQ method's amax.

    Call it after :func:`qdq.collect_stats` (or :func:`qdq.ptq`, which leaves the histograms in place)
    and before the calibrators are reset. Quantizers without a histogram are skipped. With more than
    ``max_layers`` of them, evenly spaced ones are kept (first and last included), plus those named in
    ``include`` (e.g. the worst of :func:`qdq.calibration_report`). A per-channel amax is shown as its
    largest channel.
    """
    from qdq.workflow.calibration import named_quantizers

    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, quantizer in named_quantizers(model, weights=False):
        histogram = read_histogram(quantizer.calibrator)
        if histogram is not None:
            found[name] = histogram
    names = _spread(list(found), max_layers)
    names += [name for name in include if name in found and name not in names]
    return {name: LayerHistogram(*found[name], _method_amax(ptq, name)) for name in names}


def _spread(names: list[str], count: int | None) -> list[str]:
    """At most ``count`` evenly spaced items of ``names`` (first and last kept), in order."""
    if count is None or len(names) <= count:
        return names
    if count <= 0:
        return []
    picks = np.unique(np.linspace(0, len(names) - 1, count).round().astype(int))
    return [names[i] for i in picks]


def _method_amax(ptq: PTQResult | None, name: str) -> dict[str, float]:
    """Amax of quantizer ``name`` for each PTQ method (largest channel if per channel)."""
    if ptq is None:
        return {}
    return {r.label: float(r.amax[name].detach().abs().max()) for r in ptq.results if name in r.amax}

"""merge(): 8 batches in one calibrator == 4 + 4 in two calibrators merged, bit for bit."""

from __future__ import annotations

import pytest
import torch

from qdq.calib import HistogramCalibrator, MaxCalibrator
from qdq.errors import QdqCalibrationError, QdqConfigError

# ranges spanning 10 orders of magnitude, an all-zero batch, and the largest batch in the middle
SCALES = [1e-3, 50.0, 0.0, 1.0, 1e4, 3.0, 1e-6, 7.0]
LAYOUTS = {"per-tensor": ((6, 5, 4), None), "axis1": ((6, 5, 4), 1), "axis0,2": ((3, 5, 4), (0, 2))}
BINS = {"per-tensor": 2048, "axis1": 512, "axis0,2": 256}  # fewer bins where there are many channels


def batches(shape):
    out = [torch.randn(shape) * s for s in SCALES]
    out[3][0] = 0  # some exact zeros for skip_zeros
    return out


def fill(cal, tensors):
    for t in tensors:
        cal.collect(t)
    return cal


def assert_same_histogram(a, b):
    assert torch.equal(a.bin_counts, b.bin_counts)
    assert torch.equal(a.bin_width, b.bin_width)
    for method in HistogramCalibrator.methods:
        assert torch.equal(a.compute_amax(method, start_bin=32), b.compute_amax(method, start_bin=32)), method


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("kwargs", [{}, {"unsigned": True}, {"skip_zeros": True, "num_bits": 4}], ids=str)
def test_histogram_merge_equals_one_calibrator(layout, kwargs):
    shape, axis = LAYOUTS[layout]
    kwargs = {"num_bins": BINS[layout], **kwargs}
    data = batches(shape)
    whole = fill(HistogramCalibrator(axis=axis, **kwargs), data)
    first = fill(HistogramCalibrator(axis=axis, **kwargs), data[:4])
    second = fill(HistogramCalibrator(axis=axis, **kwargs), data[4:])
    first.merge(second)
    assert_same_histogram(first, whole)


def test_histogram_merge_order_and_split_do_not_matter():
    data = batches((6, 5, 4))

    def new():
        return HistogramCalibrator(axis=1, num_bins=512)

    whole = fill(new(), data)
    assert_same_histogram(whole, fill(new(), data[::-1]))
    parts = [fill(new(), data[i::3]) for i in range(3)]
    merged = new()  # merging into an empty calibrator copies
    for p in reversed(parts):
        merged.merge(p)
    assert_same_histogram(merged, whole)
    parts[0].merge(new())  # merging an empty one is a no-op
    assert_same_histogram(parts[0], fill(new(), data[0::3]))


def test_merge_does_not_alias_the_other_state():
    a, b = HistogramCalibrator(), fill(HistogramCalibrator(), [torch.rand(10)])
    a.merge(b)
    b.collect(torch.rand(10) * 100)
    assert int(a.bin_counts.sum()) == 10


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_max_merge_equals_one_calibrator(layout):
    shape, axis = LAYOUTS[layout]
    data = batches(shape)
    whole = fill(MaxCalibrator(axis=axis, track_amax=True), data)
    first = fill(MaxCalibrator(axis=axis, track_amax=True), data[:4])
    second = fill(MaxCalibrator(axis=axis, track_amax=True), data[4:])
    first.merge(second)
    assert torch.equal(first.compute_amax(), whole.compute_amax())
    assert all(torch.equal(x, y) for x, y in zip(first.amaxs, whole.amaxs, strict=True))


@pytest.mark.parametrize(
    "other",
    [
        MaxCalibrator(),
        HistogramCalibrator(num_bins=1024),
        HistogramCalibrator(unsigned=True),
        HistogramCalibrator(skip_zeros=True),
        HistogramCalibrator(num_bits=4),
        HistogramCalibrator(axis=0),
    ],
    ids=["class", "num_bins", "unsigned", "skip_zeros", "num_bits", "axis"],
)
def test_merge_incompatible_raises(other):
    with pytest.raises(QdqConfigError, match="cannot merge"):
        HistogramCalibrator().merge(other)


def test_merge_default_method_may_differ():
    a = fill(HistogramCalibrator(method="mse"), [torch.rand(10)])
    a.merge(fill(HistogramCalibrator(method="percentile"), [torch.rand(10)]))
    assert int(a.bin_counts.sum()) == 20


def test_merge_into_itself_raises():
    cal = HistogramCalibrator()
    with pytest.raises(QdqConfigError, match="itself"):
        cal.merge(cal)


@pytest.mark.parametrize("cls", [MaxCalibrator, HistogramCalibrator])
def test_merge_different_channel_shapes_raises(cls):
    a, b = fill(cls(axis=0), [torch.rand(3, 2)]), fill(cls(axis=0), [torch.rand(4, 2)])
    with pytest.raises(QdqCalibrationError, match="different channel shapes"):
        a.merge(b)

"""MaxCalibrator: the seed's targets, layouts, track_amax, method handling and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qdq.calib import MaxCalibrator
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError


def collected(*tensors, **kwargs):
    cal = MaxCalibrator(**kwargs)
    for t in tensors:
        cal.collect(t)
    return cal


def test_per_tensor_max_of_two_batches():
    x1, x2 = torch.rand(129), torch.rand(127)
    amax = collected(x1, x2).compute_amax()
    assert amax.shape == () and amax.dtype == torch.float32
    assert float(amax) == max(x1.numpy().max(), x2.numpy().max())


def test_signed_uses_magnitudes():
    assert float(collected(torch.tensor([-9.0, 2.0, 3.0])).compute_amax()) == 9.0


def test_unsigned_ignores_negatives():
    assert float(collected(torch.tensor([-9.0, 2.0, 3.0]), unsigned=True).compute_amax()) == 3.0
    assert float(collected(torch.tensor([-9.0, -2.0]), unsigned=True).compute_amax()) == 0.0


def test_per_channel_two_batches_equals_numpy():
    x1, x2 = torch.randn(31, 63, 7, 7), torch.randn(31, 63, 7, 7)
    amax = collected(x1, x2, axis=0).compute_amax()
    expected = np.maximum(np.abs(x1.numpy()), np.abs(x2.numpy())).max(axis=(1, 2, 3), keepdims=True)
    assert amax.shape == (31, 1, 1, 1)
    np.testing.assert_array_equal(amax.numpy(), expected)


@pytest.mark.parametrize(
    "axis, shape",
    [(0, (5, 1, 1, 1)), (-4, (5, 1, 1, 1)), (1, (1, 6, 1, 1)), ((0, 1), (5, 6, 1, 1)), ((-1, 1), (1, 6, 1, 4))],
)
def test_axis_layouts(axis, shape):
    x = torch.randn(5, 6, 3, 4)
    amax = collected(x, axis=axis).compute_amax()
    assert amax.shape == shape
    keep = {a % 4 for a in ((axis,) if isinstance(axis, int) else axis)}
    reduce_dims = tuple(d for d in range(4) if d not in keep)
    np.testing.assert_array_equal(amax.numpy(), np.abs(x.numpy()).max(axis=reduce_dims, keepdims=True))


def test_seed_axis_0_1_numel():
    assert collected(torch.rand(127, 63, 7, 7), axis=(0, 1)).compute_amax().numel() == 127 * 63


def test_reset():
    cal = collected(torch.rand(4, 3), axis=0)
    cal.reset()
    assert cal.compute_amax() is None and not cal.has_data
    cal.collect(torch.rand(2, 3))
    assert cal.compute_amax().shape == (2, 1)


def test_shape_change_raises():
    cal = collected(torch.rand(32, 63, 7, 7), axis=0)
    with pytest.raises(QdqCalibrationError, match="shape changed"):
        cal.collect(torch.rand(33, 63, 7, 7))


def test_track_amax():
    x1, x2 = torch.rand(129), torch.rand(127)
    cal = collected(x1, x2, track_amax=True)
    assert [float(a) for a in cal.amaxs] == [float(x1.max()), float(x2.max())]
    assert collected(x1).amaxs == []  # off by default


def test_compute_amax_methods():
    cal = collected(torch.rand(10))
    assert torch.equal(cal.compute_amax("max"), cal.compute_amax())
    with pytest.raises(QdqConfigError, match="cannot compute amax with method 'entropy'"):
        cal.compute_amax("entropy")
    with pytest.raises(QdqTypeError, match="no options"):
        cal.compute_amax(percentile=99.9)
    assert MaxCalibrator().compute_amax() is None


def test_result_is_a_copy():
    cal = collected(torch.tensor([1.0, 2.0]))
    cal.compute_amax().fill_(100.0)
    assert float(cal.compute_amax()) == 2.0


@pytest.mark.parametrize(
    "num_bits, error",
    [(0, QdqConfigError), (1, QdqConfigError), (17, QdqConfigError), (8.0, QdqTypeError), (True, QdqTypeError),
     ((4, 3), QdqTypeError)],
)  # fmt: skip
def test_bad_num_bits(num_bits, error):
    with pytest.raises(error, match="num_bits"):
        MaxCalibrator(num_bits=num_bits)


@pytest.mark.parametrize(
    "axis, error, match",
    [((0, 0), QdqConfigError, "repeats"), ("0", QdqTypeError, "axis"), ((0, 1.0), QdqTypeError, "axis")],
)
def test_bad_axis(axis, error, match):
    with pytest.raises(error, match=match):
        MaxCalibrator(axis=axis)


def test_empty_axis_is_per_tensor_like_the_descriptor():
    assert MaxCalibrator(axis=()).axis is None
    assert collected(torch.tensor([[1.0, -5.0], [2.0, 0.0]]), axis=()).compute_amax().shape == ()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("unsigned", [False, True])
def test_non_finite_raises_when_used(bad, unsigned):
    x = torch.rand(3, 3)
    x[0, 0] = bad
    cal = MaxCalibrator(axis=1, unsigned=unsigned)
    cal.collect(x)
    with pytest.raises(QdqCalibrationError, match=r"NaN or Inf values \(batch 1 of 1\)"):
        cal.compute_amax()


def test_inputs():
    assert float(collected(torch.tensor([3, -4])).compute_amax()) == 4.0  # integer tensors are fine
    assert not collected(torch.empty(0)).has_data
    with pytest.raises(QdqTypeError, match="Tensor"):
        MaxCalibrator().collect(np.ones(3))


def test_repr():
    assert repr(collected(torch.rand(2, 3), axis=0)) == (
        "MaxCalibrator(num_bits=8, axis=(0,), unsigned=False, channels=(2, 1))"
    )

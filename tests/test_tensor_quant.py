"""Numerics: seed vectors, numpy oracle, gradients, dtypes, errors, and properties."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qdq import tensor_quant as tq
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.tensor_quant import fake_tensor_quant, quant_bounds, quant_step, tensor_quant
from reference import fake_quant_np, quant_np


def _seed_input():
    torch.manual_seed(12345)
    return torch.rand(10)


def test_seed_vector_tensor_quant():
    x = _seed_input()
    q, scale = tensor_quant(x, x.abs().max())
    assert q.tolist() == [126, 113, 127, 59, 11, 23, 47, 73, 43, 27]
    assert scale.item() == pytest.approx(128.0057, abs=1e-4)


def test_seed_vector_fake_quant():
    x = _seed_input()
    out = fake_tensor_quant(x, x.abs().max())
    expected = [0.9843, 0.8828, 0.9921, 0.4609, 0.0859, 0.1797, 0.3672, 0.5703, 0.3359, 0.2109]
    np.testing.assert_allclose(out.numpy(), expected, atol=5e-5)


def test_scale_is_multiplier_and_step_is_its_reciprocal():
    amax = torch.tensor(2.54)
    _, scale = tensor_quant(torch.zeros(3), amax)
    assert scale.item() == pytest.approx(127 / 2.54, rel=1e-6)
    assert quant_step(amax).item() == pytest.approx(2.54 / 127, rel=1e-6)


@pytest.mark.parametrize("num_bits", [2, 3, 4, 5, 7, 8, 11, 16])
@pytest.mark.parametrize(("unsigned", "narrow"), [(False, False), (False, True), (True, False)])
def test_matches_numpy_oracle_exactly(num_bits, unsigned, narrow):
    x = torch.randn(4099) * 3
    if unsigned:
        x = x.abs()
    amax = torch.tensor(2.5)  # clips part of the input
    q, _ = tensor_quant(x, amax, num_bits, unsigned, narrow)
    q_ref, _ = quant_np(x.numpy(), 2.5, num_bits, unsigned, narrow)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    out = fake_tensor_quant(x, amax, num_bits, unsigned, narrow)
    np.testing.assert_array_equal(out.numpy(), fake_quant_np(x.numpy(), 2.5, num_bits, unsigned, narrow))
    qmin, qmax = quant_bounds(num_bits, unsigned, narrow)
    assert q.max().item() == qmax  # 2.5 clips the tail, so the top code is reached
    assert q.min().item() == (qmin if not unsigned else q.min().item()) and q.min().item() >= qmin


def test_full_range_is_default_and_reaches_minus_128():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0])
    q, _ = tensor_quant(x, torch.tensor(1.0))
    assert q.tolist() == [-128, -127, 0, 127, 127]
    q_narrow, _ = tensor_quant(x, torch.tensor(1.0), narrow_range=True)
    assert q_narrow.tolist() == [-127, -127, 0, 127, 127]


def test_round_half_to_even():
    step = 0.5  # amax = 63.5 -> step 0.5; x = k + 0.5 steps lands exactly on ties
    amax = torch.tensor(step * 127)
    x = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75])  # /0.5 = 0.5, 1.5, 2.5, -0.5, -1.5
    q, _ = tensor_quant(x, amax)
    assert q.tolist() == [0, 2, 2, 0, -2]


def test_division_semantics_differ_from_reciprocal_multiplication_where_onnx_does():
    # x / step, like ONNX Runtime; torch's native kernel multiplies by 1/step and disagrees on rare ties.
    torch.manual_seed(0)
    x = torch.randn(2_000_000) * 3
    amax = torch.tensor(4.3)
    ours = fake_tensor_quant(x, amax)
    np.testing.assert_array_equal(ours.numpy(), fake_quant_np(x.numpy(), 4.3))


def test_per_channel_broadcast_matches_per_slice():
    x = torch.randn(6, 4, 3, 3)
    amax = x.abs().amax(dim=(1, 2, 3), keepdim=True) * 0.7
    out = fake_tensor_quant(x, amax)
    for c in range(6):
        np.testing.assert_array_equal(out[c].numpy(), fake_quant_np(x[c].numpy(), amax[c].item()))


def test_per_channel_axis_1():
    x = torch.randn(3, 4, 5, 6)
    amax = torch.tensor([0.8, 0.9, 0.7, 0.6]).view(1, 4, 1, 1)
    out = fake_tensor_quant(x, amax)
    for c in range(4):
        np.testing.assert_array_equal(out[:, c].numpy(), fake_quant_np(x[:, c].numpy(), amax.flatten()[c].item()))


def test_tiny_amax_gives_exact_zeros_per_channel():
    x = torch.randn(3, 8)
    amax = torch.tensor([[1.0], [1e-26], [2.0**-24]])
    out = fake_tensor_quant(x, amax)
    assert torch.count_nonzero(out[1:]) == 0
    assert torch.count_nonzero(out[0]) > 0
    q, scale = tensor_quant(x, amax)
    assert torch.count_nonzero(q[1:]) == 0
    assert scale[1].item() == 1.0


def test_gradient_is_straight_through_inside_range_inclusive():
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], requires_grad=True)
    upstream = torch.arange(1.0, 8.0)
    fake_tensor_quant(x, torch.tensor(1.0)).backward(upstream)
    assert x.grad.tolist() == [0, 2, 3, 4, 5, 6, 0]


def test_gradient_identity_when_all_inside():
    x = torch.randn(100, requires_grad=True)
    upstream = torch.randn(100)
    fake_tensor_quant(x, x.detach().abs().max()).backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_gradient_mask_per_channel():
    x = torch.randn(4, 10, requires_grad=True)
    amax = x.detach().abs().amax(dim=1, keepdim=True) / 2
    fake_tensor_quant(x, amax).sum().backward()
    assert torch.equal(x.grad.bool(), (x.detach().abs() <= amax))


def test_tensor_quant_gradient_passes_through_q():
    x = torch.randn(50, requires_grad=True)
    q, _ = tensor_quant(x, torch.tensor(1.0))
    q.sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 1.0).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_computed_in_fp32(dtype):
    x = torch.randn(1000).to(dtype)
    out = fake_tensor_quant(x, torch.tensor(1.5))
    assert out.dtype == dtype
    expected = torch.from_numpy(fake_quant_np(x.float().numpy(), 1.5)).to(dtype)
    assert torch.equal(out, expected)


def test_fp16_tiny_amax_gives_no_inf_or_nan():
    x = torch.randn(100).half()
    out = fake_tensor_quant(x, torch.tensor(1e-4))
    assert torch.isfinite(out).all()


def test_output_dtype_and_shape_preserved_float64():
    x = torch.randn(2, 3, dtype=torch.float64)
    out = fake_tensor_quant(x, 1.0)
    assert out.dtype == torch.float64 and out.shape == x.shape


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("amax", "match"),
    [(-1.0, "non-negative"), (float("nan"), "NaN"), (torch.tensor([1.0, -0.1]).view(2, 1), "non-negative")],
)
def test_bad_amax_values(amax, match):
    with pytest.raises(QdqConfigError, match=match):
        fake_tensor_quant(torch.randn(2, 3), amax)


def test_wrong_amax_shape():
    with pytest.raises(QdqConfigError, match="does not broadcast"):
        fake_tensor_quant(torch.randn(4, 3), torch.ones(3, 1))
    with pytest.raises(QdqConfigError, match="more dimensions"):
        fake_tensor_quant(torch.randn(4), torch.ones(4, 1))


def test_unsigned_negative_input_saturates_to_zero_like_onnx_uint8():
    # QuantizeLinear to uint8 saturates below 0; amax 255 gives step 1, and ties round to even.
    q, _ = tensor_quant(torch.tensor([-0.1, -3.0, 127.5, 126.5]), 255.0, unsigned=True)
    assert q.tolist() == [0.0, 0.0, 128.0, 126.0]
    x = torch.tensor([-0.1, 0.5], requires_grad=True)
    fake_tensor_quant(x, 1.0, unsigned=True).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0]  # no gradient below the unsigned range


@pytest.mark.parametrize("num_bits", [0, 1, 17, 32])
def test_unsupported_num_bits(num_bits):
    with pytest.raises(QdqConfigError, match="not supported"):
        fake_tensor_quant(torch.randn(3), 1.0, num_bits=num_bits)


@pytest.mark.parametrize("num_bits", [(4, 3), 8.0, True])
def test_num_bits_type(num_bits):
    with pytest.raises(QdqTypeError, match="num_bits must be an int"):
        fake_tensor_quant(torch.randn(3), 1.0, num_bits=num_bits)


def test_integer_input_rejected():
    with pytest.raises(QdqTypeError, match="floating-point"):
        fake_tensor_quant(torch.arange(3), 1.0)


# ------------------------------------------------------------------------------------- properties
_floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)
_amaxes = st.floats(1e-3, 1e3).map(lambda v: float(np.float32(v)))


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(_floats, min_size=1, max_size=64),
    amax=_amaxes,
    num_bits=st.integers(2, 16),
    narrow=st.booleans(),
)
def test_property_bounds_grid_and_idempotence(values, amax, num_bits, narrow):
    x = torch.tensor(values)
    out = fake_tensor_quant(x, amax, num_bits, narrow_range=narrow)
    qmin, qmax = quant_bounds(num_bits, False, narrow)
    step = quant_step(amax, num_bits)
    assert (out >= qmin * step).all() and (out <= qmax * step).all()
    # Values sit on the grid: q * step for integers q.
    q, _ = tensor_quant(x, amax, num_bits, narrow_range=narrow)
    assert torch.equal(out, q * step)
    # Fake quant is idempotent.
    assert torch.equal(fake_tensor_quant(out, amax, num_bits, narrow_range=narrow), out)
    # Error inside the range is at most half a step.
    inside = x.abs() <= amax
    assert ((out - x)[inside].abs() <= step / 2 * (1 + 1e-6)).all()


@settings(max_examples=40, deadline=None)
@given(values=st.lists(_floats, min_size=1, max_size=64), amax=_amaxes)
def test_property_ste_mask(values, amax):
    x = torch.tensor(values, requires_grad=True)
    fake_tensor_quant(x, amax).sum().backward()
    amax32 = torch.tensor(amax, dtype=torch.float32)
    assert torch.equal(x.grad.bool(), x.detach().abs() <= amax32)


@settings(max_examples=30, deadline=None)
@given(
    channels=st.integers(1, 5),
    width=st.integers(1, 7),
    scales=st.lists(_amaxes, min_size=5, max_size=5),
)
def test_property_per_channel_equals_per_tensor_slices(channels, width, scales):
    x = torch.randn(channels, width) * 4
    amax = torch.tensor(scales[:channels]).view(channels, 1)
    out = fake_tensor_quant(x, amax)
    for c in range(channels):
        assert torch.equal(out[c], fake_tensor_quant(x[c], amax[c, 0]))


@settings(max_examples=30, deadline=None)
@given(values=st.lists(_floats, min_size=1, max_size=32), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_property_dtype_roundtrip(values, dtype):
    x = torch.tensor(values).to(dtype)
    out = fake_tensor_quant(x, 100.0)
    assert out.dtype == dtype
    assert torch.equal(out, fake_tensor_quant(x.float(), 100.0).to(dtype))


def test_max_bound_values():
    assert tq.max_bound(8) == 127 and tq.max_bound(8, unsigned=True) == 255 and tq.max_bound(4) == 7


def test_low_precision_amax_gives_steps_of_that_type():
    """Its step is a number of the type, nearest to amax's step; 127 * step is exact in float32."""
    from qdq.tensor_quant import low_precision_amax, quant_step

    amax = torch.tensor([2.0, 0.37, 0.05, 123.4, 1e-3, 1e-6, 0.0])  # 1e-3: subnormal step, 1e-6: step rounds to 0
    for dtype, rel in ((torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)):
        exact = low_precision_amax(amax, dtype)
        step = quant_step(exact)
        assert torch.equal(step[:5], step[:5].to(dtype).float())  # the step is a number of the low type
        expected = (amax.numpy() / np.float32(127)).astype(np.float16 if dtype == torch.float16 else np.float32)
        if dtype == torch.float16:
            np.testing.assert_array_equal(step[:5].numpy(), expected[:5].astype(np.float32))
        assert torch.all((exact - amax).abs()[:4] <= rel * amax[:4])  # half an ulp of a normal step
    assert low_precision_amax(amax, torch.float16)[5:].tolist() == [0.0, 0.0]  # zeros, as amax <= 2**-24

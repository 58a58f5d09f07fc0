"""TensorQuantizer: modes, amax handling, learned ranges, pre_quant_scale, state_dict, errors."""

import numpy as np
import pytest
import torch

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError
from qdq.quantizer import TensorQuantizer
from qdq.tensor_quant import fake_tensor_quant, tensor_quant
from reference import fake_quant_np, quant_np


def test_default_is_dynamic_per_tensor_fake_quant():
    x = torch.randn(8, 16)
    quantizer = TensorQuantizer()
    assert quantizer.amax is None
    assert torch.equal(quantizer(x), fake_tensor_quant(x, x.abs().max()))


def test_real_quant_returns_integers_and_scale():
    x = torch.randn(32)
    quantizer = TensorQuantizer(QuantDescriptor(fake_quant=False))
    q = quantizer(x)
    q_ref, scale_ref = tensor_quant(x, x.abs().max())
    assert torch.equal(q, q_ref) and torch.equal(quantizer.scale, scale_ref)


def test_per_channel_dynamic_with_scale_amax():
    x = torch.randn(6, 5, 3, 3)
    quantizer = TensorQuantizer(QuantDescriptor(axis=0, scale_amax=0.7))
    amax = x.abs().amax(dim=(1, 2, 3), keepdim=True).numpy() * np.float32(0.7)
    np.testing.assert_array_equal(quantizer(x).numpy(), fake_quant_np(x.numpy(), amax))


def test_per_channel_dynamic_non_leading_axis():
    x = torch.randn(4, 3, 5)
    quantizer = TensorQuantizer(QuantDescriptor(axis=1))
    amax = x.abs().amax(dim=(0, 2), keepdim=True)
    np.testing.assert_array_equal(quantizer(x).numpy(), fake_quant_np(x.numpy(), amax.numpy()))


def test_static_amax_and_step_size():
    quantizer = TensorQuantizer()
    quantizer.amax = 0.577
    assert quantizer.step_size.item() == pytest.approx(0.577 / 127)
    x = torch.randn(100)
    np.testing.assert_array_equal(quantizer(x).numpy(), fake_quant_np(x.numpy(), 0.577))


def test_one_dimensional_per_channel_amax_aligns_with_axis():
    quantizer = TensorQuantizer(QuantDescriptor(axis=0))
    quantizer.amax = [0.5, 1.0, 2.0]
    x = torch.randn(3, 4, 2)
    expected = fake_quant_np(x.numpy(), np.array([0.5, 1.0, 2.0], dtype=np.float32).reshape(3, 1, 1))
    np.testing.assert_array_equal(quantizer(x).numpy(), expected)


def test_descriptor_amax_is_loaded():
    quantizer = TensorQuantizer(QuantDescriptor(amax=2.0))
    assert quantizer.amax.item() == 2.0


def test_disable_is_identity_and_quant_off_is_identity():
    x = torch.randn(10)
    quantizer = TensorQuantizer()
    quantizer.disable()
    assert quantizer(x) is x
    quantizer.enable()
    quantizer.disable_quant()
    assert torch.equal(quantizer(x), x)
    quantizer.enable_quant()
    assert not torch.equal(quantizer(x), x)


def test_pre_quant_scale_vectors():
    # Seed vectors: amax 127 (step 1) on axis 1.
    x = torch.tensor([0.0, 0.4, 1.1, 2.0]).view(1, 4)
    quantizer = TensorQuantizer(QuantDescriptor(amax=127.0, axis=None))
    assert quantizer(x).flatten().tolist() == [0, 0, 1, 2]
    quantizer.pre_quant_scale = 2.0
    assert quantizer(x).flatten().tolist() == [0, 1, 2, 4]
    quantizer.pre_quant_scale = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4)
    assert quantizer(x).flatten().tolist() == [0, 1, 3, 8]


def test_learn_amax_equals_fake_quant_and_learns():
    quantizer = TensorQuantizer(QuantDescriptor(learn_amax=True, amax=0.5))
    x = torch.randn(200, requires_grad=True)
    out = quantizer(x)
    expected = fake_quant_np(np.clip(x.detach().numpy(), -0.5, 0.5), 0.5)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=0, atol=1e-7)
    out.sum().backward()
    grad_max = quantizer.clip.clip_value_max.grad.item()
    assert grad_max == pytest.approx(float((x.detach() >= 0.5).sum()))


def test_clip_only_mode():
    quantizer = TensorQuantizer(QuantDescriptor(learn_amax=True, amax=0.5))
    quantizer.disable_quant()
    x = torch.randn(50)
    np.testing.assert_array_equal(quantizer(x).detach().numpy(), np.clip(x.numpy(), -0.5, 0.5))


def test_init_learn_amax_copies_amax():
    quantizer = TensorQuantizer(QuantDescriptor(learn_amax=True))
    quantizer.amax = 3.0
    quantizer.init_learn_amax()
    assert quantizer.clip.clip_value_max.item() == 3.0 and quantizer.clip.clip_value_min.item() == -3.0


def test_enable_clip_needs_learn_amax():
    with pytest.raises(QdqConfigError, match="learn_amax"):
        TensorQuantizer().enable_clip()


def test_scale_amax_is_stable_over_calls():
    quantizer = TensorQuantizer(QuantDescriptor(amax=0.5, scale_amax=0.9))
    x = torch.randn(100)
    first, second = quantizer(x), quantizer(x)
    assert torch.equal(first, second)
    np.testing.assert_array_equal(first.numpy(), fake_quant_np(x.numpy(), np.float32(0.5) * np.float32(0.9)))


def test_state_dict_round_trip_per_channel():
    source = TensorQuantizer(QuantDescriptor(axis=0))
    source.amax = torch.tensor([3.142, 2.718]).view(2, 1)
    target = TensorQuantizer(QuantDescriptor(axis=0))
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.amax, source.amax)


def test_state_dict_keys_stable_and_seed_checkpoint_without_amax_loads():
    quantizer = TensorQuantizer()
    assert set(quantizer.state_dict()) == {"_amax", "_pre_quant_scale"}
    result = quantizer.load_state_dict({}, strict=True)
    assert not result.missing_keys


def test_state_dict_loads_onto_module_device_and_rejects_bad_values():
    quantizer = TensorQuantizer()
    quantizer.load_state_dict({"_amax": torch.tensor(1.5, dtype=torch.float64)})
    assert quantizer.amax.dtype == torch.float32 and quantizer.amax.device.type == "cpu"
    with pytest.raises(QdqConfigError, match="non-negative"):
        quantizer.load_state_dict({"_amax": torch.tensor(-1.0)})


def test_buffers_follow_module_dtype_conversions_to_device():
    quantizer = TensorQuantizer(QuantDescriptor(amax=1.0))
    moved = quantizer.to("meta")
    assert moved.amax.device.type == "meta"


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(-1.0, QdqConfigError, "non-negative"), (float("nan"), QdqConfigError, "NaN"), ("x", QdqTypeError, "number")],
)
def test_amax_setter_errors(value, error, match):
    with pytest.raises(error, match=match):
        TensorQuantizer().amax = value


def test_step_size_needs_static_amax():
    with pytest.raises(QdqCalibrationError, match="dynamic"):
        _ = TensorQuantizer().step_size


def test_unsigned_quantizer_saturates_negative_input_at_zero():
    quantizer = TensorQuantizer(QuantDescriptor(unsigned=True, amax=255.0))  # step 1
    assert quantizer(torch.tensor([-1.0, 1.0, 2.5])).tolist() == [0.0, 1.0, 2.0]
    quantizer = TensorQuantizer(QuantDescriptor(unsigned=True))
    x = torch.rand(64)
    q, _ = quant_np(x.numpy(), x.max().item(), unsigned=True)
    assert quantizer(x).max().item() == pytest.approx(x.max().item())
    assert q.max() == 255


def test_extra_repr():
    quantizer = TensorQuantizer(QuantDescriptor(axis=0))
    assert "dynamic" in repr(quantizer)
    quantizer.amax = torch.tensor([0.0, 0.7817]).view(2, 1)
    text = repr(quantizer)
    assert "axis=0" in text and "[0.0000, 0.7817](2)" in text and "quant" in text
    quantizer.disable()
    assert "disabled" in repr(quantizer)


def test_fp16_input_with_fp32_amax():
    quantizer = TensorQuantizer(QuantDescriptor(amax=1.0))
    x = torch.randn(64).half()
    out = quantizer(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, torch.from_numpy(fake_quant_np(x.float().numpy(), 1.0)).half())

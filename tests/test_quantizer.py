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


# --------------------------------------------------------------------- float16 / bfloat16 steps (TensorRT 11)
def _oracle_low_steps(x: np.ndarray, amax: np.ndarray, kind) -> np.ndarray:
    """numpy: quantize with the step ``amax / 127`` rounded to ``kind`` (what a float16 Q/DQ scale holds)."""
    step = (np.asarray(amax, np.float32) / np.float32(127)).astype(kind).astype(np.float32)
    return (np.clip(np.rint(np.divide(x, step, dtype=np.float32)), -128, 127) * step).astype(np.float32)


@pytest.mark.parametrize("step_type", ["float16", "bfloat16"])
def test_low_precision_steps_quantize_on_the_low_precision_grid(step_type):
    import ml_dtypes

    kind = np.float16 if step_type == "float16" else ml_dtypes.bfloat16
    x = torch.randn(6, 5, 3, 3) * 3
    amax = x.abs().amax(dim=(1, 2, 3), keepdim=True)
    quantizer = TensorQuantizer(QuantDescriptor(axis=0), role="weight")
    quantizer.amax = amax
    assert quantizer.step_type == "float32" and torch.equal(quantizer.amax, amax)
    quantizer.step_type = step_type  # rounds the stored range
    step = quantizer.step().numpy()
    np.testing.assert_array_equal(step, (amax.numpy() / np.float32(127)).astype(kind).astype(np.float32))
    np.testing.assert_array_equal(quantizer(x).numpy(), _oracle_low_steps(x.numpy(), amax.numpy(), kind))
    quantizer.amax = amax  # set again (calibration, load_amax): rounded again
    np.testing.assert_array_equal(quantizer.step().numpy(), step)
    assert f"{step_type}_steps" in repr(quantizer)


def test_low_precision_steps_reach_loaded_learned_scaled_and_dynamic_ranges():
    x = torch.randn(64) * 2
    amax = torch.tensor(1.2345)
    step16 = lambda a: np.float32(np.float16(np.float32(a) / np.float32(127)))  # noqa: E731

    loaded = TensorQuantizer()
    loaded.step_type = "float16"
    loaded.load_state_dict({"_amax": amax, "_pre_quant_scale": torch.empty(0)})
    assert float(loaded.step()) == step16(1.2345)

    learned = TensorQuantizer(QuantDescriptor(learn_amax=True, amax=1.2345))
    learned.step_type = "float16"
    assert float(learned.step()) == step16(1.2345)
    np.testing.assert_array_equal(learned(x).detach().numpy(), _oracle_low_steps(np.clip(x.numpy(), -1.2345,
                                  1.2345), np.float32(1.2345), np.float16))  # fmt: skip

    scaled = TensorQuantizer(QuantDescriptor(scale_amax=0.7))
    scaled.step_type = "float16"
    scaled.amax = amax
    assert float(scaled.step()) == step16(np.float32(scaled.amax) * np.float32(0.7))

    dynamic = TensorQuantizer()
    dynamic.step_type = "float16"
    np.testing.assert_array_equal(dynamic(x).numpy(), _oracle_low_steps(x.numpy(), x.abs().max().numpy(), np.float16))


def test_low_precision_steps_at_the_ends_of_float16():
    """A step below float16's smallest subnormal quantizes to zeros; one beyond its largest value is kept."""
    quantizer = TensorQuantizer(QuantDescriptor(axis=0))
    quantizer.step_type = "float16"
    quantizer.amax = torch.tensor([1e-6, 0.5, 2e7]).view(3, 1)
    assert quantizer.amax[0] == 0 and quantizer.amax[2] == 2e7
    x = torch.tensor([[5e-7], [0.3], [1e7]])
    assert quantizer(x)[0] == 0 and quantizer(x)[2] == fake_tensor_quant(x[2], torch.tensor(2e7))
    with pytest.raises(QdqConfigError, match="step_type is one of"):
        quantizer.step_type = "fp8"


def test_float32_steps_are_unchanged_by_default():
    x = torch.randn(100)
    quantizer = TensorQuantizer()
    quantizer.amax = torch.tensor(1.2345)
    assert quantizer.step_type == "float32" and float(quantizer.amax) == np.float32(1.2345)
    np.testing.assert_array_equal(quantizer(x).numpy(), fake_quant_np(x.numpy(), np.float32(1.2345)))

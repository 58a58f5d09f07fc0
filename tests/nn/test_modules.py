"""Quantized modules equal functional fake quant + the torch op, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qdq import nn as quant_nn
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.tensor_quant import fake_tensor_quant


def _fq_weight(weight, axis=0):
    dims = tuple(d for d in range(weight.dim()) if d != axis)
    return fake_tensor_quant(weight, weight.abs().amax(dim=dims, keepdim=True))


def _fq_input(x):
    return fake_tensor_quant(x, x.abs().max())


@pytest.mark.parametrize(
    ("cls", "functional", "shape"),
    [
        (quant_nn.QuantConv1d, F.conv1d, (2, 4, 11)),
        (quant_nn.QuantConv2d, F.conv2d, (2, 4, 9, 9)),
        (quant_nn.QuantConv3d, F.conv3d, (1, 4, 5, 6, 5)),
    ],
)
def test_conv_bit_identical(cls, functional, shape):
    module = cls(4, 6, 3, bias=True)
    x = torch.randn(shape)
    expected = functional(_fq_input(x), _fq_weight(module.weight), module.bias)
    assert torch.equal(module(x), expected)


def test_conv_per_tensor_weight():
    module = quant_nn.QuantConv2d(3, 5, 3, quant_desc_weight=QuantDescriptor())
    x = torch.randn(2, 3, 8, 8)
    w = module.weight
    assert torch.equal(module(x), F.conv2d(_fq_input(x), fake_tensor_quant(w, w.abs().max()), module.bias))


@pytest.mark.parametrize(
    ("cls", "functional", "shape"),
    [
        (quant_nn.QuantConvTranspose1d, F.conv_transpose1d, (2, 4, 7)),
        (quant_nn.QuantConvTranspose2d, F.conv_transpose2d, (2, 4, 5, 5)),
        (quant_nn.QuantConvTranspose3d, F.conv_transpose3d, (1, 4, 3, 4, 3)),
    ],
)
def test_conv_transpose_per_input_channel_axis0(cls, functional, shape):
    module = cls(4, 6, 3, stride=2)
    x = torch.randn(shape)
    # Weight is (in=4, out=6, k...): TensorRT needs one scale per input channel, axis 0.
    expected = functional(_fq_input(x), _fq_weight(module.weight, axis=0), module.bias, stride=2)
    assert torch.equal(module(x), expected)
    assert module.weight_quantizer.axis == (0,)


def test_conv_transpose_output_size_and_groups():
    module = quant_nn.QuantConvTranspose2d(4, 6, 3, stride=2, groups=2)
    out = module(torch.randn(1, 4, 5, 5), output_size=[12, 12])
    assert out.shape == (1, 6, 12, 12)


def test_conv_transpose_rejects_non_zero_padding_mode():
    with pytest.raises(ValueError, match="zeros"):
        nn_module = quant_nn.QuantConvTranspose2d(2, 2, 3)
        nn_module.padding_mode = "reflect"
        nn_module(torch.randn(1, 2, 4, 4))


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_conv_padding_modes_and_same(padding_mode):
    module = quant_nn.QuantConv2d(3, 4, 3, padding="same", padding_mode=padding_mode)
    reference = nn.Conv2d(3, 4, 3, padding="same", padding_mode=padding_mode)
    reference.load_state_dict({k: v for k, v in module.state_dict().items() if "quantizer" not in k})
    module.input_quantizer.disable()
    module.weight_quantizer.disable()
    x = torch.randn(1, 3, 7, 7)
    assert torch.equal(module(x), reference(x))


def test_device_and_dtype_arguments():
    module = quant_nn.QuantConv2d(3, 4, 3, device="cpu", dtype=torch.float64)
    assert module.weight.dtype == torch.float64
    assert module(torch.randn(1, 3, 5, 5, dtype=torch.float64)).dtype == torch.float64


def test_linear_bit_identical_and_default_axis():
    module = quant_nn.QuantLinear(16, 8)
    x = torch.randn(4, 16)
    assert torch.equal(module(x), F.linear(_fq_input(x), _fq_weight(module.weight), module.bias))
    assert module.weight_quantizer.axis == (0,)


def test_16_bit_close_to_float():
    desc = QuantDescriptor(num_bits=16)
    module = quant_nn.QuantLinear(32, 8, quant_desc_input=desc, quant_desc_weight=desc.replace(axis=0))
    x = torch.randn(4, 32)
    out, ref = module(x), F.linear(x, module.weight, module.bias)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1.5e-4)
    assert not torch.equal(out, ref)


@pytest.mark.parametrize(
    ("cls", "float_cls", "kwargs", "shape"),
    [
        (quant_nn.QuantMaxPool2d, nn.MaxPool2d, {"kernel_size": 2}, (2, 3, 8, 8)),
        (quant_nn.QuantAvgPool1d, nn.AvgPool1d, {"kernel_size": 2}, (2, 3, 8)),
        (quant_nn.QuantAvgPool2d, nn.AvgPool2d, {"kernel_size": 2}, (2, 3, 8, 8)),
        (quant_nn.QuantAvgPool3d, nn.AvgPool3d, {"kernel_size": 2}, (1, 2, 4, 4, 4)),
        (quant_nn.QuantAdaptiveAvgPool2d, nn.AdaptiveAvgPool2d, {"output_size": 1}, (2, 3, 8, 8)),
        (quant_nn.QuantInstanceNorm2d, nn.InstanceNorm2d, {"num_features": 3}, (2, 3, 8, 8)),
    ],
)
def test_input_only_modules(cls, float_cls, kwargs, shape):
    x = torch.randn(shape)
    module = cls(**kwargs)
    assert isinstance(module, float_cls)
    assert torch.equal(module(x), float_cls(**kwargs)(_fq_input(x)))


@pytest.mark.parametrize("num_bits", [2, 4, 6])
def test_pooling_variable_bits(num_bits):
    x = torch.randn(2, 3, 8, 8)
    module = quant_nn.QuantAvgPool2d(2, quant_desc_input=QuantDescriptor(num_bits=num_bits))
    assert torch.equal(module(x), F.avg_pool2d(fake_tensor_quant(x, x.abs().max(), num_bits), 2))


def test_instance_norm_per_channel_input():
    desc = QuantDescriptor(axis=1)
    module = quant_nn.QuantInstanceNorm2d(3, quant_desc_input=desc)
    x = torch.randn(2, 3, 5, 5)
    amax = x.abs().amax(dim=(0, 2, 3), keepdim=True)
    assert torch.equal(module(x), F.instance_norm(fake_tensor_quant(x, amax)))


def test_elementwise_modules():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    add = quant_nn.QuantAdd(quantize=(False, True))
    assert torch.equal(add(a, b), a + _fq_input(b))
    cat = quant_nn.QuantConcat(dim=1)
    shared = torch.maximum(a.abs().max(), b.abs().max())
    assert torch.equal(cat([a, b]), torch.cat([fake_tensor_quant(a, shared), fake_tensor_quant(b, shared)], 1))
    mm = quant_nn.QuantMatMul()
    m1, m2 = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(mm(m1, m2), _fq_input(m1) @ _fq_input(m2))


def test_per_class_default_descriptors_are_independent():
    original = quant_nn.QuantConv2d.default_quant_desc_input
    try:
        quant_nn.QuantConv2d.set_default_quant_desc_input(QuantDescriptor(num_bits=4))
        assert quant_nn.QuantConv2d(2, 2, 1).input_quantizer.num_bits == 4
        assert quant_nn.QuantConv3d(2, 2, 1).input_quantizer.num_bits == 8
        assert quant_nn.QuantConv1d.default_quant_desc_input.num_bits == 8
    finally:
        quant_nn.QuantConv2d.default_quant_desc_input = original


def test_from_float_shares_parameters_and_keeps_original_intact():
    conv = nn.Conv2d(3, 4, 3)
    quant = quant_nn.QuantConv2d.from_float(conv)
    assert quant.weight is conv.weight and quant.bias is conv.bias
    assert not hasattr(conv, "_input_quantizer") and "_input_quantizer" not in conv._modules
    with pytest.raises(QdqTypeError, match="converts a Conv2d"):
        quant_nn.QuantConv2d.from_float(nn.Conv1d(1, 1, 1))


def test_unused_kwargs_and_real_quant_rejected():
    with pytest.raises(TypeError):
        quant_nn.QuantConv2d(3, 4, 3, foo=1)
    with pytest.raises(QdqConfigError, match="Only fake quantization"):
        quant_nn.QuantLinear(2, 2, quant_desc_input=QuantDescriptor(fake_quant=False))
    with pytest.raises(TypeError):
        quant_nn.pop_quant_desc_in_kwargs(quant_nn.QuantConv2d, foo=1)


def test_seed_aliases():
    assert quant_nn.Conv2d is quant_nn.QuantConv2d and quant_nn.Linear is quant_nn.QuantLinear
    assert quant_nn.TensorQuantizer.__name__ == "TensorQuantizer"


def test_backward_reaches_weights_and_input():
    module = quant_nn.QuantConv2d(3, 4, 3)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    module(x).sum().backward()
    assert module.weight.grad is not None and x.grad is not None and x.grad.abs().sum() > 0


# ------------------------------------------------------------------ what each module declares (QuantModule)
@pytest.mark.parametrize(
    ("module", "roles", "arguments"),
    [
        (quant_nn.QuantConv2d(3, 4, 3), {"_input_quantizer": "input", "_weight_quantizer": "weight"}, 1),
        (quant_nn.QuantLinear(3, 4), {"_input_quantizer": "input", "_weight_quantizer": "weight"}, 1),
        (quant_nn.QuantAvgPool2d(2), {"_input_quantizer": "input"}, 1),
        (quant_nn.QuantAdd(), {"input_quantizers.0": "input", "input_quantizers.1": "input"}, 2),
        (quant_nn.QuantConcat(1), {"input_quantizer": "input"}, 1),
        (quant_nn.QuantMatMul(), {"input_quantizers.0": "input", "input_quantizers.1": "input"}, 2),
        (
            quant_nn.QuantLSTM(3, 4, bidirectional=True),
            {f"_{kind}_quantizers.{i}": kind for kind in ("input", "weight") for i in range(2)},
            0,
        ),
    ],
    ids=["conv", "linear", "pool", "add", "concat", "matmul", "lstm"],
)
def test_every_module_lists_its_quantizers_and_what_each_is_for(module, roles, arguments):
    assert {name: q.role for name, q in module.quantizers().items()} == roles
    argument_quantizers = [q for q in module.argument_quantizers() if q is not None]
    assert len(argument_quantizers) == arguments  # the LSTM reads cat([x_t, h]), not its argument, quantized
    assert all(q.role == "input" for q in argument_quantizers)


def test_a_role_is_one_of_three():
    q = quant_nn.TensorQuantizer(role="weight")
    assert q.is_weight and quant_nn.TensorQuantizer().role is None
    with pytest.raises(QdqConfigError, match="role"):
        quant_nn.TensorQuantizer(role="bias")


def test_the_float_to_quantized_map_is_the_one_the_classes_registered():
    from qdq.nn.registry import QUANT_MODULES, default_float_types
    from qdq.quant_modules import _default_map

    for float_cls, quant_cls in QUANT_MODULES.items():
        assert issubclass(quant_cls, float_cls), quant_cls
    patched = {name for _, name, _ in _default_map()}
    assert patched == {cls.__name__ for cls in default_float_types()}
    assert not patched & {"MaxPool2d", "InstanceNorm2d"} and {"Conv2d", "LSTM", "AvgPool2d"} <= patched

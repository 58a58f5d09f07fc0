"""Subclasses of registered float modules (``qdq.nn.subclass``): same-padding convolutions quantized through their
own forward, the padding kept, every conv an int8 kernel on ONNX Runtime; subclasses qdq cannot quantize named.

The same-padding classes are written here from the public behaviour of timm's ``Conv2dSame`` (pads computed from
the input's shape with ``F.pad``, then ``F.conv2d``) and efficientnet_pytorch's ``Conv2dDynamicSamePadding``
(likewise, padding only when needed) and ``Conv2dStaticSamePadding`` (a ``ZeroPad2d`` made for one image size);
a test runs timm's own ``Conv2dSame`` in an EfficientNet-Lite0 where timm is installed.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdq
from qdq.graphs.ir_graph import const, single_reader
from qdq.nn import QuantMixin
from qdq.nn.subclass import resolve
from qdq.quantizer import TensorQuantizer, disabled_quantizers
from qdq.replace import replace_modules


def _same_pads(size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """TensorFlow's SAME padding of one axis: (before, after), the odd pixel after."""
    total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


class TimmStyleConv2dSame(nn.Conv2d):
    """timm's ``Conv2dSame``: pads the input by amounts computed from its shape, then ``F.conv2d``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, padding=0, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad_h = _same_pads(x.shape[-2], self.weight.shape[-2], self.stride[0], self.dilation[0])
        pad_w = _same_pads(x.shape[-1], self.weight.shape[-1], self.stride[1], self.dilation[1])
        x = F.pad(x, (*pad_w, *pad_h), value=0)
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class DynamicSamePadding(nn.Conv2d):
    """efficientnet_pytorch's ``Conv2dDynamicSamePadding``: pads (when needed) with ``F.pad``, then ``F.conv2d``."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, groups=1, bias=True) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, 0, dilation, groups, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (top, bottom), (left, right) = (
            _same_pads(x.shape[axis], self.weight.shape[axis], self.stride[i], self.dilation[i])
            for i, axis in enumerate((-2, -1))
        )
        if top + bottom + left + right > 0:
            x = F.pad(x, [left, right, top, bottom])
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StaticSamePadding(nn.Conv2d):
    """efficientnet_pytorch's ``Conv2dStaticSamePadding``: a ``ZeroPad2d`` made for ``image_size``, then
    ``F.conv2d``."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, image_size=0, **kwargs) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, **kwargs)
        pads = [_same_pads(image_size, k, s, d) for k, s, d in zip(self.kernel_size, self.stride, self.dilation)]
        self.static_padding = nn.ZeroPad2d((*pads[1], *pads[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PadThenSuper(nn.Conv2d):
    """A subclass qdq has never seen: reflection padding, then ``nn.Conv2d``'s own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (1, 0, 1, 0), mode="reflect"))


class SameForward(nn.Conv2d):
    """A subclass that keeps ``nn.Conv2d``'s forward."""


class StandardizedConv2d(nn.Conv2d):
    """Weight standardization: the conv reads a weight computed from the parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weight - self.weight.mean((1, 2, 3), keepdim=True)) / (
            self.weight.std((1, 2, 3), keepdim=True) + 1e-5
        )
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ConvRelu(nn.Conv2d):
    """An activation after the conv, inside the conv's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class ScaledLinear(nn.Linear):
    """A linear layer with its own forward (qdq quantizes subclasses of convolutions only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def _same_padding_net() -> nn.Sequential:
    """Stride-2 same-padding convs on odd sizes (asymmetric pads): 15x15 -> 8x8 -> 4x4 -> 4x4 -> 3x3."""
    torch.manual_seed(0)
    return nn.Sequential(
        TimmStyleConv2dSame(3, 8, 3, stride=2),
        nn.ReLU(),
        DynamicSamePadding(8, 8, 3, stride=2, groups=8),
        nn.ReLU6(),
        StaticSamePadding(8, 8, 3, stride=1, image_size=4),
        nn.ReLU(),
        PadThenSuper(8, 8, 2),
        nn.ReLU(),
        SameForward(8, 4, 1),
    ).eval()


X = torch.randn(2, 3, 15, 15, generator=torch.Generator().manual_seed(1))
CONVS = 5


def _quantized(target: str = "onnxruntime") -> tuple[nn.Module, nn.Module]:
    """The float net and its quantized copy (no warning on the way), max-calibrated on X."""
    net = _same_padding_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = qdq.quantize_model(copy.deepcopy(net), qdq.QuantConfig(target=target))
    qdq.calibrate(model, [X], progress=False, method="max")
    return net, model.eval()


def test_every_same_padding_conv_is_quantized_and_keeps_its_class():
    net, model = _quantized()
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantMixin)}
    assert len(quantized) == CONVS
    for name, module in quantized.items():
        float_class = type(net.get_submodule(name))
        assert isinstance(module, float_class) and type(module).__name__ == f"Quant{float_class.__name__}"
        assert type(module.to_float()) is float_class
        assert torch.equal(module.weight, net.get_submodule(name).weight)
    with torch.no_grad(), disabled_quantizers(model):
        assert torch.equal(model(X), net(X))  # the padding is the subclass's own: float output bit for bit


def _fan_in_bound(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Per output channel, the most a conv's output moves when its input and weight are quantized: each of its
    ``fan_in`` products moves by at most ``|x| dw + |w| dx + dx dw`` with ``dx``, ``dw`` half a step."""
    half_x = module.input_quantizer.step() / 2
    half_w = module.weight_quantizer.step().flatten() / 2
    amax_w = module.weight.detach().abs().flatten(1).amax(1)
    fan_in = module.weight[0].numel()
    return fan_in * (x.abs().max() * half_w + amax_w * half_x + half_x * half_w)


def test_each_conv_is_within_its_quantization_steps_of_its_float_self():
    """Each quantized conv against its float self on the float model's activations (those its range was calibrated
    on, so nothing clips): the error is not zero, and within the bound of the steps."""
    net, model = _quantized()
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n, m in net.named_modules() if isinstance(m, nn.Conv2d)]  # fmt: skip
    with torch.no_grad():
        net(X)
        for hook in hooks:
            hook.remove()
        for name, x in inputs.items():
            float_out, quant_out = net.get_submodule(name)(x), model.get_submodule(name)(x)
            error = (quant_out - float_out).abs().amax((0, 2, 3))
            assert (error > 0).any()
            assert (error <= _fan_in_bound(model.get_submodule(name), x)).all(), name


@pytest.mark.filterwarnings("ignore:Constant folding - Only steps=1")  # the TorchScript exporter on x.shape slices
def test_export_for_onnxruntime_runs_every_conv_as_qlinearconv(tmp_path):
    pytest.importorskip("onnxruntime")
    from qdq.export import export_onnx
    from qdq.runtime.ort import fusion_report, inference_session, session_options

    _, model = _quantized()
    path = export_onnx(model, X, tmp_path / "same.onnx", dynamo=False)
    report = fusion_report(path, threads=1)
    assert report.source_weighted == {"Conv": CONVS}
    assert report.int8_kernels == {"com.microsoft:QLinearConv": CONVS} and report.n_float == 0, report.to_markdown()
    assert report.problems == (), report.to_markdown()  # the Pads run on int8 data: no Q/DQ left between kernels
    assert _pads_on_one_grid(onnx.load(str(path))) == CONVS - 1
    session = inference_session(path, session_options(threads=1))
    with torch.no_grad():
        expected = model(X).numpy()
    got = session.run(None, {session.get_inputs()[0].name: X.numpy()})[0]
    assert abs(got - expected).max() <= abs(expected).max() / 127  # within one step of the output's range


def _pads_on_one_grid(model: onnx.ModelProto) -> int:
    """How many Pads the file has, each checked to pad the integers: ``Q -> Pad -> DQ`` of one scale (the export
    writes ``DQ -> Pad -> Q``, the input quantizer read again after the pad; the rewrite moves the Pad)."""
    pads = [node for node in ir.serde.deserialize_model(model).graph if node.op_type == "Pad"]
    for pad in pads:
        before, after = pad.inputs[0].producer(), single_reader(pad.outputs[0])
        assert (before.op_type, after.op_type) == ("QuantizeLinear", "DequantizeLinear")
        assert const(before.inputs[1]) == const(after.inputs[1])
    return len(pads)


def test_subclasses_qdq_cannot_quantize_stay_float_and_are_named_once():
    torch.manual_seed(0)
    net = nn.Sequential(StandardizedConv2d(3, 4, 3), ConvRelu(4, 4, 3), nn.Flatten(), ScaledLinear(4 * 11 * 11, 2))
    with pytest.warns(UserWarning) as caught:
        model = qdq.quantize_model(net)
    messages = [str(w.message) for w in caught if "left 3 module(s) float" in str(w.message)]
    assert len(messages) == 1
    for text in ("StandardizedConv2d (0): its forward calls conv2d with a weight computed from its parameter",
                 "ConvRelu (1): its forward changes what conv2d returns",
                 "ScaledLinear (3): its forward is not Linear's", "register_quant_module"):  # fmt: skip
        assert text in messages[0]
    assert not any(isinstance(m, QuantMixin) for m in model.modules())


def test_resolve_reads_a_forward_without_changing_the_module():
    class LazyPad(nn.Conv2d):
        """timm's ``Conv2dSameExport``: its first forward makes its ``ZeroPad2d`` for the input's size."""

        def forward(self, x):
            if not hasattr(self, "pad"):
                self.pad = nn.ZeroPad2d((0, 1, 0, 1))
            return F.conv2d(self.pad(x), self.weight, self.bias, self.stride)

    module = LazyPad(3, 4, 2, stride=2)
    quant_cls, why = resolve(module)
    assert why is None and quant_cls.__name__ == "QuantLazyPad" and not hasattr(module, "pad")
    assert resolve(nn.Conv2d(3, 4, 1)) == (qdq.nn.QuantConv2d, None) and resolve(nn.ReLU()) == (None, None)
    assert "lazy module" in resolve(nn.LazyConv2d(4, 3))[1]  # its class becomes nn.Conv2d on its first forward


def test_quantized_subclass_trains_pickles_and_copies():
    model = replace_modules(_same_padding_net())
    qdq.calibrate(model, [X], progress=False, method="max")
    model.train()
    model(X).sum().backward()
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in model.modules()
               if isinstance(m, QuantMixin))  # fmt: skip
    model.eval()
    with torch.no_grad():
        expected = model(X)
        for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert torch.equal(clone(X), expected)
            assert [type(m) for m in clone.modules()] == [type(m) for m in model.modules()]


def test_requantize_is_the_identity_outside_an_export():
    quantizer = TensorQuantizer(qdq.QuantDescriptor(amax=2.0))
    x = torch.randn(5)
    assert quantizer.requantize(x) is x


def test_timm_efficientnet_lite0_quantizes_every_conv():
    timm = pytest.importorskip("timm")
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=10).eval()
    same = {n for n, m in model.named_modules() if type(m).__name__ == "Conv2dSame"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    convs = {n: m for n, m in placed.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(convs) == 49 and all(isinstance(m, QuantMixin) for m in convs.values())
    assert same and {n for n, m in convs.items() if type(m).__name__ == "QuantConv2dSame"} == same

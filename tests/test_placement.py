"""Q/DQ placement (qdq.placement): TensorRT and ONNX Runtime rules on torchvision models and small cases.

* ResNet-18, MobileNetV2, EfficientNet-B0 (random init, 3x64x64) after quantize_model + apply_placement
  ("tensorrt"): every residual add (8 / 10 / 9) is a QuantAdd quantizing exactly its skip input;
  forward and backward run; with the added quantizers disabled the output equals the unplaced model's.
* "onnxruntime": both add inputs quantized, conv outputs quantized, post-ReLU quantizers unsigned and only
  fed non-negative values; on EfficientNet-B0 SiLU written x * q(sigmoid(x)), gates quantized (unsigned), the
  squeeze-excitation product quantized with the pool's quantizer.
* concat rule, custom rules (registry), the fallback for untraceable models, errors.
"""

from __future__ import annotations

import copy
import operator
from collections import Counter

import onnx
import pytest
import torch
import torchvision
from torch import nn

import qdq
from qdq import nn as qnn
from qdq.errors import QdqConfigError
from qdq.placement import (
    PLACEMENT_RULES,
    apply_placement,
    function_inputs_rule,
    placement_rules,
    register_placement_rule,
    unregister_placement_rule,
)
from qdq.quantizer import TensorQuantizer

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))

# model, number of residual adds, index of the skip input in ``a + b`` as torchvision writes it
MODELS = [("resnet18", 8, 1), ("mobilenet_v2", 10, 0), ("efficientnet_b0", 9, 1)]


def quantized(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    _set_batchnorm_statistics(model)
    return qdq.quantize_model(model)


def _set_batchnorm_statistics(model: nn.Module) -> None:
    """Random-init MobileNet/EfficientNet activations vanish in eval mode (unit running variance); one
    training-mode pass with momentum 1 sets the statistics to the batch's."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in norms:
        m.momentum = 1.0
    with torch.no_grad():
        model.train()(X)
    for m in norms:
        m.momentum = 0.1
    model.eval()


def added_quantizers(placed: nn.Module, original: nn.Module) -> list[TensorQuantizer]:
    before = {id(m) for m in original.modules()}
    return [m for m in placed.modules() if isinstance(m, TensorQuantizer) and id(m) not in before]


@pytest.mark.parametrize(("name", "adds", "skip"), MODELS)
def test_tensorrt_quantizes_every_skip_input(name, adds, skip):
    placed = apply_placement(quantized(name), target="tensorrt")
    quant_adds = [m for m in placed.modules() if isinstance(m, qnn.QuantAdd)]
    assert len(quant_adds) == adds
    for add in quant_adds:
        enabled = [q.is_enabled for q in add.input_quantizers]
        assert enabled == [i == skip for i in range(2)]


@pytest.mark.parametrize(("name", "adds", "skip"), MODELS[:2])
def test_placed_model_trains_and_matches_when_new_quantizers_disabled(name, adds, skip):
    model = quantized(name).eval()
    reference = copy.deepcopy(model)
    placed = apply_placement(model, target="tensorrt")
    new = added_quantizers(placed, model)
    assert new and all(isinstance(q, TensorQuantizer) for q in new)
    with torch.no_grad():
        quantized_out = placed(X)
        for q in new:
            q.disable()
        assert torch.equal(placed(X), reference(X))
        assert not torch.equal(quantized_out, reference(X))  # the skip quantizers do change the values
    placed.train()
    placed(X).sum().backward()
    assert all(p.grad is not None for p in placed.parameters() if p.requires_grad)


def test_state_dict_keeps_original_keys():
    model = quantized("resnet18")
    keys = set(model.state_dict())
    placed = apply_placement(model)
    placed_keys = set(placed.state_dict())
    assert keys <= placed_keys
    assert {k for k in placed_keys - keys} == {
        f"{add}.input_quantizers.{i}.{buf}"
        for add, m in placed.named_modules()
        if isinstance(m, qnn.QuantAdd)
        for i in range(2)
        for buf in ("_amax", "_pre_quant_scale")
    }


def test_onnxruntime_rules_on_resnet18():
    placed = apply_placement(quantized("resnet18"), target="onnxruntime")
    modules = dict(placed.named_modules())
    for add in (m for m in modules.values() if isinstance(m, qnn.QuantAdd)):
        assert all(q.is_enabled for q in add.input_quantizers)
    # the stem conv -> bn -> relu feeds a max-pool: its output gets a quantizer, whose range is the one of the
    # quantizers reading the pool's output (ORT runs the max-pool on int8 data only with one scale around it)
    stem = placed.get_submodule("output_quantizer")
    assert isinstance(stem, TensorQuantizer) and stem.unsigned
    assert stem is placed.get_submodule("layer1.0.conv1._input_quantizer")
    assert stem is placed.get_submodule("layer1.0.residual_add.input_quantizers.1")
    unsigned = {name for name, m in modules.items() if isinstance(m, TensorQuantizer) and m.unsigned}
    assert "layer1.0.conv2._input_quantizer" in unsigned and "conv1._input_quantizer" not in unsigned
    seen_min: dict[str, float] = {}
    hooks = [
        modules[n].register_forward_pre_hook(lambda m, a, n=n: seen_min.__setitem__(n, float(a[0].min())))
        for n in unsigned
    ]
    with torch.no_grad():
        placed.eval()(X)  # unsigned quantizers raise on negative input
    for h in hooks:
        h.remove()
    assert len(seen_min) == len(unsigned) and min(seen_min.values()) >= 0


def test_onnxruntime_rules_on_efficientnet():
    """SiLU becomes ``x * q(sigmoid(x))``, every Sigmoid (SiLU's and the squeeze-excitation gates) gets an
    unsigned output quantizer, the gate product reuses the pool's input quantizer for its other operand, and
    convs read by a residual add through stochastic depth get no second quantizer."""
    model = quantized("efficientnet_b0").eval()
    reference = copy.deepcopy(model)
    placed = apply_placement(model, target="onnxruntime")
    modules = dict(placed.named_modules())
    sigmoids = [m for n, m in modules.items() if n.rpartition(".")[2].startswith("sigmoid_quantizer")]
    assert len(sigmoids) == 49 + 16 and all(q.unsigned for q in sigmoids)
    calls = Counter(str(node.target) for node in placed.graph.nodes if node.op == "call_module")
    assert not any(isinstance(modules[name], nn.SiLU) for name in calls)
    pools = [n for n in modules if n.startswith("features.") and n.endswith(".avgpool")]
    assert len(pools) == 16 and all(calls[f"{pool}._input_quantizer"] == 1 for pool in pools)
    assert not any(n.endswith("block.3.output_quantizer") for n in modules)
    with torch.no_grad():
        placed(X)  # unsigned quantizers raise on negative input
        for m in [*placed.modules(), *reference.modules()]:
            if isinstance(m, TensorQuantizer):
                m.disable()
        # silu(x) and x * sigmoid(x) round differently (ulps, grown through 16 blocks)
        torch.testing.assert_close(placed(X), reference(X), rtol=1e-3, atol=1e-3)


class BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: ``F.batch_norm``, a dropout (the identity at inference), the activation."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )
        return self.act(self.drop(x))


def test_onnxruntime_quantizes_a_conv_output_after_its_functional_batchnorm_dropout_and_relu6():
    """The conv's output quantizer goes after the ReLU6 ONNX Runtime folds into QLinearConv: the function call is a
    BatchNorm and the dropout between is passed (it went right after the conv, before the BatchNorm)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct(8), nn.Conv2d(8, 4, 3), BatchNormAct(4)).eval()
    placed = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    added = [n for n in placed.graph.nodes if n.op == "call_module" and n.target not in dict(model.named_modules())]
    assert [str(n.args[0].target) for n in added] == ["3.act"]  # the first conv's tail is read by a quantized conv


def test_tensorrt_keeps_silu():
    placed = apply_placement(quantized("efficientnet_b0"), target="tensorrt")
    assert not any("sigmoid_quantizer" in n for n, _ in placed.named_modules())
    assert any(
        isinstance(placed.get_submodule(str(n.target)), nn.SiLU) for n in placed.graph.nodes if n.op == "call_module"
    )


class CatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = qnn.QuantConv2d(3, 4, 1)
        self.b = qnn.QuantConv2d(3, 4, 1)
        self.head = qnn.QuantConv2d(8, 2, 1)
        self.after = qnn.QuantConv2d(7, 7, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([self.a(x), self.b(x)], dim=1)  # read by a quantized conv only: left alone
        z = torch.cat([self.a(x), x], 1)  # read by a float op (then a conv): one shared quantizer
        w = torch.cat([self.b(x), x], 1)  # a model output: left float (nothing after it runs in int8)
        return self.head(y), self.after(torch.tanh(z)), w


def test_concat_rule():
    placed = apply_placement(CatNet())
    concats = [m for m in placed.modules() if isinstance(m, qnn.QuantConcat)]
    assert len(concats) == 1 and concats[0].dim == 1
    out = placed(torch.randn(2, 3, 4, 4))
    assert out[1].shape == out[2].shape == (2, 7, 4, 4)


class UNetStep(nn.Module):
    """An encoder conv read by a max-pool and by a concatenation with the upsampled deeper map (U-Net)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.down, self.head = qnn.QuantConv2d(3, 4, 3, padding=1), qnn.QuantConv2d(4, 4, 3, padding=1), \
            qnn.QuantConv2d(8, 2, 1)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.enc(x))
        deep = torch.relu(self.down(nn.functional.max_pool2d(skip, 2)))
        up = nn.functional.interpolate(deep, scale_factor=2.0, mode="nearest")
        return self.head(torch.cat([up, skip], 1))


def test_onnxruntime_moves_int8_data_through_unet_pools_resizes_and_concatenations():
    placed = apply_placement(UNetStep(), target="onnxruntime")
    modules = {n: m for n, m in placed.named_modules(remove_duplicate=False)}
    calls = [str(n.target) for n in placed.graph.nodes if n.op == "call_module"]
    # the pool: one range before and after (the encoder's output quantizer is the down conv's input quantizer)
    skip = placed.get_submodule("output_quantizer")
    assert skip is modules["down._input_quantizer"]
    # the resize: its input (the deep conv's output) and its output as the concatenation reads it share a range:
    # one quantizer called on both sides
    deep = placed.get_submodule("output_quantizer_1")
    assert calls.count("output_quantizer_1") == 2
    # the concatenation reads both inputs quantized (QLinearConcat), each with its own range
    cat = next(n for n in placed.graph.nodes if n.target is torch.cat)
    assert [str(t.target) for t in cat.args[0]] == ["output_quantizer_1", "output_quantizer"] and skip is not deep
    assert all(m.unsigned for m in (skip, deep))
    assert placed(torch.randn(1, 3, 8, 8)).shape == (1, 2, 8, 8)


class SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = qnn.QuantConv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv(x))


def test_custom_rule_from_registry():
    register_placement_rule("test_se_mul", function_inputs_rule([operator.mul]), targets=("tensorrt",))
    try:
        assert placement_rules("tensorrt")[-1] == "test_se_mul"
        assert "test_se_mul" not in placement_rules("onnxruntime")
        placed = apply_placement(SqueezeExcite())
        added = [n for n, m in placed.named_modules() if isinstance(m, TensorQuantizer) and "conv" not in n]
        assert sorted(added) == ["input_quantizer", "input_quantizer_1"]
        placed(torch.randn(1, 3, 4, 4))
    finally:
        unregister_placement_rule("test_se_mul")
    assert "test_se_mul" not in PLACEMENT_RULES


class HeadedBlock(nn.Module):
    """A ResNet basic block read by a conv (its residual add is then not the model's output tail)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torchvision.models.resnet.BasicBlock(3, 3), nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Untraceable(nn.Module):
    """Data-dependent control flow at the top: torch.fx cannot trace it, its block can."""

    def __init__(self) -> None:
        super().__init__()
        self.block = HeadedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.block(x)
        return self.block(-x)


def test_fallback_places_inside_traceable_children():
    model = qdq.quantize_model(Untraceable())
    with pytest.warns(UserWarning, match="cannot trace"):
        placed = apply_placement(model)
    assert placed is model and isinstance(model.block, torch.fx.GraphModule)
    assert sum(isinstance(m, qnn.QuantAdd) for m in model.modules()) == 1
    model(torch.randn(1, 3, 8, 8))


class CachesItsFirstCall(nn.Module):
    """A pooler that computes a constant on its first call and keeps it, then loops over its input's rows (torch.fx
    cannot trace that), as torchvision's ``MultiScaleRoIAlign`` does with its scales and levels (Faster R-CNN): the
    failed trace left a Proxy as the kept value, and every real call then failed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = 1.0 / x.shape[-1]
        return torch.stack([row * self.scale for row in self.conv(x)])


class UntraceableOverACache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = CachesItsFirstCall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x) if x.sum() > 0 else self.pool(-x)


def test_tracing_leaves_no_proxy_in_a_modules_attributes():
    model = UntraceableOverACache()
    with pytest.warns(UserWarning, match="cannot trace"):
        model = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))  # neither traces
    assert model.pool.scale is None  # as before the trace: the next real call computes it
    x = torch.rand(2, 3, 8, 8)
    qdq.calibrate(model, [x, x + 1], method="max", progress=False)
    assert model.pool.scale == 1 / 8
    assert torch.is_tensor(model(x))


def _linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias).relu()


torch.fx.wrap("_linear_relu")  # a call torch.fx keeps whole: torchvision's shifted_window_attention_v2 is one


class WeightsReadByAFunction(nn.Module):
    """Swin V2's family: a Linear whose parameters a wrapped function reads, the module itself never called."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_linear_relu(x, self.qkv.weight, self.qkv.bias))


@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
def test_a_quantized_module_only_a_function_reads_stays_float_said_once(target, tmp_path):
    with pytest.warns(UserWarning, match=r"1 quantized module\(s\) .* never called .*\(e\.g\. qkv") as said:
        model = qdq.quantize_model(WeightsReadByAFunction(), qdq.QuantConfig(target=target))
    assert sum("never called" in str(w.message) for w in said) == 1
    qdq.calibrate(model, [torch.randn(16, 8)], progress=False, method="max")  # raised: qkv's input saw no data
    assert float(model.get_submodule("out")._input_quantizer.amax) > 0
    x = torch.randn(2, 8)
    path = qdq.export_onnx(model, x, tmp_path / "model.onnx")
    assert sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(path)).graph.node) >= 1


def test_no_change_returns_the_model():
    model = qdq.quantize_model(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()))
    assert apply_placement(model) is model


def test_errors():
    with pytest.raises(QdqConfigError, match="target"):
        apply_placement(nn.Identity(), target="tflite")
    with pytest.raises(QdqConfigError, match="residual_add"):
        apply_placement(nn.Identity(), rules=["residual_ad"])
    with pytest.raises(QdqConfigError, match="already registered"):
        register_placement_rule("concat", lambda ctx: None)

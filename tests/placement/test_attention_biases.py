"""Attention bias folding (qdq.placement.attention_biases): per layout, the float function is unchanged, the key
bias is 0 and the value bias has moved into the output Linear; where an identity does not hold (a rotation of the
keys, a gate before the output Linear, a module that cannot run alone) the parameters are left as they were."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdq
from qdq.app.digit_transformers import SelfAttention, digits_vit
from qdq.placement.attention_biases import fold_attention_biases

sys.path.insert(0, str(Path(__file__).parents[1]))
from transformer_models import hugging_face_model, random_biases

pytestmark = pytest.mark.filterwarnings("ignore:torch.fx cannot trace")


def _outputs(model: nn.Module, example) -> torch.Tensor:
    with torch.no_grad():
        out = model(**example) if isinstance(example, dict) else model(*example)
    out = out.logits if hasattr(out, "logits") else out
    return out[0] if isinstance(out, tuple) else out


def _assert_same_function(model: nn.Module, example, folded_count: int) -> nn.Module:
    model = model.eval()
    random_biases(model)
    before = _outputs(model, example)
    folded = copy.deepcopy(model)
    done = fold_attention_biases(folded)
    assert len(done) == folded_count and all("key and value biases folded" in d for d in done)
    after = _outputs(folded, example)
    assert torch.allclose(after, before, rtol=0, atol=1e-5 * float(before.abs().max()))
    return folded


def test_packed_qkv_key_zero_value_in_the_output_bias():
    torch.manual_seed(0)
    attention = SelfAttention(32, heads=4).eval()
    random_biases(attention)
    x = torch.randn(2, 5, 32)
    before = attention(x)
    b_v, b_o, w_o = attention.qkv.bias[64:].clone(), attention.proj.bias.clone(), attention.proj.weight.clone()
    assert fold_attention_biases(attention) == ["SelfAttention: key and value biases folded"]
    assert torch.equal(attention.qkv.bias[32:], torch.zeros(64))  # key and value blocks
    torch.testing.assert_close(attention.proj.bias, b_o + w_o @ b_v)  # hand-computed: b_o + W_o·b_v
    torch.testing.assert_close(attention(x), before, rtol=0, atol=1e-6)


def test_digits_vit_and_timm_vit():
    _assert_same_function(digits_vit(), (torch.randn(3, 1, 28, 28),), folded_count=4)
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    _assert_same_function(model, (torch.randn(2, 3, 32, 32),), folded_count=2)


def test_timm_swin_window_attention():
    timm = pytest.importorskip("timm")
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, depths=(2, 2),
                              num_heads=(2, 4), embed_dim=32)  # fmt: skip
    _assert_same_function(model, (torch.randn(2, 3, 56, 56),), folded_count=4)


@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert", "vit"])
def test_hugging_face_families(name):
    model, example = hugging_face_model(name, layers=2)
    _assert_same_function(model, example, folded_count=2)


def test_multihead_attention():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 6, 32)
    folded = _assert_same_function(attention, (x, x, x), folded_count=1)
    assert torch.equal(folded.in_proj_bias[32:], torch.zeros(64))


class RotatedKeys(SelfAttention):
    """Rotary-style: keys rotated per position after the bias, so ``q·R_j·b_k`` depends on the key's position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        angle = torch.arange(tokens, dtype=x.dtype)[:, None] * 0.7
        k1, k2 = k.chunk(2, dim=-1)
        k = torch.cat([k1 * angle.cos() - k2 * angle.sin(), k1 * angle.sin() + k2 * angle.cos()], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class GatedOutput(SelfAttention):
    """A gate multiplies the attention output before ``proj``: the value fold breaks, the key fold holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj(out * torch.sigmoid(x))


class NeedsPositions(SelfAttention):
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + positions)


@pytest.mark.parametrize("cls", [RotatedKeys, NeedsPositions])
def test_left_alone_where_the_fold_would_change_the_function_or_cannot_be_checked(cls):
    torch.manual_seed(0)
    attention = cls(32, heads=2)
    random_biases(attention)
    state = copy.deepcopy(attention.state_dict())
    assert fold_attention_biases(attention) == []
    assert all(torch.equal(state[k], v) for k, v in attention.state_dict().items())


def test_a_gate_keeps_the_value_bias_and_folds_the_key_bias():
    torch.manual_seed(0)
    attention = GatedOutput(32, heads=2).eval()
    random_biases(attention)
    x = torch.randn(2, 5, 32)
    before, value_bias = attention(x), attention.qkv.bias[64:].clone()
    assert fold_attention_biases(attention) == ["GatedOutput: key bias folded"]
    assert torch.equal(attention.qkv.bias[32:64], torch.zeros(32))
    assert torch.equal(attention.qkv.bias[64:], value_bias)
    torch.testing.assert_close(attention(x), before, rtol=0, atol=1e-6)


def test_calibrated_modules_are_left_alone():
    """Their ranges were measured on the unfolded key, value and output-Linear input."""
    torch.manual_seed(0)
    quantized = qdq.quantize_model(SelfAttention(32, heads=2))
    random_biases(quantized)
    qdq.calibrate(quantized, [torch.randn(4, 5, 32)], progress=False, method="max")
    state = copy.deepcopy(quantized.state_dict())
    assert fold_attention_biases(quantized) == []
    assert all(torch.equal(state[k], v) for k, v in quantized.state_dict().items())


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_placement_folds_for_the_targets_that_ask(target, tmp_path):
    """ONNX Runtime's facts ask (QGemm pays for a bias); TensorRT's do not (the model keeps its parameters). On
    ONNX Runtime the key and value Gemms of the export then have no bias, and the engine agrees with PyTorch."""
    torch.manual_seed(0)
    model = digits_vit().eval()
    random_biases(model)
    before = copy.deepcopy(model.state_dict())
    quantized = qdq.quantize_model(model, qdq.QuantConfig(target=target))
    qkv = quantized.get_parameter("blocks.0.attn.qkv.bias")
    if target == "tensorrt":
        assert torch.equal(qkv, before["blocks.0.attn.qkv.bias"])
        return
    assert torch.equal(qkv[64:], torch.zeros(128))
    batch = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    qdq.calibrate(quantized, [batch], progress=False, method="max")
    path = qdq.export_onnx(quantized, batch, tmp_path / "vit.onnx")
    import onnx

    sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
    from export_helpers import teacher_forced_mismatches

    parts = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm" and "/part" in n.name]
    assert len(parts) == 12  # 4 blocks x (query, key, value)
    assert sorted(len(n.input) > 2 and bool(n.input[2]) for n in parts) == [False] * 8 + [True] * 4
    assert teacher_forced_mismatches(quantized, path, batch) == {}

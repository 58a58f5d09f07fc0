"""Real models' attention routed through QuantScaledDotProductAttention: nn.MultiheadAttention (module
replacement), Hugging Face BERT / DistilBERT / RoBERTa / ViT (transformers' attention registry), timm ViT / DeiT
/ Swin (fused_attn + replace_sdpa_calls). Each gets its four attention quantizers per layer and, with every
quantizer disabled, computes its float output; quantized, it exports and ONNX Runtime agrees per quantizer."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import qdq
from qdq.errors import QdqConfigError
from qdq.nn import QuantLinear, QuantMultiheadAttention
from qdq.nn.attention import (
    ATTENTION_QUANTIZERS,
    QuantScaledDotProductAttention,
    replace_sdpa_calls,
    use_fused_attention,
)
from qdq.quantizer import TensorQuantizer

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_helpers import float_segment_errors, teacher_forced_mismatches

from transformer_models import hugging_face_model


def _disable_all(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, TensorQuantizer):
            module.disable()


def _attention_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, QuantScaledDotProductAttention)]


# --- nn.MultiheadAttention -------------------------------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self, batch_first: bool = True, **kwargs) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first, **kwargs)
        self.head = nn.Linear(16, 3)

    def forward(self, x, key_padding_mask=None):
        y, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return self.head(y + x)


def test_quantize_model_replaces_multihead_attention():
    model = qdq.quantize_model(Encoder())
    assert isinstance(model.attn, QuantMultiheadAttention) and isinstance(model.attn.out_proj, QuantLinear)
    names = {n for n, m in model.named_modules() if isinstance(m, TensorQuantizer)}
    assert {f"attn.attention.{q}" for q in ATTENTION_QUANTIZERS} <= names
    assert {"attn._input_quantizer", "attn._weight_quantizer", "attn.out_proj._input_quantizer"} <= names


VARIANTS = {
    "self": (dict(), lambda x, k, v: {}),
    "seq_first": (dict(batch_first=False), lambda x, k, v: {}),
    "cross_kdim_vdim": (dict(kdim=6, vdim=5), lambda x, k, v: {}),
    "padding_and_float_mask": (dict(), lambda x, k, v: {"key_padding_mask": torch.tensor([[0.0] * 6 + [-1e4]] * 3),
                                                         "attn_mask": torch.randn(5, 7)}),
    "bool_padding": (dict(), lambda x, k, v: {"key_padding_mask": torch.tensor([[False] * 6 + [True]] * 3)}),
    "bool_mask_per_head": (dict(), lambda x, k, v: {"attn_mask": torch.rand(12, 5, 7) > 0.8,
                                                    "average_attn_weights": False}),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_disabled_multihead_attention_equals_torch(variant):
    options, extra = VARIANTS[variant]
    float_module = nn.MultiheadAttention(16, 4, batch_first=options.pop("batch_first", True), **options).eval()
    quantized = QuantMultiheadAttention.from_float(copy.deepcopy(float_module))
    _disable_all(quantized)
    shape = (lambda n, l, e: (n, l, e)) if float_module.batch_first else (lambda n, l, e: (l, n, e))  # noqa: E741
    x = torch.randn(*shape(3, 5, 16))
    k = torch.randn(*shape(3, 7, float_module.kdim))
    v = torch.randn(*shape(3, 7, float_module.vdim))
    kwargs = extra(x, k, v)
    expected, expected_weights = float_module(x, k, v, **kwargs)
    got, weights = quantized(x, k, v, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


def test_multihead_attention_rejects_bias_kv():
    with pytest.raises(QdqConfigError, match="add_bias_kv"):
        QuantMultiheadAttention.from_float(nn.MultiheadAttention(8, 2, add_bias_kv=True))


def test_multihead_attention_weights_calibrate_per_row_and_export_exactly(tmp_path):
    torch.manual_seed(0)
    model = qdq.quantize_model(Encoder()).eval()
    x = torch.randn(4, 6, 16)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[0, -2:] = True
    qdq.calibrate(model, [{"x": x, "key_padding_mask": mask}], progress=False, method="max")
    row_max = model.attn.in_proj_weight.detach().abs().amax(dim=1, keepdim=True)
    quantizers = (model.attn._weight_quantizer, model.attn.k_weight_quantizer, model.attn.v_weight_quantizer)
    assert torch.equal(torch.cat([q.amax for q in quantizers]), row_max)  # the packed rows, block by block
    path = qdq.export_onnx(model, {"x": x, "key_padding_mask": mask}, tmp_path / "mha.onnx", target="tensorrt")
    example = {"x": x, "key_padding_mask": mask}
    assert teacher_forced_mismatches(model, path, example) == {}
    assert max(float_segment_errors(model, path, example).values()) < 1e-5


# --- Hugging Face transformers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "distilbert", "roberta", "vit"])
def test_hugging_face_attention_is_captured_and_disabled_is_float(name):
    from qdq.nn.huggingface import IMPLEMENTATION, capture_hf_attention

    torch.manual_seed(0)
    model, inputs = hugging_face_model(name, layers=2)
    model.eval()
    reference = copy.deepcopy(model)
    names = capture_hf_attention(model)
    assert len(names) == 2 and _attention_modules(model) == [f"{n}.quant_attention" for n in names]
    modules = [model.get_submodule(n) for n in _attention_modules(model)]
    assert capture_hf_attention(model) == names  # idempotent: the same modules stay
    assert [model.get_submodule(n) for n in _attention_modules(model)] == modules
    assert model.config._attn_implementation == IMPLEMENTATION
    _disable_all(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits, rtol=1e-5, atol=1e-5)
        assert len(model(**inputs, output_attentions=True).attentions) == 2


def _tiny_t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=50, d_model=32, d_kv=16, d_ff=32, num_layers=2, num_heads=2)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    return tf.T5EncoderModel(config).eval(), {"input_ids": ids, "attention_mask": mask}


def test_t5_relative_position_bias_joins_the_mask_and_exports_to_the_quantizers_step(tmp_path):
    from qdq.nn.huggingface import capture_hf_attention

    model, inputs = _tiny_t5()
    reference = copy.deepcopy(model)
    assert len(capture_hf_attention(model)) == 2  # T5 hands its relative bias to the attention function
    _disable_all(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, reference(**inputs).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    quantized = qdq.quantize_model(reference, qdq.QuantConfig(target="tensorrt"))
    assert len(_attention_modules(quantized)) == 2
    qdq.calibrate(quantized, [inputs], progress=False, method="max")
    path = qdq.export_onnx(quantized, inputs, tmp_path / "t5.onnx", target="tensorrt")
    assert teacher_forced_mismatches(quantized, path, inputs) == {}


def test_soft_capped_attention_stays_float_said_once():
    tf = pytest.importorskip("transformers")
    from qdq.nn.huggingface import capture_hf_attention

    torch.manual_seed(0)
    config = tf.Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)  # fmt: skip
    model = tf.Gemma2Model(config).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="caps its scores.*2 modules") as said:
        assert capture_hf_attention(model) == []
    assert len(said) == 1 and _attention_modules(model) == []
    with torch.no_grad():  # the model keeps its own attention implementation
        torch.testing.assert_close(model(input_ids=ids).last_hidden_state,
                                   reference(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5)  # fmt: skip


def test_capture_needs_a_transformers_model():
    pytest.importorskip("transformers")
    from qdq.nn.huggingface import capture_hf_attention

    with pytest.raises(TypeError, match="PreTrainedModel"):
        capture_hf_attention(nn.Linear(2, 2))


def test_a_module_without_its_quantized_attention_says_what_to_do():
    pytest.importorskip("transformers")
    from qdq.nn.huggingface import hf_attention_forward

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(QdqConfigError, match="capture_hf_attention"):
        hf_attention_forward(nn.Module(), q, q, q, None)


# --- timm ----------------------------------------------------------------------------------------------------------


def _timm_model(name: str) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    if name.startswith("swin"):
        options = dict(img_size=56, depths=(2, 2), num_heads=(2, 4), embed_dim=32, window_size=7)
    else:
        options = dict(img_size=32, patch_size=8, depth=2)
    return timm.create_model(name, pretrained=False, num_classes=10, **options).eval()


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
def test_timm_attention_is_captured_and_disabled_is_float(name):
    model = _timm_model(name)
    x = torch.randn(2, 3, 56 if name.startswith("swin") else 32, 56 if name.startswith("swin") else 32)
    with torch.no_grad():
        expected = model(x)  # timm's default: ViT fused, Swin unfused (the same function)
    blocks = 4 if name.startswith("swin") else 2
    assert len(use_fused_attention(model)) == blocks
    gm = torch.fx.symbolic_trace(model)
    added = replace_sdpa_calls(gm)
    assert len(added) == blocks and all(a.endswith("attn.quant_attention") for a in added)
    quantizers = [n for n, m in gm.named_modules() if isinstance(m, TensorQuantizer)]
    assert len(quantizers) == blocks * len(ATTENTION_QUANTIZERS)
    _disable_all(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), expected, rtol=1e-4, atol=1e-5)

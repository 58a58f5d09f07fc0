"""quantize_model(model, QuantConfig(target=...)) quantizes attention by itself, for every listed model family:
Hugging Face BERT / DistilBERT / RoBERTa / ViT (transformers' attention registry), timm ViT / DeiT / Swin
(fused_attn + the fx route), code calling F.scaled_dot_product_attention, nn.MultiheadAttention. Each family,
for each target: the target's attention quantizers are there, the export runs in ONNX Runtime, and every
quantizer agrees with ONNX Runtime's Q/DQ pair teacher forced (0 elements apart) with the float ops between
quantizers equal to float rounding. Random init, small configs (head size 16)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdq
from qdq.graphs.ops import ATTENTION_SITES
from qdq.nn.attention import ATTENTION_QUANTIZERS, QuantScaledDotProductAttention
from qdq.placement.capture import CAPTURE_STEPS, CaptureStep, settle_attention
from qdq.targets import AttentionFacts, get_target

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_helpers import float_segment_errors, teacher_forced_mismatches

from transformer_models import hugging_face_model


class SdpaEncoder(nn.Module):
    """Attention written with F.scaled_dot_product_attention (keyword arguments), then a residual Linear."""

    def __init__(self, width: int = 32, heads: int = 2, length: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("bias", torch.randn(length, length) * 0.5)  # a float mask, added to the scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.0)
        return x + self.proj(y.transpose(1, 2).flatten(2))


class MhaEncoder(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.head(y + x)


def _timm(name: str):
    timm = pytest.importorskip("timm")
    if name.startswith("swin"):
        options = dict(img_size=16, patch_size=4, depths=(2,), num_heads=(2,), embed_dim=32, window_size=2)
        return timm.create_model(name, pretrained=False, num_classes=3, **options), torch.randn(2, 3, 16, 16)
    options = dict(img_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=2)
    return timm.create_model(name, pretrained=False, num_classes=3, **options), torch.randn(2, 3, 16, 16)


FAMILIES = {
    "hf_bert": lambda: hugging_face_model("bert"),
    "hf_distilbert": lambda: hugging_face_model("distilbert"),
    "hf_roberta": lambda: hugging_face_model("roberta"),
    "hf_vit": lambda: hugging_face_model("vit"),
    "timm_vit": lambda: _timm("vit_tiny_patch16_224"),
    "timm_deit": lambda: _timm("deit_tiny_patch16_224"),
    "timm_swin": lambda: _timm("swin_tiny_patch4_window7_224"),
    "sdpa_function": lambda: (SdpaEncoder(), torch.randn(2, 6, 32)),
    "multihead_attention": lambda: (MhaEncoder(), torch.randn(2, 6, 32)),
}
BLOCKS = {"timm_swin": 2}  # attention modules per model (1 elsewhere)


def _attention(model: nn.Module) -> dict[str, QuantScaledDotProductAttention]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantScaledDotProductAttention)}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_is_quantized_for_the_target_and_agrees_with_onnx_runtime(family, target, tmp_path):
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qdq.quantize_model(model.eval(), qdq.QuantConfig(target=target))
    assert len([w for w in caught if issubclass(w.category, UserWarning)]) <= 1  # at most one per model
    attention = _attention(model)
    assert len(attention) == BLOCKS.get(family, 1)
    wanted = get_target(target).attention.quantized
    for module in attention.values():
        assert module.target_facts is get_target(target).attention
        assert [q.is_enabled for q in module.quantizers().values()] == [n in wanted for n in ATTENTION_SITES]
    qdq.calibrate(model, [inputs], progress=False, method="max")
    enabled = {name: [q.is_enabled for q in m.quantizers().values()] for name, m in attention.items()}
    assert all(flags == [n in wanted for n in ATTENTION_SITES] for flags in enabled.values())  # head size 16
    path = qdq.export_onnx(model, inputs, tmp_path / f"{family}.onnx")
    assert teacher_forced_mismatches(model, path, inputs) == {}
    errors = float_segment_errors(model, path, inputs)
    name = next(iter(attention))
    quantizers = {f"{name}.{q}" for site, q in zip(ATTENTION_SITES, ATTENTION_QUANTIZERS) if site in wanted}
    assert quantizers <= set(errors)  # the attention quantizers are Q/DQ pairs of the file
    # float rounding only; the onnxruntime file also adds Linear biases as int32 at s_x * s_w (QGemm's form): a
    # shift of at most s_x * s_w / 2, ~1e-5 of a projection's range
    assert max(errors.values()) < (1e-5 if target == "tensorrt" else 1e-4)


def test_hugging_face_model_gets_one_warning_naming_what_stays_float():
    model, _ = hugging_face_model("bert")
    with pytest.warns(UserWarning) as caught:
        qdq.quantize_model(model.eval(), qdq.QuantConfig(target="tensorrt"))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "cannot trace" in message and "stays float" in message and "bert.encoder" in message
    assert "Attention is quantized all the same (1 modules)" in message


def test_capture_steps_are_a_registry_and_placement_can_skip_them():
    assert list(CAPTURE_STEPS) == ["huggingface_attention", "fused_attention_flag", "sdpa_calls"]
    model = qdq.quantize_model(SdpaEncoder(), qdq.QuantConfig())
    placed = qdq.placement.apply_placement(model, "tensorrt", capture=())
    assert _attention(placed) == {}
    with pytest.raises(TypeError, match="exactly one"):
        CaptureStep("both", model=lambda m, d: [], graph=lambda g, d: [])


@pytest.mark.parametrize(
    ("width", "heads", "length", "why"),
    [(32, 2, 6, None), (16, 2, 6, "head size 8"), (32, 2, 513, "sequence length 513"), (32, 2, 512, None)],
)
def test_tensorrt_keeps_attention_float_outside_its_fused_shapes(width, heads, length, why):
    model = qdq.quantize_model(SdpaEncoder(width, heads, length), qdq.QuantConfig(target="tensorrt"))
    x = torch.randn(1, length, width)
    if why is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            qdq.calibrate(model, [x], progress=False, method="max")
    else:
        with pytest.warns(UserWarning, match=f"1 of 1 attention modules keep their matmuls in float.*{why}"):
            qdq.calibrate(model, [x], progress=False, method="max")
    (module,) = _attention(model).values()
    assert module.calibrated_shape == (width // heads, length)
    assert all(q.is_enabled for q in module.quantizers().values()) is (why is None)
    assert any(q.is_enabled for q in module.quantizers().values()) is (why is None)


def test_attention_facts_without_shape_limits_keep_attention_at_any_shape():
    model = qdq.quantize_model(SdpaEncoder(16, 2, 6), qdq.QuantConfig(target="tensorrt"))
    (module,) = _attention(model).values()
    module.calibrated_shape = (8, 600)
    module.target_facts = AttentionFacts()  # a target whose int8 attention takes every shape
    assert settle_attention(model) is None
    assert all(q.is_enabled for q in module.quantizers().values())
    module.target_facts = get_target("tensorrt").attention
    assert "head size 8" in settle_attention(model)
    assert not any(q.is_enabled for q in module.quantizers().values())
    assert settle_attention(model) is None  # said once: already float


def test_attention_facts_say_why_a_shape_is_outside():
    # targets name the tensors, neutrally, in the order of the module's quantizers
    assert [f"{name}_quantizer" for name in ATTENTION_SITES] == list(ATTENTION_QUANTIZERS)
    facts = AttentionFacts(head_sizes=(16, 32, 64), max_length=512, reason="r")
    assert facts.outside(64, 512) is None
    assert facts.outside(48, 10) == "head size 48 (not one of [16, 32, 64])"
    assert facts.outside(16, 513) == "sequence length 513 (> 512)"
    with pytest.raises(qdq.errors.QdqConfigError, match="reason"):
        AttentionFacts(max_length=4)
    with pytest.raises(qdq.errors.QdqConfigError, match="quantized tensors are"):
        AttentionFacts(quantized=("query_quantizer",))  # the module's attribute, not the tensor's neutral name


@pytest.mark.parametrize(
    ("family", "adds"),
    [
        # BertSelfOutput / BertOutput: LayerNorm(dropout(dense(h)) + input_tensor): the shortcut is operand 1
        ("hf_bert", {"bert.encoder.layer.0.attention.output.residual_add": [False, True],
                     "bert.encoder.layer.0.output.residual_add": [False, True]}),
        # timm Block: x = x + drop_path(ls(attn(norm(x)))): the shortcut is operand 0
        ("timm_vit", {"blocks.0.residual_add": [True, False], "blocks.0.residual_add_1": [True, False]}),
    ],
)  # fmt: skip
def test_tensorrt_quantizes_the_shortcut_of_transformer_residual_adds(family, adds):
    model, _ = FAMILIES[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Hugging Face model's one fx warning
        model = qdq.quantize_model(model.eval(), qdq.QuantConfig(target="tensorrt"))
    for name, quantized in adds.items():
        assert [q.is_enabled for q in model.get_submodule(name).input_quantizers] == quantized


def test_the_default_calibration_keeps_attention_float_outside_the_fused_shapes():
    """``auto`` holds samples out, then the end of calibration switches the attention's quantizers off (head size 8):
    the held-out statistics of those quantizers are left out, not merged into ranges they no longer have (a
    KeyError on timm's mobilevit_xxs)."""
    model = qdq.quantize_model(SdpaEncoder(16, 2, 6), qdq.QuantConfig(target="tensorrt"))
    batches = [torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    from qdq.workflow.auto_calibration import select_amax

    with pytest.warns(UserWarning, match="keep their matmuls in float.*head size 8"):
        result = select_amax(model, batches, progress=False)  # what qdq.calibrate(model, batches) runs
    assert result.held_out
    (module,) = _attention(model).values()
    assert not any(q.is_enabled for q in module.quantizers().values())

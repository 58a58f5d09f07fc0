"""The digit transformers of the app's model zoo: shapes, 1- or 3-channel input, and each one's attention
reachable by qdq's capture (fx for the ViT, transformers' registry for the BERT), and quantize_model alone
quantizing all four attention inputs of each for ONNX Runtime, exact against the engine teacher forced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import qdq
from qdq.app.digit_transformers import DigitsBert, DigitsViT
from qdq.app.models import load_model
from qdq.nn.attention import QuantScaledDotProductAttention, replace_sdpa_calls


def test_vit_logits_and_channels():
    model = DigitsViT(depth=2).eval()
    x = torch.randn(3, 1, 28, 28)
    out = model(x)
    assert out.shape == (3, 10)
    torch.testing.assert_close(model(x.repeat(1, 3, 1, 1)), out)


def test_vit_attention_is_one_traceable_call_per_block():
    model = DigitsViT(depth=3).eval()
    gm = torch.fx.symbolic_trace(model)
    assert replace_sdpa_calls(gm) == [f"blocks.{i}.attn.quant_attention" for i in range(3)]


def test_bert_reads_rows_as_tokens_and_its_attention_is_captured():
    pytest.importorskip("transformers")
    from qdq.nn.huggingface import capture_hf_attention

    model = DigitsBert(depth=2).eval()
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = model(x)
    assert expected.shape == (2, 10)
    assert len(capture_hf_attention(model.bert)) == 2
    for quantizer in model.modules():
        if hasattr(quantizer, "disable") and type(quantizer).__name__ == "TensorQuantizer":
            quantizer.disable()
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_zoo_names():
    assert isinstance(load_model("digits_vit"), DigitsViT)
    if pytest.importorskip("transformers"):
        assert isinstance(load_model("digits_bert", num_classes=4), DigitsBert)


def test_training_names_a_known_model():
    from qdq.app.digit_transformers import RECIPES, train_digit_transformer
    from qdq.errors import QdqConfigError

    assert set(RECIPES) == {"digits_vit", "digits_bert"}
    with pytest.raises(QdqConfigError, match="unknown digit transformer 'digits_gpt'"):
        train_digit_transformer("digits_gpt")


def _digits_model(name):
    if name == "digits_bert":
        pytest.importorskip("transformers")
        return DigitsBert(depth=2)
    return DigitsViT(depth=2)


@pytest.mark.filterwarnings("ignore:torch.fx cannot trace:UserWarning")  # the BERT's one warning (HF forward)
@pytest.mark.parametrize("name", ["digits_vit", "digits_bert"])
def test_quantize_model_alone_quantizes_attention_exactly_as_onnx_runtime_runs_it(name, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
    from export_helpers import teacher_forced_mismatches

    torch.manual_seed(0)
    model = qdq.quantize_model(_digits_model(name).eval(), qdq.QuantConfig(target="onnxruntime"))
    attention = [m for m in model.modules() if isinstance(m, QuantScaledDotProductAttention)]
    assert len(attention) == 2
    x = torch.randn(4, 3, 28, 28)
    qdq.calibrate(model, [x], progress=False, method="max")
    for module in attention:  # Q, K, the softmax output and V: int8 inputs of both matmuls
        assert all(q.is_enabled and q.amax is not None for q in module.quantizers().values())
    path = qdq.export_onnx(model, x, tmp_path / f"{name}.onnx")
    assert teacher_forced_mismatches(model, path, x) == {}

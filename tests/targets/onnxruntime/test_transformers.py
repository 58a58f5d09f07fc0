"""Transformers on the ``"onnxruntime"`` target, end to end: a small Hugging Face BERT and a small timm ViT, their
attention captured with the explicit API, quantized for ONNX Runtime, exported and run.

What ONNX Runtime makes of the graph (its optimized graph): every Linear and both attention matmuls in int8
kernels (the Linears as ``QGemm``, bias and output quantizer inside), no LayerNorm fused with its residual add
(ORT's ``SkipLayerNormalization`` is the slower form) and no QuantizeLinear / DequantizeLinear without an int8
kernel behind it (``FusionReport.idle``). What it computes: every quantizer within one step of PyTorch's on the same
input (teacher forced) and the float ops between quantizers equal to float rounding (and int32 biases).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import qdq
from qdq.graphs.onnx_tags import qdq_sites
from qdq.runtime.ort import fusion_report, inference_session, session_options

sys.path.insert(0, str(Path(__file__).parents[2] / "export"))
sys.path.insert(0, str(Path(__file__).parents[2]))
from export_helpers import float_segment_errors, teacher_forced_mismatches

from transformer_models import random_biases

# Hugging Face modules torch.fx cannot trace warn once per level (collapsing them is the placement's business)
pytestmark = pytest.mark.filterwarnings("ignore:torch.fx cannot trace")


def optimized_graph(path: Path, tmp_path: Path) -> onnx.GraphProto:
    optimized = tmp_path / "optimized.onnx"
    inference_session(path, session_options(threads=1, optimized_model_path=str(optimized)))
    return onnx.load(str(optimized)).graph


def bert():
    tf = pytest.importorskip("transformers")
    from qdq.nn.huggingface import capture_hf_attention

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, num_labels=3)  # fmt: skip
    model = tf.BertForSequenceClassification(config).eval()
    random_biases(model, std=0.1, seed=3)
    capture_hf_attention(model)
    ids = torch.randint(0, 60, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, 10:] = 0  # padding: the attention mask is a real mask
    return model, {"input_ids": ids, "attention_mask": mask}, 2


def vit():
    timm = pytest.importorskip("timm")
    from qdq.nn.attention import replace_sdpa_calls, use_fused_attention

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8,
                              depth=2).eval()  # fmt: skip
    random_biases(model, std=0.1, seed=3)
    use_fused_attention(model)
    traced = torch.fx.symbolic_trace(model)
    replace_sdpa_calls(traced)
    return traced, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), 2


@pytest.mark.parametrize("make", [bert, vit], ids=["bert", "vit"])
def test_transformer_runs_in_int8_kernels_and_agrees_per_quantizer(make, tmp_path):
    model, example, layers = make()
    quantized = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    qdq.calibrate(quantized, [example], progress=False, method="max")
    path = qdq.export_onnx(quantized, example, tmp_path / "model.onnx", target="onnxruntime")

    # BERT's key and value biases folded at placement (attention_biases): their Gemms have no bias, the others do.
    # The ViT was traced before quantize_model: its attention modules are gone (nothing to probe), none folded.
    exported = onnx.load(str(path))
    nodes = exported.graph.node
    float_biased = {n.name.removesuffix("/bias_Add") for n in nodes if n.name.endswith("/bias_Add")}
    gemms = [n for n in nodes if n.op_type == "Gemm" and n.name not in float_biased]
    assert sum(len(n.input) < 3 or not n.input[2] for n in gemms) == (2 * layers if make is bert else 0)

    report = fusion_report(path, threads=1)
    linears = sum(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert report.n_float == 0  # every Linear and attention matmul in an int8 kernel
    packed = 2 * layers if make is vit else 0  # timm's packed qkv Linear: one Gemm per part (packed_projections)
    assert report.n_int8 == linears + packed + 2 * layers + (1 if make is vit else 0)  # + the patch-embedding conv
    assert report.count("QGemm") >= linears + packed - layers  # as QGemm (BERT's attention output: see gemm.py)
    g = optimized_graph(path, tmp_path)
    ops = collections.Counter(n.op_type for n in g.node)
    assert ops["Where"] <= 1  # the attention masks became Adds (one Where left on the mask's own size)
    assert ops["Split"] == 0  # no float cut of a packed projection's output
    # fc1's bias is a float Add before the Reshape back (float_biases): not QGemm's int32 bias, not ORT's BiasGelu
    assert ops["Gelu"] == layers and ops["BiasGelu"] == 0
    # every LayerNorm apart from its residual add (layernorms): ORT's SkipLayerNormalization is the slower form
    assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] == 2 * layers + 1
    if make is bert:
        assert report.idle == ()
    else:  # the patch embedding's conv output and the class-token concat: once per image, before block 0
        assert len(report.idle) <= 3 and all("blocks" not in u.name for u in report.idle)

    # the softmax scale (1/4 for BERT's head size 16, 1/8 for ViT's 64) folded into the query's QuantizeLinear:
    # no Mul after Q·Kᵀ (nor before the query's Q) in the file, and none in ORT's graph
    producer = {out: n.op_type for n in nodes for out in n.output}
    assert not [n for n in nodes if n.op_type == "Mul" and producer.get(n.input[0]) == "MatMul"]
    scaled = [s for s in qdq_sites(exported) if s.input_scale != 1.0]
    assert len(scaled) == layers and all(s.quantizer.endswith("query_quantizer") for s in scaled)
    assert ops["Mul"] == 0

    assert teacher_forced_mismatches(quantized, path, example) == {}
    # float rounding, plus the int32 biases of QGemm (at most s_x * s_w / 2 each)
    assert max(float_segment_errors(quantized, path, example).values()) < 1e-4
    with torch.no_grad():
        expected = quantized(**example) if isinstance(example, dict) else quantized(example)
    expected = (expected.logits if hasattr(expected, "logits") else expected).numpy()
    feed = {k: v.numpy() for k, v in example.items()} if isinstance(example, dict) else {"input": example.numpy()}
    got = inference_session(path, session_options(threads=1)).run(None, feed)[0]
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))

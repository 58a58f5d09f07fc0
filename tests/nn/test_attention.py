"""QuantScaledDotProductAttention: F.scaled_dot_product_attention when disabled, a numpy fake-quant reference
when quantizing, each quantizer on its own, ONNX as MatMul/Softmax/MatMul with Q/DQ, and replace_sdpa_calls."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qdq.errors import QdqConfigError
from qdq.nn.attention import ATTENTION_QUANTIZERS, QuantScaledDotProductAttention, replace_sdpa_calls
from reference import fake_quant_np


def _qkv(batch=2, heads=4, length=6, source=7, dim=8, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, length, dim, generator=g)
    k = torch.randn(batch, kv_heads, source, dim, generator=g)
    v = torch.randn(batch, kv_heads, source, dim + 2, generator=g)
    return q, k, v


def _disabled() -> QuantScaledDotProductAttention:
    return QuantScaledDotProductAttention(quantize=())


def _bool_mask(length, source):
    return torch.rand(length, source, generator=torch.Generator().manual_seed(1)) > 0.3


MASKS = {
    "none": lambda length, source: {},
    "bool": lambda length, source: {"attn_mask": _bool_mask(length, source)},
    "float_broadcast": lambda length, source: {"attn_mask": torch.randn(2, 1, length, source)},
    "causal": lambda length, source: {"is_causal": True},
    "scale": lambda length, source: {"scale": 0.37},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MASKS))
def test_disabled_equals_the_torch_function(case):
    q, k, v = _qkv()
    kwargs = MASKS[case](q.shape[-2], k.shape[-2])
    if case == "bool":  # a row with every key masked is NaN in both; keep one key per row
        kwargs["attn_mask"][:, 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = _disabled()(q, k, v, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_disabled_grouped_query_attention_equals_the_torch_function():
    q, k, v = _qkv(heads=4, kv_heads=2)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(_disabled()(q, k, v, enable_gqa=True), expected, rtol=1e-5, atol=1e-6)


def test_dropout_in_train_mode_is_the_functions_dropout():
    """With the same seed, the math kernel of F.scaled_dot_product_attention drops the same probabilities."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv()
    torch.manual_seed(7)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(7)
    got = _disabled().train()(q, k, v, dropout_p=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v))


def _reference(q, k, v, amax, mask=None, scale=None, quantized=ATTENTION_QUANTIZERS):
    """numpy: fake-quant Q, K, V and the probabilities (qdq's formula, tests/reference.py), float64 math."""
    fq = {name: (lambda x, a=amax[name]: fake_quant_np(x, a)) if name in quantized else (lambda x: x)
          for name in ATTENTION_QUANTIZERS}  # fmt: skip
    qn, kn, vn = fq["query_quantizer"](q.numpy()), fq["key_quantizer"](k.numpy()), fq["value_quantizer"](v.numpy())
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.matmul(qn.astype(np.float64), np.swapaxes(kn, -1, -2).astype(np.float64)) * scale
    if mask is not None:
        scores = np.where(mask.numpy(), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    probs = fq["probs_quantizer"](probs.astype(np.float32))
    return np.matmul(probs.astype(np.float64), vn.astype(np.float64)), probs


AMAX = {"query_quantizer": 2.0, "key_quantizer": 2.5, "probs_quantizer": 1.0, "value_quantizer": 1.5}


@pytest.mark.parametrize("quantized", [ATTENTION_QUANTIZERS, ("query_quantizer", "key_quantizer"), ("probs_quantizer",),
                                       ("value_quantizer",)])  # fmt: skip
def test_quantizing_equals_an_independent_fake_quant_reference(quantized):
    q, k, v = _qkv()
    mask = torch.rand(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(2)) > 0.2
    mask[:, 0] = True
    module = QuantScaledDotProductAttention(quantize=quantized)
    for name, quantizer in module.quantizers().items():
        quantizer.amax = AMAX[name]
    got, probs = module(q, k, v, attn_mask=mask, return_probs=True)
    expected, expected_probs = _reference(q, k, v, AMAX, mask, quantized=quantized)
    # float32 vs float64 scores can put a probability on the other side of a rounding boundary: one step
    # (1/127) of the probabilities at a few places, nothing else
    step = AMAX["probs_quantizer"] / 127 if "probs_quantizer" in quantized else 0.0
    moved = np.abs(probs.numpy() - expected_probs) > 1e-6
    assert moved.mean() < 0.01
    assert np.abs(probs.numpy() - expected_probs).max() <= step + 1e-6
    bound = step * np.abs(v.numpy()).max() * max(1, int(moved.sum(axis=-1).max())) + 1e-5
    assert np.abs(got.numpy() - expected).max() <= bound
    assert np.abs(got.numpy() - expected)[~moved.any(axis=-1)].max() <= 1e-5


def test_each_quantizer_quantizes_its_own_tensor_exactly():
    q, k, v = _qkv()
    module = QuantScaledDotProductAttention()
    for name, quantizer in module.quantizers().items():
        quantizer.amax = AMAX[name]
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (args[0], out)

        return hook

    for name, quantizer in module.quantizers().items():
        quantizer.register_forward_hook(record(name))
    module(q, k, v)
    for name, (inp, out) in seen.items():
        np.testing.assert_array_equal(out.numpy(), fake_quant_np(inp.numpy(), AMAX[name]))
    assert seen["query_quantizer"][0] is q and seen["value_quantizer"][0] is v and seen["key_quantizer"][0] is k
    assert float(seen["probs_quantizer"][0].sum(-1).mean()) == pytest.approx(1.0)


def test_bad_arguments_raise():
    q, k, v = _qkv()
    with pytest.raises(QdqConfigError, match="quantizers are"):
        QuantScaledDotProductAttention(quantize=("scores_quantizer",))
    with pytest.raises(QdqConfigError, match="is_causal"):
        _disabled()(q, k, v, attn_mask=torch.ones(6, 7, dtype=torch.bool), is_causal=True)
    q3, k3, v3 = _qkv(heads=3, kv_heads=2)
    with pytest.raises(QdqConfigError, match="multiple"):
        _disabled()(q3, k3, v3, enable_gqa=True)


class CallsTheFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask, scale=0.5).transpose(1, 2).flatten(2)


def test_replace_sdpa_calls_keeps_every_argument():
    model = CallsTheFunction().eval()
    gm = torch.fx.symbolic_trace(model)
    assert replace_sdpa_calls(gm) == ["quant_attention"]
    x, mask = torch.randn(3, 5, 8), torch.randn(3, 1, 5, 5)
    for quantizer in gm.quant_attention.quantizers().values():
        quantizer.disable()
    torch.testing.assert_close(gm(x, mask), model(x, mask), rtol=1e-5, atol=1e-6)
    assert replace_sdpa_calls(gm) == []  # nothing left to replace


@pytest.mark.parametrize("dynamo", [True, False])
def test_exports_as_matmul_softmax_matmul_with_qdq(tmp_path, dynamo):
    import onnx
    import onnxruntime as ort

    from qdq.export import export_onnx, qdq_sites

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = QuantScaledDotProductAttention()

        def forward(self, q, k, v, mask):
            return self.attention(q, k, v, attn_mask=mask)

    model = Wrapper().eval()
    for name, quantizer in model.attention.quantizers().items():
        quantizer.amax = AMAX[name]
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 6, 7)
    path = export_onnx(model, (q, k, v, mask), tmp_path / "a.onnx", target="tensorrt", dynamo=dynamo)
    proto = onnx.load(str(path))
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["MatMul"] == 2 and ops["Softmax"] == 1
    assert not {"Attention", "MultiHeadAttention", "ScaledDotProductAttention"} & set(ops)
    sites = {name for site in qdq_sites(proto) for name in site.quantizers}
    assert sites == {f"attention.{name}" for name in ATTENTION_QUANTIZERS}
    consumers = {n.op_type for n in proto.graph.node for i in n.input
                 if any(i == d.output[0] for d in proto.graph.node if d.op_type == "DequantizeLinear")}  # fmt: skip
    assert consumers <= {"MatMul", "Transpose"}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = dict(zip(["input_0", "input_1", "input_2", "input_3"], (t.numpy() for t in (q, k, v, mask))))
    (out,) = session.run(None, feed)
    with torch.no_grad():
        expected = model(q, k, v, mask).numpy()
    probs_step = AMAX["probs_quantizer"] / 127
    assert np.abs(out - expected).max() <= probs_step * float(np.abs(fake_quant_np(v.numpy(), 1.5)).max()) + 1e-5
    assert np.mean(np.abs(out - expected) < 1e-5) > 0.97


@pytest.mark.parametrize("dim", [4, 16, 64])
def test_scale_on_the_query_is_the_same_attention_for_a_power_of_two_scale(dim):
    """``scale_query`` (the onnxruntime target): ``query_quantizer(Q · s) · Kᵀ`` with the query's range scaled
    by s (what max calibration then finds) equals ``(query_quantizer(Q) · Kᵀ) · s`` bit for bit when
    s = 1/sqrt(dim) is a power of two: the quantizer sees its input and range scaled by the same power of two."""
    q, k, v = _qkv(dim=dim)
    factor = 1 / np.sqrt(dim)
    outputs = {}
    for scale_query in (False, True):
        module = QuantScaledDotProductAttention()
        module.scale_query = scale_query
        for name, quantizer in module.quantizers().items():
            quantizer.amax = AMAX[name] * (factor if scale_query and name == "query_quantizer" else 1.0)
        outputs[scale_query] = module(q, k, v, return_probs=True)
    for plain, scaled in zip(outputs[False], outputs[True]):
        torch.testing.assert_close(scaled, plain, rtol=0, atol=0)  # the plain form: checked against numpy above


def test_scale_on_the_query_without_quantizers_is_the_function():
    q, k, v = _qkv(dim=12)  # 1/sqrt(12): not a power of two, float rounding only
    module = _disabled()
    module.scale_query = True
    torch.testing.assert_close(module(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)

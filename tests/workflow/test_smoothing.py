"""SmoothQuant-style input smoothing: the float function is unchanged, outlier channels' quantization error
drops to what a numpy computation of the same recipe gives, LayerNorm folds are exact or undone, and the
export computes what PyTorch computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from qdq.errors import QdqConfigError
from qdq.workflow.post_training import disabled_quantizers
from qdq.workflow.smoothing import smooth_inputs, smoothing_scales
from reference import fake_quant_np

OUTLIERS = (2, 11)


def _outlier_inputs(n=512, channels=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, generator=g)
    x[:, OUTLIERS] *= 40.0  # two channels 40x the others, as in LLM / BERT activations
    return x


def _numpy_error(x, weight, bias, alpha):
    """RMS error of the int8 layer vs float, computed in numpy: per-tensor max input range, per-row weights."""
    x, w, b = x.numpy().astype(np.float32), weight.numpy().astype(np.float32), bias.numpy()
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if alpha is not None:
        s = np.abs(x).max(0) ** alpha / np.abs(w).max(0) ** (1 - alpha)
        x, w = (x * (1 / s).astype(np.float32)).astype(np.float32), (w * s).astype(np.float32)
    xq = fake_quant_np(x, np.abs(x).max())
    wq = fake_quant_np(w, np.abs(w).max(axis=1, keepdims=True))
    got = xq.astype(np.float64) @ wq.T.astype(np.float64) + b
    return float(np.sqrt(np.mean((got - exact) ** 2)))


def test_smoothing_lowers_the_error_of_a_layer_with_outlier_channels_as_computed_independently():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = _outlier_inputs()
    exact = x.double() @ weight.double().T + bias.double()

    plain = qdq.quantize_model(nn.Sequential(nn.Linear(16, 8)))
    plain[0].load_state_dict(layer.state_dict(), strict=False)
    qdq.calibrate(plain, [x], progress=False, method="max")
    with torch.no_grad():
        plain_error = float((plain(x).double() - exact).pow(2).mean().sqrt())

    smoothed = qdq.quantize_model(nn.Sequential(nn.Linear(16, 8)))
    smoothed[0].load_state_dict(layer.state_dict(), strict=False)
    result = smooth_inputs(smoothed, [x], alpha=0.5)
    assert result.pre_quant_scaled == ["0"] and not result.folded
    qdq.calibrate(smoothed, [x], progress=False, method="max")
    with torch.no_grad():
        smoothed_error = float((smoothed(x).double() - exact).pow(2).mean().sqrt())

    assert plain_error == pytest.approx(_numpy_error(x, weight, bias, None), rel=1e-3)
    assert smoothed_error == pytest.approx(_numpy_error(x, weight, bias, 0.5), rel=1e-3)
    assert smoothed_error < 0.5 * plain_error  # the measured effect: about 3x lower here


def test_scales_follow_the_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    weight = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smoothing_scales(act, weight, 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))  # 1 where a max is 0
    torch.testing.assert_close(smoothing_scales(act, weight, 0.0), 1 / torch.tensor([1.0, 4.0, 1.0, 1.0]))
    with pytest.raises(QdqConfigError, match="alpha"):
        smoothing_scales(act, weight, 1.5)


class PreNormBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))) and a q/k pair reading one LayerNorm: both fold (norm feeds only Linears)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.q, self.k = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.q(h) * torch.sigmoid(self.k(h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class PostNormBlock(PreNormBlock):
    """The LayerNorm output also feeds the residual: a fold would change the function."""

    def forward(self, x):
        h = self.norm1(x)
        return h + self.q(h) * torch.sigmoid(self.k(h))


def _with_outliers(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for norm in (model.norm1, model.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.weight[list(OUTLIERS)] = 30.0
    return model


@pytest.mark.parametrize("block", [PreNormBlock, PostNormBlock])
def test_float_function_is_unchanged_and_folds_are_exact_or_undone(block):
    model = qdq.quantize_model(_with_outliers(block()).eval())
    data = [torch.randn(4, 5, 16) for _ in range(2)]
    with disabled_quantizers(model), torch.no_grad():
        before = [model(x) for x in data]
    result = smooth_inputs(model, data)
    with disabled_quantizers(model), torch.no_grad():
        for x, expected in zip(data, before):
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    if block is PreNormBlock:
        assert result.folded == {"norm1": ["q", "k"], "norm2": ["fc1"]}
        assert result.pre_quant_scaled == ["fc2"]
        torch.testing.assert_close(result.scales["q"], result.scales["k"])
    else:
        assert result.folded == {} and sorted(result.pre_quant_scaled) == ["k", "q"]
    assert "folded into" in result.table() or block is PostNormBlock


def test_smoothed_model_exports_what_pytorch_computes(tmp_path):
    from qdq.runtime.ort import inference_session

    model = qdq.quantize_model(_with_outliers(PreNormBlock()).eval())
    data = [torch.randn(4, 5, 16) for _ in range(2)]
    smooth_inputs(model, data)
    qdq.calibrate(model, data, progress=False, method="max")
    path = qdq.export_onnx(model, data[0], tmp_path / "s.onnx", target="tensorrt")
    session = inference_session(path)  # qdq's: int8 weights as uint8 where this CPU's int8 kernels saturate
    (out,) = session.run(None, {"input": data[1].numpy()})
    with torch.no_grad():
        expected = model(data[1]).numpy()
    assert np.abs(out - expected).max() <= 1e-4 * np.abs(expected).max()


def test_nothing_to_smooth_is_an_error():
    with pytest.raises(QdqConfigError, match="quantize the model first"):
        smooth_inputs(nn.Sequential(nn.Linear(2, 2)), [torch.randn(1, 2)])

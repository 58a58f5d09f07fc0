"""Quantizer settings that need care at export, errors, and export hygiene.

Each setting is exported with both exporters and compared with PyTorch at every quantizer output, bit for
bit: narrow range, a zero/tiny amax (the seed exported scale 1 and disagreed), unsigned, learned range,
pre-quantization scale, fp16. Then: the errors (uncalibrated quantizer, per-channel below opset 13,
non-8-bit), the model left as it was, atomic writes, and ``import qdq`` not importing onnx.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
from export_helpers import (
    calibrate_max,
    inexact_quantizers,
    onnx_quantizer_outputs,
    quantizer_outputs,
    run_ort,
    steps_apart,
)
from torch import nn

import qdq
from qdq import nn as qnn
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqExportError
from qdq.export import export_onnx, onnx_opset, qdq_sites
from qdq.quantizer import TensorQuantizer
from qdq.targets import Target

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
#: A target without an ONNX rewrite: the graph exactly as traced, for settings no registered target exports as
#: they are (unsigned quantizers: not for TensorRT; float16 models: TensorRT refuses their Casts after DQs).
PLAIN = Target("plain", description="the traced Q/DQ graph, unchanged")


def two_convs(desc_in: QuantDescriptor | None = None, desc_w: QuantDescriptor | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        qnn.QuantConv2d(3, 8, 3, padding=1, quant_desc_input=desc_in, quant_desc_weight=desc_w),
        nn.ReLU(),
        qnn.QuantConv2d(8, 4, 3, quant_desc_input=desc_in, quant_desc_weight=desc_w),
    ).eval()


def w4a8() -> nn.Module:
    model = two_convs(QuantDescriptor(), QuantDescriptor(num_bits=4, axis=0))
    calibrate_max(model, X)
    return model


def w4_clipped() -> nn.Module:
    """4-bit weights with a range below their max (percentile-like): the int8 Q/DQ must saturate at +-8/7."""
    model = two_convs(QuantDescriptor(num_bits=6), QuantDescriptor(num_bits=4, axis=0))
    calibrate_max(model, X)
    model[0]._weight_quantizer.amax = model[0]._weight_quantizer.amax * 0.6
    model[0]._input_quantizer.amax = 0.7
    return model


def narrow() -> nn.Module:
    model = two_convs(QuantDescriptor(narrow_range=True), QuantDescriptor(axis=0, narrow_range=True))
    calibrate_max(model, X)
    model[0]._input_quantizer.amax = 0.5  # clips: -0.5 must give -127 steps, not -128
    return model


def tiny_amax() -> nn.Module:
    model = two_convs()
    calibrate_max(model, X)
    amax = model[0]._weight_quantizer.amax.clone()
    amax[2, 0, 0, 0] = 0.0  # a dead channel: its weights are not zero, PyTorch gives zeros
    model[0]._weight_quantizer.amax = amax
    with torch.no_grad():
        model[0].weight[2] = 0.7
    model[2]._input_quantizer.amax = 1e-30  # a collapsed activation range: all zeros
    return model


def unsigned() -> nn.Module:
    model = two_convs()
    calibrate_max(model, X)
    model[2]._input_quantizer.unsigned = True  # after ReLU
    return model


def learned() -> nn.Module:
    model = two_convs(QuantDescriptor(learn_amax=True, amax=1.5))
    calibrate_max(model, X)
    with torch.no_grad():
        model[0]._input_quantizer.clip.clip_value_max.fill_(1.2)
        model[0]._input_quantizer.clip.clip_value_min.fill_(-0.9)
    return model


def pre_quant_scale() -> nn.Module:
    model = two_convs()
    model[0]._input_quantizer.pre_quant_scale = torch.tensor([0.5, 2.0, 1.0]).view(1, 3, 1, 1)
    calibrate_max(model, X)
    return model


FEATURES = [w4a8, w4_clipped, narrow, tiny_amax, unsigned, learned, pre_quant_scale]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("build", FEATURES, ids=[f.__name__ for f in FEATURES])
def test_setting_exports_bit_exact(tmp_path, build, dynamo):
    model = build()
    target = PLAIN if build is unsigned else None  # TensorRT has no uint8: the tensorrt target refuses it
    path = export_onnx(model, X, tmp_path / "m.onnx", dynamo=dynamo, target=target)
    assert inexact_quantizers(quantizer_outputs(model, X), onnx_quantizer_outputs(path, X)) == {}
    with torch.no_grad():
        reference = model(X).numpy()
    assert steps_apart(reference, run_ort(path, X, optimize=False)) < 1e-3  # float accumulation order only


def test_tiny_amax_gives_zeros_in_onnx(tmp_path):
    model = tiny_amax()
    path = export_onnx(model, X, tmp_path / "m.onnx", dynamo=False)
    values = onnx_quantizer_outputs(path, X)
    assert not values["2._input_quantizer"].any()
    assert not values["0._weight_quantizer"][2].any()


def test_unsigned_exports_uint8_zero_point(tmp_path):
    path = export_onnx(unsigned(), X, tmp_path / "m.onnx", dynamo=False, target=PLAIN)
    site = {s.quantizer: s for s in qdq_sites(onnx.load(str(path)))}["2._input_quantizer"]
    assert site.zero_point.dtype == np.uint8 and site.zero_point == 0


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_fp16_model_exports_and_runs(tmp_path, dynamo):
    """A float16 model exports float32 Q/DQ with Casts (which TensorRT refuses: it gets a float16 file from the
    float32 model with target_options={"float": "float16"}, tests/targets/tensorrt)."""
    model = two_convs()
    calibrate_max(model, X)
    model = model.half()
    x = X.half()
    path = export_onnx(model, x, tmp_path / "m.onnx", dynamo=dynamo, target=PLAIN)
    bad = inexact_quantizers(quantizer_outputs(model, x), onnx_quantizer_outputs(path, x))
    # fp16 convolutions accumulate differently in torch and ORT: only quantizers fed directly are exact
    assert set(bad) <= {"2._input_quantizer"}
    step = float(model[2]._input_quantizer.step_size)
    assert all(error <= step + 2e-3 for error in bad.values())  # one step, plus fp16 rounding
    out = run_ort(path, x)
    assert out.dtype == np.float16
    with torch.no_grad():
        assert steps_apart(model(x).numpy(), out) <= 1.0


def test_bf16_model_exports_at_opset_22(tmp_path):
    model = two_convs()
    calibrate_max(model, X)
    model = model.to(torch.bfloat16)
    path = export_onnx(model, X.bfloat16(), tmp_path / "m.onnx", dynamo=True, opset=22, target=PLAIN)
    proto = onnx.load(str(path))
    assert onnx_opset(proto) == 22 and len(qdq_sites(proto)) == 4
    assert {s.step.dtype for s in qdq_sites(proto)} == {np.dtype(np.float32)}  # Q/DQ in float32, with Casts
    with pytest.raises(QdqExportError, match="opset >= 22"):  # the TorchScript exporter stops at opset 20
        export_onnx(model, X.bfloat16(), tmp_path / "m2.onnx", dynamo=False, target=PLAIN)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_uncalibrated_quantizer_is_named(tmp_path, dynamo):
    model = nn.Sequential(nn.Sequential(two_convs()))
    calibrate_max(model, X)
    model[0][0][2]._input_quantizer.amax = None
    with pytest.raises(QdqExportError, match=r"(?i)0\.0\.2\._input_quantizer has no amax.*calibrate"):
        export_onnx(model, X, tmp_path / "m.onnx", dynamo=dynamo)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.trt_rules_exempt(
    "weighted-op-inputs",
    reason="a disabled input quantizer leaves a Conv with a float input and int8 weights (warned at export)",
)
def test_disabled_or_unused_uncalibrated_quantizers_are_fine(tmp_path):
    model = two_convs()
    calibrate_max(model, X)
    model[2]._input_quantizer.amax = None
    model[2]._input_quantizer.disable()
    model[0].unused = TensorQuantizer()  # never called
    with pytest.warns(UserWarning, match=r"1 Conv/Gemm/MatMul.*2\._weight_quantizer.*TensorRT runs them in float"):
        path = export_onnx(model, X, tmp_path / "m.onnx", dynamo=False)
    names = {s.quantizer for s in qdq_sites(onnx.load(str(path)))}
    assert names == {"0._input_quantizer", "0._weight_quantizer", "2._weight_quantizer"}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_per_channel_below_opset_13_is_refused(tmp_path, dynamo):
    model = two_convs()
    calibrate_max(model, X)
    with pytest.raises(QdqExportError, match=r"opset >= 13.*0\._weight_quantizer"):
        export_onnx(model, X, tmp_path / "m.onnx", opset=12, dynamo=dynamo)


def test_per_tensor_exports_at_opset_12(tmp_path):
    model = two_convs(desc_w=QuantDescriptor())
    calibrate_max(model, X)
    path = export_onnx(model, X, tmp_path / "m.onnx", opset=12, dynamo=False)
    assert onnx_opset(path) == 12
    assert steps_apart(model(X).detach().numpy(), run_ort(path, X)) <= 1.0


def test_dynamo_reports_the_opset_it_wrote(tmp_path):
    model = two_convs()
    calibrate_max(model, X)
    with pytest.warns(UserWarning, match="opset 13.*opset 18"):
        path = export_onnx(model, X, tmp_path / "m.onnx", opset=13, dynamo=True)
    assert onnx_opset(path) == 18


def test_more_than_8_bits_is_refused(tmp_path):
    model = two_convs(QuantDescriptor(num_bits=10))
    calibrate_max(model, X)
    with pytest.raises(QdqExportError, match="10 bits"):
        export_onnx(model, X, tmp_path / "m.onnx", dynamo=False)


def test_w4_max_calibrated_weights_need_no_clamp(tmp_path):
    model = w4a8()
    path = export_onnx(model, X, tmp_path / "m.onnx", dynamo=False)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Min" not in ops and "Max" not in ops  # weights are within +-7 steps already
    site = {s.quantizer: s for s in qdq_sites(onnx.load(str(path)))}["0._weight_quantizer"]
    w = model[0].weight.detach()
    np.testing.assert_allclose(site.step, (w.abs().amax(dim=(1, 2, 3)) / 7).numpy(), rtol=1e-6)


def test_export_leaves_the_model_as_it_was(tmp_path):
    model = two_convs().train()
    calibrate_max(model, X)
    model.train()
    model[0]._input_quantizer._if_calib = True  # calibrating: must be off while exporting, back after
    model[0]._input_quantizer._calibrator = _CountingCalibrator()
    with torch.no_grad():
        before = model.eval()(X)
    model.train()
    export_onnx(model, X, tmp_path / "m.onnx", dynamo=False)
    assert model.training
    assert model[0]._input_quantizer._if_calib
    assert model[0]._input_quantizer._calibrator.calls == 1  # only our own forward above
    assert all("export_fn" not in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(before, model.eval()(X))


class _CountingCalibrator:
    def __init__(self) -> None:
        self.calls = 0

    def collect(self, x: torch.Tensor) -> None:
        self.calls += 1


def test_write_is_atomic_and_self_contained(tmp_path):
    model = two_convs()
    calibrate_max(model, X)
    target = tmp_path / "sub" / "m.onnx"
    target.parent.mkdir()
    target.write_bytes(b"old")
    assert export_onnx(model, X, target, dynamo=True) == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.onnx"]
    proto = onnx.load(str(target))
    assert proto.graph.initializer and all(not t.external_data for t in proto.graph.initializer)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["qdq.target"] == "tensorrt"


def test_import_qdq_does_not_import_onnx():
    code = "import sys, qdq, qdq.export, qdq.placement; assert 'onnx' not in sys.modules, 'onnx imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_target(tmp_path):
    with pytest.raises(ValueError, match="target"), warnings.catch_warnings():
        export_onnx(two_convs(), X, tmp_path / "m.onnx", target="tflite")


def test_a4_convs_that_stay_float_keep_their_float_bias(tmp_path):
    """4-bit activations cannot feed ORT's int8 kernels (the clamp sits between Conv and Q): those Convs run in
    float and must keep their exact bias, not one rounded to int32 at s_x*s_w (a few % of a 4-bit step)."""
    from qdq.placement import apply_placement

    a4 = QuantDescriptor(num_bits=4)
    model = apply_placement(two_convs(a4, QuantDescriptor(num_bits=4, axis=0)), target="onnxruntime")
    calibrate_max(model, X)
    with pytest.warns(UserWarning, match="sub-8-bit range before its QuantizeLinear"):
        path = export_onnx(model, X, tmp_path / "m.onnx", target="onnxruntime", dynamo=False)
    graph = onnx.load(str(path)).graph
    assert not [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT32]
    # the biases move to Adds after the Convs, out of reach of ORT's own WeightBiasQuantization pass
    assert sum(n.op_type == "Add" for n in graph.node) == 2
    assert all(len(n.input) == 2 for n in graph.node if n.op_type == "Conv")
    with torch.no_grad():
        reference = model(X).numpy()
    np.testing.assert_array_equal(run_ort(path, X, optimize=False), reference)  # int32 biases: 11 of 288 off
    np.testing.assert_array_equal(run_ort(path, X, optimize=True), reference)


class _MixedConv(nn.Module):
    """MixNet's and GhostNet's family: the channels split (``torch.split``, ``x.chunk``), each part its own conv,
    the parts concatenated."""

    def __init__(self, method: bool) -> None:
        super().__init__()
        self.method = method
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.small, self.large = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 5, padding=2)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        parts = x.chunk(2, dim=1) if self.method else torch.split(x, [4, 4], dim=1)
        return self.head(torch.cat([self.small(parts[0]), self.large(parts[1])], dim=1))


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("method", [False, True])
def test_a_split_into_parts_quantizes_the_parts_and_exports(tmp_path, target, method):
    """The sequence a split returns is no tensor a quantizer can take (a rule moving a conv's input quantizer up
    to it made calibration fail on a tuple); its items are quantized, and the export computes what PyTorch does."""
    torch.manual_seed(0)
    model = qdq.quantize_model(_MixedConv(method).eval(), qdq.QuantConfig(target=target))
    calibrate_max(model, X)
    path = tmp_path / "mixed.onnx"
    export_onnx(model, X, path)
    with torch.no_grad():  # at most one code of the output's quantizer apart (the convs' float summation order)
        assert steps_apart(model(X).numpy(), run_ort(path, X, optimize=False)) <= 1.01


class _TwinHeads(nn.Module):
    """LeViT's classifier and distillation heads at initialization: two norm + linear heads with equal weights on
    one tensor. The dynamo exporter deduplicates their equal weights, then merges the two equal computations into one,
    the two heads' Q/DQ pairs included."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.head = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))
        self.head_dist = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))
        self.head_dist.load_state_dict(self.head.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))
        return (self.head(x) + self.head_dist(x)) / 2


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_equal_heads_the_exporter_merges_export(tmp_path, target):
    torch.manual_seed(0)
    model = qdq.quantize_model(_TwinHeads().eval(), qdq.QuantConfig(target=target))
    calibrate_max(model, X)
    path = tmp_path / "twins.onnx"
    export_onnx(model, X, path, dynamo=True)  # was: "head_dist.1._input_quantizer produced no Q/DQ pair"
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X, optimize=False)) <= 1.01


class _Block(nn.Module):
    """DLA's basic block: one ReLU module called twice (after the first conv, after the residual add)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + x)


class _Tree(nn.Module):
    """DLA's tree: two blocks, their outputs concatenated into a root conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.tree1, self.tree2 = nn.Conv2d(3, 8, 3, padding=1), _Block(8), _Block(8)
        self.root = nn.Sequential(nn.Conv2d(16, 8, 1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.tree1(self.stem(x))
        return self.root(torch.cat([self.tree2(x1), x1], 1))


def test_a_module_called_twice_exports_for_onnx_runtime(tmp_path):
    """torch.export lifts a quantizer's constant twice in a module called twice (torch 2.9: "attribute
    'lifted_tensor_14' already exists", timm's dla34 for onnxruntime); the file is written all the same."""
    torch.manual_seed(0)
    model = qdq.quantize_model(_Tree().eval(), qdq.QuantConfig(target="onnxruntime"))
    calibrate_max(model, X)
    path = tmp_path / "tree.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning, where torch.export fails
        export_onnx(model, X, path)
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X, optimize=False)) <= 1.01


def test_where_torch_export_fails_the_torchscript_exporter_writes_the_file_said_once(tmp_path, monkeypatch):
    from qdq.export import onnx_export

    def broken(*args, **kwargs):
        raise KeyError("attribute 'lifted_tensor_1' already exists")

    monkeypatch.setattr(onnx_export, "_export_dynamo", broken)
    model = two_convs()
    calibrate_max(model, X)
    with pytest.warns(UserWarning, match=r"torch.export could not trace .*lifted_tensor_1.*TorchScript exporter wrote"):
        path = export_onnx(model, X, tmp_path / "m.onnx")
    with torch.no_grad():
        assert steps_apart(model(X).numpy(), run_ort(path, X, optimize=False)) < 1e-3

    monkeypatch.setattr(onnx_export, "_export_torchscript", broken)
    with pytest.raises(QdqExportError, match=r"failed with both exporters: dynamo: KeyError.*TorchScript: KeyError"):
        export_onnx(model, X, tmp_path / "n.onnx")


class _DataDependent(nn.Module):
    """A forward torch.fx cannot trace (a branch on a tensor's value): placement sees only its traceable children."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        if y.abs().sum() > 0:
            y = y * 0.5 + 1.0
        return self.conv2(y)


def test_float_convs_of_a_model_placed_for_onnx_runtime_say_why_not_how_to_quantize(tmp_path):
    with pytest.warns(UserWarning, match="torch.fx cannot trace"):
        model = qdq.quantize_model(_DataDependent().eval(), qdq.QuantConfig(target="onnxruntime"))
    calibrate_max(model, X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(model, X, tmp_path / "m.onnx")
    messages = [str(w.message) for w in caught if "will run in float on ONNX Runtime" in str(w.message)]
    assert len(messages) == 1 and "placement did not reach them" in messages[0]
    assert "qdq.QuantConfig(target='onnxruntime')" not in messages[0]

"""Targets (qdq.targets): the registry, adding a target, the remembered target and the quantize_model contract.

* The registered targets hold their placement rules, residual-add mode, ONNX rewrite and fusion facts; unknown
  names and malformed registrations raise one clear error.
* A new target is one registration: quantize_model places with its rules, export_onnx runs its rewrite.
* A placed model remembers its target; export_onnx defaults to it and refuses another.
* quantize_model always returns the model to use; when placement built a new model, the one passed in is
  stale: running, exporting or placing it again raises, naming the fix.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
from qdq import nn as qnn
from qdq.errors import QdqConfigError, QdqExportError, QdqTypeError
from qdq.export import export_onnx, qdq_sites
from qdq.placement import apply_placement, register_placement_rule, unregister_placement_rule
from qdq.quantizer import TensorQuantizer
from qdq.targets import Target, get_target, register_target, target_names, unregister_target
from qdq.targets.marks import placed_target, superseded_by
from qdq.targets.onnxruntime import ONNXRUNTIME_FUSION

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(11))
ORT_RULES = ("float_recurrent", "residual_add", "conv_output", "silu_gate", "sigmoid_output", "mul_inputs",
             "elementwise_output", "int8_concat", "data_movers", "one_range_per_tensor", "unsigned_activations",
             "attention", "output_tail")  # fmt: skip
TRT_RULES = ("residual_add", "concat", "attention", "output_tail")


class Residual(nn.Module):
    """conv -> bn -> relu, then a residual add of a second conv read by a head conv: both targets place quantizers
    here (a head, so that the add is not the model's output tail)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.conv1(x)))
        return self.head(self.conv2(a) + a)


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return Residual().eval()


def set_ranges(model: nn.Module) -> nn.Module:
    """Store a range in every quantizer (what calibration would do): 4.0 for activations, |w|max for weights."""
    for module in model.modules():
        if isinstance(module, TensorQuantizer):
            module.amax = 4.0
    for module in model.modules():
        if isinstance(module, qnn.QuantConv2d):
            module.weight_quantizer.amax = module.weight.detach().abs().amax(dim=(1, 2, 3), keepdim=True)
    return model


def graph_target(path) -> str:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}["qdq.target"]


# ------------------------------------------------------------------------------------------ registry
def test_registered_targets_hold_their_facts():
    assert target_names() == ("tensorrt", "onnxruntime")
    trt, ort = get_target("tensorrt"), get_target("onnxruntime")
    assert trt.rule_names == TRT_RULES and trt.residual_add == "skip"
    assert ort.rule_names == ORT_RULES and ort.residual_add == "both"
    assert all(callable(r.decide) and r.description for r in ort.placement_rules)  # one function per rule
    assert trt.fusion is None and ort.fusion is ONNXRUNTIME_FUSION
    assert ort.fusion.folded_activations == {"Relu", "Clip"}
    assert ort.fusion.int8_forms["Conv"] == ("QLinearConv", (0, 1))
    assert ort.fusion.dequantized_inputs("Concat", 3) == (0, 1, 2)
    assert ort.fusion.dequantized_inputs("Where", 3) == (1, 2)
    assert not ort.fusion.fuses("Relu")
    from qdq.targets.onnxruntime.rewrite import rewrite_for_onnxruntime
    from qdq.targets.tensorrt.rewrite import rewrite_for_tensorrt

    assert ort.onnx_rewrite is rewrite_for_onnxruntime and trt.onnx_rewrite is rewrite_for_tensorrt
    assert dict(ort.export.options) == {"weights": "auto"} and ort.export.opset is None
    assert dict(trt.export.options) == {"float": "float32"}
    assert {r.runtime: r.verdict for r in trt.runtimes} == {"tensorrt": "native", "openvino": "native",
                                                            "onnxruntime": "runs"}  # fmt: skip
    assert ort.support("tensorrt").verdict == "refuses" and ort.support("onnxruntime").verdict == "native"
    assert trt.rewrite_onnx(onnx.ModelProto()) == {"partly_quantized_ops": 0, "residual_inputs_quantized": 0}  # float32
    with pytest.raises(QdqConfigError, match="no fusion facts"):
        trt.require_fusion()


def test_unknown_target_raises_one_clear_error():
    with pytest.raises(QdqConfigError, match=r"Unknown target 'onnxruntim'.*Registered.*onnxruntime"):
        get_target("onnxruntim")
    with pytest.raises(QdqConfigError, match="Unknown target 'tflite'"):
        qdq.QuantConfig(target="tflite")
    with pytest.raises(QdqConfigError, match="Unknown target 'tflite'"):
        apply_placement(nn.Identity(), target="tflite")
    with pytest.raises(QdqTypeError, match="named by a string"):
        get_target(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": ""}, QdqTypeError, "non-empty string"),
        ({"name": "t", "residual_add": "first"}, QdqConfigError, "residual_add"),
        ({"name": "t", "onnx_rewrite": "qdq.module:function"}, QdqTypeError, "callable"),
        ({"name": "t", "onnx_rewrite": 3}, QdqTypeError, "callable"),
        ({"name": "t", "placement_rules": (1,)}, QdqTypeError, "rule names"),
        ({"name": "t", "placement_rules": ("residual_ad",)}, QdqConfigError, "Unknown placement rule.*residual_add"),
        ({"name": "t", "runtimes": ("tensorrt",)}, QdqTypeError, "RuntimeSupport"),
        ({"name": "t", "fusion": {"Conv": 1}}, QdqTypeError, "FusionFacts"),
    ],
)
def test_malformed_targets_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        Target(**kwargs)


def test_registering_twice_needs_override():
    with pytest.raises(QdqConfigError, match="already registered"):
        register_target(Target("tensorrt"))
    with pytest.raises(QdqTypeError, match="Target"):
        register_target("tensorrt")  # type: ignore[arg-type]


def test_a_placement_rule_joins_the_targets_it_names():
    seen: list[str] = []
    with pytest.raises(QdqConfigError, match="Unknown target"):
        register_placement_rule("test_rule", lambda ctx: None, targets=("tensorrt", "tflite"))
    assert "test_rule" not in get_target("tensorrt").rule_names  # nothing registered on error
    register_placement_rule("test_rule", lambda view: seen.append(view.target.name), targets=("onnxruntime",))
    try:
        assert get_target("onnxruntime").rule_names == (*ORT_RULES, "test_rule")
        assert get_target("tensorrt").rule_names == TRT_RULES
        apply_placement(qdq.quantize_model(fresh()), target="onnxruntime")
        apply_placement(qdq.quantize_model(fresh()), target="tensorrt")
        assert seen == ["onnxruntime"]
    finally:
        unregister_placement_rule("test_rule")
    assert get_target("onnxruntime").rule_names == ORT_RULES


# ------------------------------------------------------------------------------- adding a target
def test_adding_a_target_is_one_registration(tmp_path):
    """A target with the residual-add rule only, quantizing both add inputs, and its own ONNX rewrite."""
    calls: list[int] = []

    def rewrite(model: onnx.ModelProto) -> dict[str, int]:
        calls.append(len(model.graph.node))
        model.doc_string = "rewritten for npu"
        return {"nodes": len(model.graph.node)}

    register_target(Target("npu", "a test accelerator", ("residual_add",), residual_add="both", onnx_rewrite=rewrite))
    try:
        assert "npu" in target_names()
        model = qdq.quantize_model(fresh(), qdq.QuantConfig(target="npu"))
        adds = [m for m in model.modules() if isinstance(m, qnn.QuantAdd)]
        assert len(adds) == 1 and all(q.is_enabled for q in adds[0].input_quantizers)
        assert not any(n.endswith("output_quantizer") for n, _ in model.named_modules())  # no conv_output rule
        assert placed_target(model) == "npu"
        path = export_onnx(set_ranges(model), X, tmp_path / "npu.onnx", dynamo=False)
        assert len(calls) == 1 and graph_target(path) == "npu"
        assert onnx.load(str(path)).doc_string == "rewritten for npu"
    finally:
        unregister_target("npu")
    assert "npu" not in target_names()


# --------------------------------------------------------------------------------- remembered target
def test_placed_model_remembers_its_target_and_export_defaults_to_it(tmp_path):
    model = qdq.quantize_model(fresh(), qdq.QuantConfig(target="onnxruntime"))
    assert isinstance(model, torch.fx.GraphModule) and placed_target(model) == "onnxruntime"
    set_ranges(model)
    path = export_onnx(model, X, tmp_path / "ort.onnx", dynamo=False)
    assert graph_target(path) == "onnxruntime"
    activations = [s for s in qdq_sites(onnx.load(str(path))) if s.quantize is not None]
    assert activations and all(s.zero_point.dtype == np.uint8 for s in activations)  # the ORT rewrite ran
    export_onnx(model, X, tmp_path / "same.onnx", target="onnxruntime", dynamo=False)  # the same target: fine
    with pytest.raises(QdqExportError, match=r"placed for target 'onnxruntime'.*cannot be exported for 'tensorrt'"):
        export_onnx(model, X, tmp_path / "trt.onnx", target="tensorrt", dynamo=False)
    assert not (tmp_path / "trt.onnx").exists()


@pytest.mark.trt_rules_exempt("residual-add", reason="an unplaced model: nothing quantized the add's residual")
def test_unplaced_model_exports_for_tensorrt_by_default_and_for_any_target_on_request(tmp_path):
    model = set_ranges(qdq.quantize_model(fresh()))
    assert placed_target(model) is None
    assert graph_target(export_onnx(model, X, tmp_path / "a.onnx", dynamo=False)) == "tensorrt"
    with pytest.warns(UserWarning, match="run in float on ONNX Runtime"):
        path = export_onnx(model, X, tmp_path / "b.onnx", target="onnxruntime", dynamo=False)
    assert graph_target(path) == "onnxruntime"


def test_the_target_is_found_inside_a_wrapper_and_conflicts_raise():
    placed = qdq.quantize_model(fresh(), qdq.QuantConfig(target="tensorrt"))
    assert placed_target(nn.Sequential(placed, nn.Identity())) == "tensorrt"
    other = qdq.quantize_model(fresh(), qdq.QuantConfig(target="onnxruntime"))
    with pytest.raises(QdqConfigError, match="different targets"):
        placed_target(nn.Sequential(placed, other))
    with pytest.raises(QdqConfigError, match="already placed for target 'tensorrt'"):
        apply_placement(placed, target="onnxruntime")
    assert placed_target(copy.deepcopy(placed)) == "tensorrt"
    assert placed_target(pickle.loads(pickle.dumps(placed))) == "tensorrt"


# ------------------------------------------------------------------------------ quantize_model contract
def test_quantize_model_returns_the_model_to_use():
    model = fresh()
    assert qdq.quantize_model(model) is model  # no target: modules replaced in place
    assert isinstance(model.conv1, qnn.QuantConv2d)
    conv = nn.Conv2d(3, 3, 1)
    assert isinstance(qdq.quantize_model(conv), qnn.QuantConv2d) and type(conv) is nn.Conv2d
    plain = nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU())  # nothing for TensorRT to add: the same model
    placed = qdq.quantize_model(plain, qdq.QuantConfig(target="tensorrt"))
    assert placed is plain and placed_target(plain) == "tensorrt" and superseded_by(plain) is None
    with pytest.raises(QdqTypeError, match="QuantConfig"):
        qdq.quantize_model(fresh(), {"target": "onnxruntime"})  # type: ignore[arg-type]


def test_ignoring_the_returned_model_raises_instead_of_running_convs_in_float(tmp_path):
    """The trap of issue 11: the unplaced model kept by mistake must not run, export or place silently."""
    model = fresh()
    qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))  # return value dropped
    assert superseded_by(model) == "onnxruntime"
    hint = "Use the model returned by quantize_model"
    with pytest.raises(QdqConfigError, match=hint):
        model(X)
    with pytest.raises(QdqExportError, match=hint):
        export_onnx(model, X, tmp_path / "m.onnx", target="onnxruntime", dynamo=False)
    with pytest.raises(QdqExportError, match=hint):
        export_onnx(nn.Sequential(model), X, tmp_path / "m.onnx", dynamo=False)
    with pytest.raises(QdqConfigError, match=hint):
        qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    with pytest.raises(QdqConfigError, match=hint):
        apply_placement(model, target="onnxruntime")
    with pytest.raises(QdqConfigError, match=hint):
        copy.deepcopy(model)(X)
    assert not (tmp_path / "m.onnx").exists()


def test_the_returned_model_runs_and_differs_from_the_stale_one_by_the_added_quantizers():
    model = fresh()
    placed = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    shared = {id(m) for m in model.modules()}
    added = [n for n, m in placed.named_modules() if isinstance(m, TensorQuantizer) and id(m) not in shared]
    assert added  # residual add inputs and the conv output quantizers: what the stale model lacks
    assert superseded_by(placed) is None
    assert placed(X).shape == (2, 4, 8, 8)


def test_importing_the_targets_imports_neither_torch_nor_onnx():
    """Runtimes read a file's target at load: the registry and every target package stay light (their rules
    and passes import torch and onnx when they run)."""
    import subprocess
    import sys

    code = (
        "import sys, qdq.targets, qdq.targets.onnxruntime.rewrite; "
        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

"""The TensorRT rule checker: passes the graphs TensorRT fuses, names the rule each broken graph breaks.

Broken graphs are built by hand (``trt_graphs``), one per rule: each is the valid base graph with one edit,
and the checker must report that rule (at the edited node) — and, for most edits, nothing else.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import torchvision
from export_helpers import calibrate_max
from trt_graphs import BREAKERS, base_model, base_parts

import qdq
from qdq.cli import main
from qdq.errors import QdqConfigError
from qdq.export import export_onnx
from qdq.placement import apply_placement
from qdq.targets.tensorrt.check import check_tensorrt
from qdq.targets.tensorrt.engine_rules import RULES


def test_base_graph_passes_every_rule():
    model = base_model()
    onnx.checker.check_model(model, full_check=True)
    report = check_tensorrt(model)
    assert report.ok, str(report)
    assert (report.qdq_pairs, report.int8_ops) == (5, 2)
    assert "| FAIL" not in str(report) and str(report).count("| PASS") == len(RULES)


def test_every_rule_has_a_broken_graph():
    assert set(BREAKERS) == set(RULES)
    assert len(BREAKERS) >= 8


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_broken_graph_fails_with_its_rule(rule):
    nodes, inits = base_parts()
    model = BREAKERS[rule](nodes, inits)
    report = check_tensorrt(model)
    assert not report.ok
    assert rule in report.rules_broken(), str(report)
    text = str(report)
    assert f"| {rule}" in text and "FAIL" in text
    assert all(v.node and v.message for v in report.violations)


@pytest.mark.parametrize("rule", ["pair-params", "int8-type", "zero-point", "scale", "activation-per-tensor",
                                  "weight-axis", "weighted-op-inputs", "residual-add", "fused-scales",
                                  "fp32-island"])  # fmt: skip
def test_broken_graph_breaks_only_its_rule(rule):
    nodes, inits = base_parts()
    report = check_tensorrt(BREAKERS[rule](nodes, inits))
    assert report.rules_broken() == {rule}, str(report)


def test_violations_name_the_node():
    nodes, inits = base_parts()
    report = check_tensorrt(BREAKERS["weight-axis"](nodes, inits))
    assert [v.node for v in report.violations] == ["w1/DQ"]
    assert "axis 1" in report.violations[0].message and "axis 0" in report.violations[0].message
    nodes, inits = base_parts()
    report = check_tensorrt(BREAKERS["residual-add"](nodes, inits))
    assert [v.node for v in report.violations] == ["add"]


def test_fp32_island_counts_and_allow_list():
    nodes, inits = base_parts()
    model = BREAKERS["fp32-island"](nodes, inits)
    report = check_tensorrt(model)
    assert (report.fp32_outside, report.fp32_allowed) == (1, 0)
    assert report.compute["float32"] == 1
    assert check_tensorrt(model, fp32_ops={"Relu"}).ok
    meta = model.metadata_props.add()
    meta.key, meta.value = "qdq.float.fp32_nodes", json.dumps({"relu": "kept on purpose"})
    recorded = check_tensorrt(model)
    assert recorded.ok and (recorded.fp32_outside, recorded.fp32_allowed) == (0, 1)


def test_convtranspose_weights_quantized_on_axis_zero():
    """TensorRT's deconvolution takes per-input-channel weight scales (axis 0), unlike Conv's output axis."""
    from onnx import helper, numpy_helper

    def model(axis: int) -> onnx.ModelProto:
        w = numpy_helper.from_array(np.ones((4, 2, 3, 3), np.float32), "w")
        s = numpy_helper.from_array(np.full(4 if axis == 0 else 2, 0.1, np.float32), "s")
        z = numpy_helper.from_array(np.zeros(4 if axis == 0 else 2, np.int8), "z")
        sx, zx = numpy_helper.from_array(np.float32(0.1), "sx"), numpy_helper.from_array(np.int8(0), "zx")
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
            helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"], axis=axis),
            helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], name="w/DQ", axis=axis),
            helper.make_node("ConvTranspose", ["xd", "wd"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 5, 5])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 7, 7])],
            [w, s, z, sx, zx],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])

    assert check_tensorrt(model(0)).ok
    assert check_tensorrt(model(1)).rules_broken() == {"weight-axis"}


def test_onnxruntime_target_export_fails_with_uint8_rules(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = apply_placement(qdq.quantize_model(torchvision.models.resnet18(num_classes=10)), target="onnxruntime")
    calibrate_max(model, x)
    path = export_onnx(model, x, tmp_path / "ort.onnx", target="onnxruntime")
    report = check_tensorrt(path)
    assert {"int8-type", "zero-point"} <= report.rules_broken()


# every model through the TorchScript exporter (6 s each); the default, dynamo, on the ResNet (25 s each here: on
# all three it added a minute of CPU to CI, and the placement is the exporters' common part)
_EXPORTS = {
    "resnet50-dynamo": ("resnet50", True),
    "resnet50-torchscript": ("resnet50", False),
    "mobilenet_v2-torchscript": ("mobilenet_v2", False),
    "efficientnet_b0-torchscript": ("efficientnet_b0", False),
}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dynamo"), list(_EXPORTS.values()), ids=list(_EXPORTS))
def test_tensorrt_target_exports_pass(tmp_path, name, dynamo):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    float_model = getattr(torchvision.models, name)(num_classes=10)
    model = apply_placement(qdq.quantize_model(float_model), target="tensorrt")
    calibrate_max(model, x)
    path = export_onnx(model.eval(), x, tmp_path / f"{name}.onnx", target="tensorrt", dynamo=dynamo)
    report = check_tensorrt(path)
    assert report.ok, str(report)
    assert report.int8_ops > 0 and report.qdq_pairs > 0


def test_cli_check_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    onnx.save(base_model(), good)
    nodes, inits = base_parts()
    onnx.save(BREAKERS["zero-point"](nodes, inits), bad)
    assert main(["check", str(good), "--target", "tensorrt"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "zero-point" in out and "FAIL (2)" in out
    assert main(["check", str(bad), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert main(["check", str(good), "--target", "openvino"]) == 2
    assert main(["check", str(tmp_path / "missing.onnx")]) == 2


def test_check_refuses_non_onnx(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(QdqConfigError, match="not an ONNX model"):
        check_tensorrt(junk)


def test_suite_hook_fails_a_tensorrt_export_that_breaks_a_rule():
    """tests/conftest.py turns the export's rule warning into a failure; an exempt rule warns as for a user."""
    from types import SimpleNamespace

    from tensorrt_rules import failing_rule_warning

    nodes, inits = base_parts()
    broken = BREAKERS["zero-point"](nodes, inits)
    warned = []

    def warn(model, target, path):
        warned.append(path)

    tensorrt = SimpleNamespace(name="tensorrt", rule_check=check_tensorrt)
    with pytest.raises(pytest.fail.Exception, match="zero-point"):
        failing_rule_warning(warn, exempt=())(broken, tensorrt, "m.onnx")
    assert warned == []
    failing_rule_warning(warn, exempt={"zero-point"})(broken, tensorrt, "m.onnx")
    assert warned == ["m.onnx"]
    failing_rule_warning(warn, exempt=())(broken, SimpleNamespace(name="onnxruntime", rule_check=None), "m.onnx")
    assert warned == ["m.onnx"]  # a target that states no rules is not checked

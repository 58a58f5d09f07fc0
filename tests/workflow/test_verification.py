"""qdq.verify's verdict (PASS / FAIL with its thresholds) and locate_divergence on a graph changed on purpose."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import numpy_helper

import qdq
from qdq.app.models import DigitsResNet
from qdq.errors import QdqConfigError
from qdq.workflow.verification import MAX_ERROR_STEPS, MIN_AGREEMENT, VerifyResult, locate_divergence, verify


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = qdq.quantize_model(DigitsResNet(widths=(8, 16), stem_width=8).eval(), qdq.QuantConfig(target="onnxruntime"))
    data = [torch.randn(16, 3, 28, 28) for _ in range(3)]
    qdq.calibrate(model, data, method="max", progress=False)
    path = qdq.export_onnx(model, data[0][:1], tmp_path_factory.mktemp("verify") / "net.onnx")
    return model, path, data


def _result(agreement: float, steps: float) -> VerifyResult:
    return VerifyResult("onnxruntime", 100, agreement, steps * 0.1, steps, 0.1, [40.0])


def test_the_verdict_applies_both_thresholds_and_says_which():
    assert (MIN_AGREEMENT, MAX_ERROR_STEPS) == (99.5, 8.0)
    assert _result(100.0, 0.5).verdict == "PASS"
    assert _result(100.0, 0.5).verdict_line() == (
        "PASS: top-1 agreement 100.00 % >= 99.50 %, max error 0.50 <= 8.00 output steps"
    )
    assert _result(96.89, 40.15).verdict_line() == (
        "FAIL: top-1 agreement 96.89 % < 99.50 %, max error 40.15 > 8.00 output steps"
    )
    assert _result(99.9, 9.0).verdict == "FAIL" and _result(99.0, 1.0).verdict == "FAIL"
    assert _result(99.0, 1.0).ok(min_agreement=98.0) and _result(99.9, 9.0).to_dict()["verdict"] == "FAIL"


def test_verify_passes_on_the_exact_engine_and_records_its_thresholds(exported):
    model, path, data = exported
    result = verify(model, path, data, "onnxruntime", min_agreement=99.0, max_error_steps=2.0)
    assert result.verdict == "PASS" and result.samples == 48
    assert (result.min_agreement, result.max_allowed_steps) == (99.0, 2.0)
    assert "<= 2.00 output steps" in result.verdict_line()


def test_locate_divergence_finds_no_departure_in_an_exact_engine(exported):
    model, path, data = exported
    found = locate_divergence(model, path, data[0], "onnxruntime")
    assert found.first is None and len(found.compared) >= 5
    assert all(c.differing == 0.0 for c in found.compared)
    assert "every one of the" in str(found)


def test_locate_divergence_names_the_quantizer_whose_dequantization_was_changed(exported, tmp_path):
    model, path, data = exported
    proto = onnx.load(str(path))
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("/DequantizeLinear")
           and not any(i.name == n.input[0] for i in proto.graph.initializer)]  # fmt: skip
    target = dqs[len(dqs) // 2]  # a quantizer in the middle of the network
    scale = next(i for i in proto.graph.initializer if i.name == target.input[1])
    proto.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(scale) * 1.5, "changed_scale"))
    target.input[1] = "changed_scale"  # this DequantizeLinear alone now scales its codes 1.5x
    changed = tmp_path / "changed.onnx"
    onnx.save(proto, str(changed))
    found = locate_divergence(model, changed, data[0], "onnxruntime")
    name = target.name.removesuffix("/DequantizeLinear")
    assert found.first is not None and found.first.name == name
    assert found.first.differing > 0.2  # every non-zero code (half are post-ReLU zeros)
    assert all(c.differing == 0.0 for c in found.compared[:-1])
    assert f"departs from PyTorch at {name}" in str(found)


def test_locate_divergence_needs_the_pytorch_model(exported):
    _, path, data = exported
    with pytest.raises(QdqConfigError, match="PyTorch model"):
        locate_divergence(object(), path, data[0])

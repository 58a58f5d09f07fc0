"""The tensorrt target's export: its options (from the call, or remembered from QuantConfig), and the graphs it
refuses or warns about, each with what to do."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
import trt_graphs
from export_helpers import calibrate_max
from onnx import numpy_helper
from torch import nn

import qdq
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqExportError
from qdq.export import export_onnx
from qdq.placement import apply_placement
from qdq.quantizer import TensorQuantizer
from qdq.targets import get_target
from qdq.targets.marks import placed_options
from qdq.targets.tensorrt.check import check_tensorrt
from qdq.targets.tensorrt.float_types import read_float_record

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))


def two_convs(config: qdq.QuantConfig | None = None) -> nn.Module:
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    model = qdq.quantize_model(float_model, config or qdq.QuantConfig(target="tensorrt"))
    calibrate_max(model, X)
    return model


def test_tensorrt_target_takes_its_float_options():
    target = get_target("tensorrt")
    assert target.export.options == {"float": "float32"}
    assert target.step_float_type(None) == "float32" and target.step_float_type({"float": "fp16"}) == "float16"
    with pytest.raises(QdqConfigError, match=r"takes the export options.*'float'.*unknown \['flaot'\]"):
        qdq.QuantConfig(target="tensorrt", target_options={"flaot": "fp16"})
    with pytest.raises(QdqConfigError, match="target_options need a target"):
        qdq.QuantConfig(target_options={"float": "fp16"})


def test_options_are_remembered_by_the_model_and_overridden_by_the_call(tmp_path):
    model = two_convs(qdq.QuantConfig(target="tensorrt", target_options={"float": "float16"}))
    assert placed_options(model) == {"float": "float16"}
    assert {q.step_type for q in model.modules() if isinstance(q, TensorQuantizer)} == {"float16"}
    with pytest.warns(UserWarning, match="value ranges were not measured"):
        path = export_onnx(model, X, tmp_path / "fp16.onnx")
    assert read_float_record(path)["float_type"] == "float16"
    path = export_onnx(model, X, tmp_path / "fp32.onnx", target_options={"float": "float32"})
    assert read_float_record(path) is None and check_tensorrt(path).compute == {"float32": 3}


def test_data_is_not_an_option_a_model_remembers():
    with pytest.raises(QdqConfigError, match=r"plain values.*export_onnx\(\.\.\., target_options="):
        apply_placement(qdq.quantize_model(nn.Sequential(nn.Conv2d(3, 4, 3))), "tensorrt",
                        target_options={"calibration_data": [X.numpy()]})  # fmt: skip


def test_unsigned_quantizers_are_refused_with_their_names(tmp_path):
    model = two_convs(qdq.QuantConfig(target="tensorrt", quant_desc_input=QuantDescriptor(unsigned=True)))
    with pytest.raises(QdqExportError, match=r"signed int8 only.*2 quantizer\(s\).*0\._input_quantizer, "
                                             r"2\._input_quantizer.*unsigned=False.*'onnxruntime'"):  # fmt: skip
        export_onnx(model, X, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model_is_refused_with_the_way_to_a_float16_file(tmp_path, dtype):
    model = two_convs().to(dtype)
    opset = 22 if dtype == torch.bfloat16 else None
    with pytest.raises(QdqExportError, match=r"low-precision type.*Cast between each DequantizeLinear.*"
                                             r"model\.float\(\).*target_options=\{'float': 'float16'\}"):  # fmt: skip
        export_onnx(model, X.to(dtype), tmp_path / "m.onnx", opset=opset)
    assert not (tmp_path / "m.onnx").exists()
    with pytest.warns(UserWarning, match="steps were rounded to float16"):  # the model has float32 steps
        path = export_onnx(model.float(), X, tmp_path / "fp16.onnx",
                           target_options={"float": "float16", "calibration_data": [X]})  # fmt: skip
    assert check_tensorrt(path).ok


@pytest.mark.trt_rules_exempt("weighted-op-inputs", reason="the half-quantized conv exported on purpose")
def test_half_quantized_conv_is_warned_once_and_keep_float_makes_it_float(tmp_path):
    """A disabled input quantizer next to an enabled weight quantizer: one warning naming the layer; keep_float
    (what sensitivity analysis recommends) disables the layer's quantizers together, and the file passes."""
    model = two_convs()
    model[2]._input_quantizer.disable()
    with pytest.warns(UserWarning) as warned:
        path = export_onnx(model, X, tmp_path / "half.onnx", target_options={"float": "float32"})
    messages = [str(w.message) for w in warned if "Conv/Gemm/MatMul" in str(w.message)]
    assert len(messages) == 1 and "2._weight_quantizer" in messages[0] and "qdq.keep_float" in messages[0]
    assert check_tensorrt(path).rules_broken() == {"weighted-op-inputs"}
    qdq.keep_float(model, ["2"])
    assert not any(q.is_enabled for q in model[2].quantizers().values())
    path = export_onnx(model, X, tmp_path / "float_layer.onnx")
    report = check_tensorrt(path)
    assert report.ok and report.int8_ops == 1, str(report)
    assert "2._weight_quantizer" not in {n for node in onnx.load(str(path)).graph.node for n in
                                         [p.value for p in node.metadata_props]}  # fmt: skip


def test_a_step_beyond_float16_is_unrepresentable_without_a_numpy_warning():
    """A step above float16's largest number (an exploding activation's range) keeps its float32 step; the rounding
    says so in its result, not in numpy's "overflow encountered in cast"."""
    import warnings

    from qdq.targets.tensorrt.float_scales import round_graph_scales

    nodes, inits = trt_graphs.base_parts()
    trt_graphs._replace(inits, "s_r", np.float32(1e6))
    model = trt_graphs.make_model(nodes, inits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        changes, unrepresentable = round_graph_scales(model, "float16")
    assert unrepresentable == ["r/Q", "r/DQ"] and "x/Q" in changes
    assert numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "s_r")) == np.float32(1e6)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_a_residual_add_reads_the_quantizer_its_skip_tensor_already_has():
    """A front end that saw the add only inside a layer of the model's own leaves its skip input float although
    the same tensor is quantized for its other readers (InceptionResNetV2's Keras door): the rewrite makes the Add
    read that quantizer. The repaired file passes the rule and computes exactly what the file placed right does."""
    from qdq.targets.tensorrt.rewrite import rewrite_for_tensorrt

    x = np.random.default_rng(3).normal(size=(1, trt_graphs.C, 8, 8)).astype(np.float32)
    nodes, inits = trt_graphs.base_parts()  # random weights: one draw for both files
    right = trt_graphs.make_model(copy.deepcopy(nodes), copy.deepcopy(inits))
    broken = trt_graphs.BREAKERS["residual-add"](nodes, inits)
    assert check_tensorrt(broken).rules_broken() == {"residual-add"}
    counts = rewrite_for_tensorrt(broken)
    assert counts["residual_inputs_quantized"] == 1
    assert check_tensorrt(broken).ok, str(check_tensorrt(broken))
    add = next(n for n in broken.graph.node if n.name == "add")
    producer = {o: n for n in broken.graph.node for o in n.output}[add.input[1]]
    assert producer.op_type == "DequantizeLinear" and producer.input[1] == "s_x"
    np.testing.assert_array_equal(_run(broken, x), _run(right, x))


def test_a_residual_add_whose_skip_tensor_has_no_quantizer_is_left_to_the_check():
    """No quantizer of the skip tensor exists, so there is no range to read: the file is left as it is (the export
    says so once; ``qdq check`` lists it)."""
    from qdq.targets.tensorrt.rewrite import rewrite_for_tensorrt

    nodes, inits = trt_graphs.base_parts()
    nodes.insert(0, onnx.helper.make_node("Relu", ["x"], ["x_pos"], name="skip_relu"))
    next(n for n in nodes if n.name == "add").input[1] = "x_pos"
    model = trt_graphs.make_model(nodes, inits)
    assert rewrite_for_tensorrt(model)["residual_inputs_quantized"] == 0
    assert check_tensorrt(model).rules_broken() == {"residual-add"}

"""int8 weights stored as uint8 (zero point 128) for CPUs whose int8 dot products saturate.

On an x86 CPU without VNNI, ONNX Runtime's U8S8 kernels add pairs of ``u8 * s8`` products in int16 with
saturation. The graph below makes every pair saturate: activations at 255, weights at 127 (``255 * 127 * 2 =
64770 > 32767``); its exact output is worked out by hand. Stored as uint8 (U8U8 kernels) it is exact on every
CPU; as int8 it is exact only where the CPU has VNNI.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdq.cpu
from qdq.errors import QdqConfigError
from qdq.graphs.ir_graph import const, readers
from qdq.runtime.ort import inference_session, session_options
from qdq.targets import get_target
from qdq.targets.onnxruntime.passes.weight_encoding import WEIGHTS_METADATA_KEY, encode_weights_uint8
from qdq.targets.onnxruntime.rewrite import rewrite_for_onnxruntime

X_SCALE, W_SCALE, Y_SCALE = 1 / 255, 0.01, 0.5
CHANNELS = 8  # 3x3 kernel over 8 channels: 72 products per output, 36 pairs


def array(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """Constant ``name`` of the main graph (an initializer or a Constant's output) as numpy; None if not one."""
    graph = ir.serde.deserialize_model(model).graph
    return const(ir.convenience.create_value_mapping(graph, include_subgraphs=False).get(name))


def saturating_conv(weight_value: int = 127, *, float_weight: bool = False) -> onnx.ModelProto:
    """``x -> Q(u8) -> DQ -> Conv(DQ(int8 weights)) -> Q(u8) -> DQ -> y``; with ``float_weight`` the weight is
    ``Q(float) -> DQ`` (the tensorrt target's form) instead of a stored int8 initializer."""
    w_int = np.full((2, CHANNELS, 3, 3), weight_value, np.int8)
    constants = {
        "x_scale": np.array(X_SCALE, np.float32), "x_zero": np.array(0, np.uint8),
        "w_scale": np.array(W_SCALE, np.float32), "w_zero": np.array(0, np.int8),
        "y_scale": np.array(Y_SCALE, np.float32), "y_zero": np.array(0, np.uint8),
    }  # fmt: skip
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
    ]
    if float_weight:
        constants["w_float"] = w_int.astype(np.float32) * np.float32(W_SCALE)
        nodes.append(helper.make_node("QuantizeLinear", ["w_float", "w_scale", "w_zero"], ["w_int"]))
    else:
        constants["w_int"] = w_int
    nodes += [
        helper.make_node("DequantizeLinear", ["w_int", "w_scale", "w_zero"], ["wd"]),
        helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "y_scale", "y_zero"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zero"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "saturating_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
        initializer=[numpy_helper.from_array(v, k) for k, v in constants.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


X = np.ones((1, CHANNELS, 4, 4), np.float32)  # quantized to 255 everywhere
# Centre pixels see all 72 products: 255 * 127 * 72 * (1/255 * 0.01) = 91.44 -> Q at step 0.5: 183 -> 91.5.
CENTRE = np.float32(183 * Y_SCALE)


def run(model: onnx.ModelProto, *, optimize: bool = True, optimized: str | None = None) -> np.ndarray:
    """ORT on the model as given (optimize: its int8 kernels; else the reference kernels); ``optimized``: where
    to save the graph ORT ran."""
    import onnxruntime as ort

    level = "all" if optimize else "disable"
    options = session_options(threads=1, optimization_level=level, optimized_model_path=optimized)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})[0]


def test_hand_computed_value_from_the_reference_kernels():
    out = run(saturating_conv(), optimize=False)
    assert out[0, 0, 1, 1] == CENTRE and out[0, 1, 2, 2] == CENTRE


@pytest.mark.parametrize("float_weight", [False, True], ids=["int8-initializer", "quantize-float"])
def test_uint8_weights_are_exact_in_the_int8_kernels_of_every_cpu(float_weight, tmp_path):
    model = saturating_conv(float_weight=float_weight)
    reference = run(model, optimize=False)
    encode_weights_uint8(model)
    np.testing.assert_array_equal(run(model, optimized=str(tmp_path / "ran.onnx")), reference)
    assert [n.op_type for n in onnx.load(str(tmp_path / "ran.onnx")).graph.node].count("QLinearConv") == 1


@pytest.mark.skipif(not qdq.cpu.int8_dot_saturates(), reason="this CPU's int8 dot products do not saturate (VNNI)")
def test_int8_weights_saturate_on_this_cpu():
    # Why the encoding exists: the same graph with int8 weights, run by ORT's U8S8 kernels.
    out = run(saturating_conv())
    assert out[0, 0, 1, 1] < CENTRE * 0.75


def test_encoding_keeps_every_dequantized_weight():
    model = saturating_conv()
    before = array(model, "w_int").astype(np.int32)
    assert encode_weights_uint8(model) == 1
    graph = ir.serde.deserialize_model(model).graph
    (dq,) = [n for n in graph if n.op_type == "DequantizeLinear" and const(n.inputs[0]) is not None]
    stored, zero = const(dq.inputs[0]), const(dq.inputs[2])
    assert stored.dtype == zero.dtype == np.uint8 and int(zero) == 128
    np.testing.assert_array_equal(stored.astype(np.int32) - 128, before)  # 127 -> 255 with zero point 128
    assert array(model, "w_zero") is None  # the int8 zero point is no longer used


def test_the_quantize_form_gets_a_uint8_zero_point_on_both_nodes():
    model = saturating_conv(float_weight=True)
    assert encode_weights_uint8(model) == 1
    graph = ir.serde.deserialize_model(model).graph
    q = next(n for n in graph if n.op_type == "QuantizeLinear" and n.inputs[0].name == "w_float")
    (dq,) = readers(q.outputs[0])
    zero = const(q.inputs[2])
    assert q.inputs[2] is dq.inputs[2] and zero.dtype == np.uint8 and int(zero) == 128


def test_weights_within_64_levels_stay_int8():
    # |w| <= 64: a pair sums to at most 255 * 128 = 32640, which fits int16 (7-bit and 4-bit weights)
    model = saturating_conv(weight_value=64)
    assert encode_weights_uint8(model) == 0
    assert array(model, "w_int").dtype == np.int8
    assert encode_weights_uint8(saturating_conv(weight_value=-65)) == 1
    assert encode_weights_uint8(saturating_conv(weight_value=64), only_saturating=False) == 1


def test_activations_are_left_alone():
    model = saturating_conv()
    encode_weights_uint8(model)
    x_zero, y_zero = array(model, "x_zero"), array(model, "y_zero")
    assert x_zero.dtype == np.uint8 and int(x_zero) == 0
    assert y_zero.dtype == np.uint8 and int(y_zero) == 0


@pytest.mark.parametrize(("weights", "dtype"), [("int8", np.int8), ("uint8", np.uint8)])
def test_the_rewrite_option_sets_and_records_the_encoding(weights, dtype):
    model = saturating_conv()
    counts = rewrite_for_onnxruntime(model, weights=weights)
    assert counts["uint8_weights"] == int(weights == "uint8")
    conv = next(n for n in ir.serde.deserialize_model(model).graph if n.op_type == "Conv")
    assert const(conv.inputs[1].producer().inputs[0]).dtype == dtype
    assert {p.key: p.value for p in model.metadata_props}[WEIGHTS_METADATA_KEY] == weights


def test_weights_inside_if_branches_are_encoded_and_new_names_stay_unique():
    """Both branches of an ``If`` hold the saturating conv, their initializers of one name each: the rewrite
    re-encodes the weights of both, and what it names anew is named once in the whole model."""
    body = saturating_conv().graph
    branches = []
    for name in ("then", "else"):
        branch = onnx.GraphProto()
        branch.CopyFrom(body)
        branch.name = name
        del branch.input[:]  # reads the main graph's x
        branches.append(branch)
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branches[0], else_branch=branches[1])
    graph = helper.make_graph(
        [node], "branched",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, 4, 4]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    assert rewrite_for_onnxruntime(model, weights="uint8")["branches"] == 2
    ir_model = ir.serde.deserialize_model(model)
    convs = [n for n in ir_model.graph.all_nodes() if n.op_type == "Conv"]
    assert len(convs) == 2 and all(const(c.inputs[1].producer().inputs[0]).dtype == np.uint8 for c in convs)
    added = [v.name for g in ir_model.graphs() for v in g.initializers.values() if "__" in (v.name or "")]
    assert len(added) >= 4 and len(added) == len(set(added))  # two weights, two zero points at least
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for cond in (True, False):
        got = session.run(None, {"x": X, "cond": np.array(cond)})[0]
        assert got[0, 0, 1, 1] == CENTRE  # exact: uint8 weights never saturate


def test_auto_follows_this_cpu(monkeypatch):
    for saturates, expected in ((True, "uint8"), (False, "int8")):
        monkeypatch.setattr(qdq.cpu, "int8_dot_saturates", lambda s=saturates: s)
        model = saturating_conv()
        rewrite_for_onnxruntime(model)
        assert {p.key: p.value for p in model.metadata_props}[WEIGHTS_METADATA_KEY] == expected


def test_bad_options_raise_one_clear_error():
    with pytest.raises(QdqConfigError, match="weights must be one of"):
        rewrite_for_onnxruntime(saturating_conv(), weights="u8")
    with pytest.raises(QdqConfigError, match=r"takes the export options \['weights'\].*'wieghts'"):
        get_target("onnxruntime").rewrite_onnx(saturating_conv(), wieghts="int8")
    with pytest.raises(QdqConfigError, match=r"'tensorrt' takes the export options \[.*'float'.*unknown \['weights'\]"):
        get_target("tensorrt").rewrite_onnx(saturating_conv(), weights="int8")


def test_runtime_session_reencodes_in_memory(tmp_path):
    path = tmp_path / "sat.onnx"
    onnx.save(saturating_conv(), str(path))
    session = inference_session(path, session_options(threads=1), uint8_weights=True)
    out = session.run(None, {"x": X})[0]
    assert out[0, 0, 1, 1] == CENTRE
    assert array(onnx.load(str(path)), "w_int").dtype == np.int8  # the file is not changed


@pytest.mark.parametrize(
    ("recorded", "reencoded"),
    [(None, 1), ({"qdq.weights": "int8"}, 1), ({"qdq.weights": "uint8"}, 0), ({"qdq.ort_weights": "uint8"}, 0)],
    ids=["foreign-file", "int8", "uint8", "uint8-earlier-key"],
)
def test_the_runtime_adapts_only_what_the_file_says(recorded, reencoded, tmp_path, monkeypatch):
    """On a CPU that saturates, a file whose export recorded uint8 weights is loaded as it is (the export decided);
    one that recorded int8, or a file qdq did not write, is re-encoded in memory (the user stays protected)."""
    from qdq.graphs.onnx import set_metadata
    from qdq.runtime import load_runtime

    monkeypatch.setattr(qdq.cpu, "int8_dot_saturates", lambda: True)
    model = saturating_conv()
    for key, value in (recorded or {}).items():
        set_metadata(model, key, value)
    onnx.save(model, str(tmp_path / "m.onnx"))
    with load_runtime(tmp_path / "m.onnx", "onnxruntime", threads=1) as runtime:
        assert runtime.reencoded_weights == reencoded

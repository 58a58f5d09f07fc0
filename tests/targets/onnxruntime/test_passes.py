"""The ONNX Runtime rewrite (qdq.targets.onnxruntime.passes), one pass at a time, on small graphs built by hand.

Each pass runs on a graph made with ``onnx.helper``; the tests check the structure it leaves and the numbers
it writes against values worked out by hand (in the comments), then run both graphs in ONNX Runtime (graph
optimizations off, so ORT computes exactly the nodes given) and compare: bit for bit where the pass is exact,
to float32 rounding where it is not (BatchNorm folding, pooling).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.ir_graph import const, run_on_graph
from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_tags import add_quantizer_names, quantizer_names
from qdq.targets.onnxruntime.passes.batchnorm import fold_batchnorms
from qdq.targets.onnxruntime.passes.biases import bias_after_float_convs, quantize_biases
from qdq.targets.onnxruntime.passes.duplicates import merge_duplicate_pairs, remove_requantization
from qdq.targets.onnxruntime.passes.float_convs import unfusable_convs
from qdq.targets.onnxruntime.passes.pools import flatten_pools, global_pools
from qdq.targets.onnxruntime.passes.shapes import shapes_of_int8
from qdq.targets.onnxruntime.passes.uint8_activations import activations_to_uint8
from qdq.targets.onnxruntime.passes.weights import fold_weight_quantizers
from qdq.targets.onnxruntime.passes.zero_masks import drop_masks_of_zeros, fold_zero_masks
from qdq.targets.onnxruntime.rewrite import rewrite_for_onnxruntime

F32 = np.float32


def build(nodes, inputs, outputs, constants, opset: int = 18) -> onnx.ModelProto:
    """A model from nodes, ``(name, shape)`` float inputs/outputs and a dict of numpy constants."""
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs],
        initializer=[numpy_helper.from_array(np.asarray(value), name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def run(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def copy_of(model: onnx.ModelProto) -> onnx.ModelProto:
    other = onnx.ModelProto()
    other.CopyFrom(model)
    return other


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def node(model: onnx.ModelProto, op_type: str):
    (found,) = [n for n in model.graph.node if n.op_type == op_type]
    return found


def value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """Constant ``name`` of the main graph (an initializer or a Constant's output) as numpy; None if not one."""
    graph = ir.serde.deserialize_model(model).graph
    return const(ir.convenience.create_value_mapping(graph, include_subgraphs=False).get(name))


def tag(n, quantizer: str):
    n.metadata_props.add(key="qdq.quantizer", value=quantizer)
    return n


X4 = np.random.default_rng(0).standard_normal((2, 2, 3, 3)).astype(F32)


# ------------------------------------------------------------------------------------- 1. weights
def weight_graph(w: np.ndarray, scale, zero_point, axis: int | None = None) -> onnx.ModelProto:
    kwargs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"], **kwargs),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], **kwargs),
        helper.make_node("Conv", ["x", "wd"], ["y"]),
    ]
    constants = {"w": w, "s": np.asarray(scale, F32), "z": np.asarray(zero_point)}
    return build(nodes, [("x", [1, 1, 1, 1])], [("y", [1, w.shape[0], 1, 1])], constants)


def test_weight_quantizers_become_int8_initializers():
    # w / 0.5 = [0.5, 1.5, -0.5, 200, -200, 2] -> round half to even, saturate: [0, 2, 0, 127, -128, 2]
    w = np.array([0.25, 0.75, -0.25, 100.0, -100.0, 1.0], F32).reshape(6, 1, 1, 1)
    model = weight_graph(w, 0.5, np.int8(0))
    before = run(model, x=np.ones((1, 1, 1, 1), F32))
    assert run_on_graph(model, fold_weight_quantizers) == 1
    assert ops(model) == ["DequantizeLinear", "Conv"]
    dq = node(model, "DequantizeLinear")
    folded = value(model, dq.input[0])
    assert folded.dtype == np.int8 and folded.reshape(-1).tolist() == [0, 2, 0, 127, -128, 2]
    np.testing.assert_array_equal(run(model, x=np.ones((1, 1, 1, 1), F32)), before)


def test_per_channel_weights_use_their_channel_step():
    # 0.75 / 0.5 = 1.5 -> 2 (even); 0.75 / 0.25 = 3
    w = np.full((2, 1, 1, 1), 0.75, F32)
    model = weight_graph(w, [0.5, 0.25], np.zeros(2, np.int8), axis=0)
    run_on_graph(model, fold_weight_quantizers)
    assert value(model, node(model, "DequantizeLinear").input[0]).reshape(-1).tolist() == [2, 3]


def test_weights_with_a_zero_point_or_read_as_output_stay():
    model = weight_graph(np.ones((1, 1, 1, 1), F32), 0.5, np.int8(3))
    assert run_on_graph(model, fold_weight_quantizers) == 0 and "QuantizeLinear" in ops(model)
    model = weight_graph(np.ones((1, 1, 1, 1), F32), 0.5, np.int8(0))
    model.graph.output.append(helper.make_tensor_value_info("wq", TensorProto.INT8, [1, 1, 1, 1]))
    assert run_on_graph(model, fold_weight_quantizers) == 0


# ----------------------------------------------------------------------------------- 2. BatchNorm
def bn_graph(weights: np.ndarray) -> onnx.ModelProto:
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["x", "wd", "b"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], epsilon=0.0),
    ]
    constants = {
        "wq": weights.astype(np.int8),
        "ws": np.array([0.5, 0.25, 0.125], F32),
        "wz": np.zeros(3, np.int8),
        "b": np.array([1.0, 2.0, 3.0], F32),
        "gamma": np.array([2.0, -3.0, 0.0], F32),
        "beta": np.array([0.5, 0.5, 0.5], F32),
        "mean": np.array([1.0, 1.0, 1.0], F32),
        "var": np.array([4.0, 1.0, 1.0], F32),
    }
    return build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 3, 3, 3])], constants)


def test_batchnorm_folds_into_the_weight_scale_and_bias():
    # k = gamma / sqrt(var) = [1, -3, 0]; shift = beta - mean * k = [-0.5, 3.5, 0.5]
    # scale * |k| = [0.5, 0.75, (k = 0: kept) 0.125]; int8 negated where k < 0, zeroed where k = 0
    # bias * k + shift = [0.5, -2.5, 0.5]
    model = bn_graph(np.array([[1, -2], [3, 4], [5, 6]]).reshape(3, 2, 1, 1))
    before = run(model, x=X4)
    assert run_on_graph(model, fold_batchnorms) == 1
    assert ops(model) == ["DequantizeLinear", "Conv"]
    dq, conv = node(model, "DequantizeLinear"), node(model, "Conv")
    assert conv.output[0] == "y"
    assert value(model, dq.input[0]).reshape(3, 2).tolist() == [[1, -2], [-3, -4], [0, 0]]
    assert value(model, dq.input[1]).tolist() == [0.5, 0.75, 0.125]
    assert value(model, conv.input[2]).tolist() == [0.5, -2.5, 0.5]
    np.testing.assert_allclose(run(model, x=X4), before, rtol=1e-6, atol=1e-6)


def test_batchnorm_is_not_folded_when_a_negated_weight_overflows():
    model = bn_graph(np.array([[1, -2], [-128, 4], [5, 6]]).reshape(3, 2, 1, 1))  # -(-128) is no int8
    assert run_on_graph(model, fold_batchnorms) == 0
    assert "BatchNormalization" in ops(model)


# ------------------------------------------------------------------------------------ 3. zero masks
def mask_graph(mask: list[float]) -> onnx.ModelProto:
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["x", "wd", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Mul", ["r", "mask"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    constants = {
        "wq": np.arange(1, 7, dtype=np.int8).reshape(3, 2, 1, 1),
        "ws": np.full(3, 0.25, F32),
        "wz": np.zeros(3, np.int8),
        "b": np.array([0.5, 0.25, -0.25], F32),
        "mask": np.array(mask, F32).reshape(1, 3, 1, 1),
        "s": np.float32(0.05),
        "z": np.uint8(0),
    }
    return build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 3, 3, 3])], constants)


def test_a_channel_mask_after_a_conv_folds_into_its_weights_and_bias():
    model = mask_graph([1.0, 0.0, 1.0])
    before = run(model, x=X4)
    assert run_on_graph(model, fold_zero_masks) == 1
    assert ops(model) == ["DequantizeLinear", "Conv", "Relu", "QuantizeLinear", "DequantizeLinear"]
    conv, q = node(model, "Conv"), node(model, "QuantizeLinear")
    assert q.input[0] == "r"
    weights = value(model, model.graph.node[0].input[0]).reshape(3, 2)
    assert weights.tolist() == [[1, 2], [0, 0], [5, 6]]
    assert value(model, conv.input[2]).tolist() == [0.5, 0.0, -0.25]
    np.testing.assert_array_equal(run(model, x=X4), before)


def test_a_mask_of_every_channel_also_drops_the_activation():
    model = mask_graph([0.0, 0.0, 0.0])
    before = run(model, x=X4)
    run_on_graph(model, fold_zero_masks)
    assert ops(model) == ["DequantizeLinear", "Conv", "QuantizeLinear", "DequantizeLinear"]
    assert node(model, "QuantizeLinear").input[0] == "c"
    np.testing.assert_array_equal(run(model, x=X4), before)
    assert not np.any(before)


def test_a_mask_of_a_tensor_that_is_zero_anyway_is_removed():
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
        helper.make_node("Conv", ["x", "wd"], ["c"]),
        helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3]),
        helper.make_node("Mul", ["p", "mask"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    constants = {
        "wq": np.zeros((3, 2, 1, 1), np.int8),  # all-zero weights, no bias: the conv outputs zeros
        "ws": np.float32(0.5),
        "wz": np.int8(0),
        "mask": np.array([1.0, 0.0, 1.0], F32).reshape(1, 3, 1, 1),
        "s": np.float32(1.0),
        "z": np.int8(0),
    }
    model = build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 3, 1, 1])], constants)
    before = run(model, x=X4)
    assert run_on_graph(model, drop_masks_of_zeros) == 1
    assert "Mul" not in ops(model) and node(model, "QuantizeLinear").input[0] == "p"
    np.testing.assert_array_equal(run(model, x=X4), before)


# ------------------------------------------------------------------------------- 4. uint8 activations
def test_signed_activations_become_uint8_with_zero_point_128_and_the_same_values():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["d1"]),
        helper.make_node("Relu", ["d1"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s2", "z2"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["y"]),
    ]
    constants = {"s1": np.float32(0.02), "z1": np.int8(0), "s2": np.float32(0.01), "z2": np.uint8(0)}
    model = build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 2, 3, 3])], constants)
    x = (X4 * 2).astype(F32)  # beyond +-2.54: saturates on both grids alike
    before = run(model, x=x)
    assert run_on_graph(model, activations_to_uint8) == 1
    q1, dq1 = model.graph.node[0], model.graph.node[1]
    assert q1.input[2] == dq1.input[2] and value(model, q1.input[2]) == np.uint8(128)
    assert value(model, q1.input[1]) == F32(0.02)  # the scale is unchanged
    assert model.graph.node[3].input[2] == "z2"  # already unsigned with zero point 0: kept
    np.testing.assert_array_equal(run(model, x=x), before)


# ---------------------------------------------------------------------------------------- 5. biases
def bias_graph(bias: list[float], quantize_output: bool = True) -> onnx.ModelProto:
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "b"], ["c" if quantize_output else "y"], name="conv"),
    ]
    if quantize_output:
        nodes += [
            helper.make_node("QuantizeLinear", ["c", "sy", "zx"], ["cq"]),
            helper.make_node("DequantizeLinear", ["cq", "sy", "zx"], ["y"]),
        ]
    constants = {
        "sx": np.float32(0.5),
        "zx": np.int8(0),
        "wq": np.array([[1, -2], [3, 4]], np.int8).reshape(2, 2, 1, 1),
        "ws": np.array([0.25, 0.125], F32),
        "wz": np.zeros(2, np.int8),
        "b": np.array(bias, F32),
        "sy": np.float32(0.1),
    }
    return build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 2, 3, 3])], constants)


def test_conv_bias_becomes_int32_at_input_step_times_weight_step():
    # s_x * s_w = 0.5 * [0.25, 0.125] = [0.125, 0.0625]; [1.0, -0.3] / that = [8, -4.8] -> [8, -5]
    model = bias_graph([1.0, -0.3])
    assert run_on_graph(model, quantize_biases, []) == 1
    conv = node(model, "Conv")
    bias_dq = next(n for n in model.graph.node if n.output[0] == conv.input[2])
    assert bias_dq.op_type == "DequantizeLinear"
    assert next(a.i for a in bias_dq.attribute if a.name == "axis") == 0
    q_bias, scale, zero = (value(model, name) for name in bias_dq.input)
    assert q_bias.dtype == np.int32 and q_bias.tolist() == [8, -5]
    assert scale.tolist() == [0.125, 0.0625] and zero.tolist() == [0, 0]


def test_a_bias_on_the_int32_grid_keeps_the_outputs_bit_for_bit():
    model = bias_graph([0.25, -0.5])  # [2, -8] steps exactly
    before = run(model, x=X4)
    run_on_graph(model, quantize_biases, [])
    np.testing.assert_array_equal(run(model, x=X4), before)


def test_a_float_conv_gets_its_bias_as_an_add_after_it():
    model = bias_graph([1.0, -0.3], quantize_output=False)
    before = run(model, x=X4)
    assert on_ir(model, lambda m: bias_after_float_convs(m.graph, [n for n in m.graph if n.op_type == "Conv"])) == [1]
    conv = node(model, "Conv")
    assert ops(model)[-2:] == ["Conv", "Add"] and len(conv.input) == 2
    add = node(model, "Add")
    assert add.output[0] == "y" and add.input[0] == conv.output[0]
    assert value(model, add.input[1]).shape == (1, 2, 1, 1)
    np.testing.assert_allclose(run(model, x=X4), before, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------ 6. duplicates
def pairs_graph(second_scale: float) -> onnx.ModelProto:
    nodes = [
        tag(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["qa"]), "a"),
        tag(helper.make_node("DequantizeLinear", ["qa", "s", "z"], ["da"]), "a"),
        tag(helper.make_node("QuantizeLinear", ["x", "s2", "z"], ["qb"]), "b"),
        tag(helper.make_node("DequantizeLinear", ["qb", "s2", "z"], ["db"]), "b"),
        helper.make_node("Relu", ["da"], ["ra"]),
        helper.make_node("Sigmoid", ["db"], ["sb"]),
        helper.make_node("Add", ["ra", "sb"], ["y"]),
    ]
    constants = {"s": np.float32(0.1), "s2": np.float32(second_scale), "z": np.int8(0)}
    return build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 2, 3, 3])], constants)


def test_equal_pairs_on_one_tensor_merge_and_keep_both_names():
    model = pairs_graph(0.1)
    before = run(model, x=X4)
    assert run_on_graph(model, merge_duplicate_pairs) == 1
    assert ops(model).count("QuantizeLinear") == 1 and node(model, "Sigmoid").input[0] == "da"
    assert quantizer_names(node(model, "QuantizeLinear")) == ["a", "b"]
    assert quantizer_names(node(model, "DequantizeLinear")) == ["a", "b"]
    np.testing.assert_array_equal(run(model, x=X4), before)


def test_pairs_with_different_scales_stay():
    model = pairs_graph(0.2)
    assert run_on_graph(model, merge_duplicate_pairs) == 0 and ops(model).count("QuantizeLinear") == 2


def test_a_requantization_with_equal_parameters_is_removed():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"]),
        helper.make_node("QuantizeLinear", ["d1", "s", "z"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["y"]),
    ]
    model = build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 2, 3, 3])], {"s": np.float32(0.1), "z": np.int8(0)})
    before = run(model, x=X4)
    assert run_on_graph(model, remove_requantization) == 2  # the second Q and the DQ it alone read
    assert ops(model) == ["QuantizeLinear", "DequantizeLinear"]
    assert node(model, "DequantizeLinear").input[0] == "q1"
    np.testing.assert_array_equal(run(model, x=X4), before)


# ---------------------------------------------------------------------------------------- 16. shapes
def test_shapes_read_the_int8_encoding_and_a_dequantization_done_for_a_shape_goes():
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["m"]),
        helper.make_node("Shape", ["m"], ["shape_m"]),  # before the Q it will read: the pass re-orders the nodes
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Relu", ["d"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["d2"]),  # read by the Shape alone
        helper.make_node("Shape", ["d2"], ["shape_d"]),
        helper.make_node("Concat", ["shape_m", "shape_d"], ["shapes"], axis=0),
        helper.make_node("Cast", ["shapes"], ["sizes"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["d", "sizes"], ["y"]),
    ]
    model = build(nodes, [("x", [2, 2, 3, 8])], [("y", [2, 2, 3, 8])], {"s": np.float32(0.1), "z": np.int8(0)})
    x = np.random.default_rng(1).standard_normal((2, 2, 3, 8)).astype(F32)
    before = run(model, x=x)
    assert run_on_graph(model, shapes_of_int8) == 2
    assert [n.input[0] for n in model.graph.node if n.op_type == "Shape"] == ["q", "q2"]
    assert ops(model).count("DequantizeLinear") == 1  # d2 had the Shape alone
    onnx.checker.check_model(model)  # the Shape now comes after the QuantizeLinear it reads
    np.testing.assert_array_equal(run(model, x=x), before)


def test_a_shape_of_a_float_tensor_nothing_quantizes_stays():
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Cast", ["shape"], ["y"], to=1)]
    model = build(nodes, [("x", [2, 3])], [("y", [2])], {})
    assert run_on_graph(model, shapes_of_int8) == 0 and model.graph.node[0].input[0] == "x"


# ------------------------------------------------------------------------------- 7. average pooling
def pool_graph(axes: list[int], keepdims: int = 1) -> onnx.ModelProto:
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=keepdims),
        helper.make_node("Flatten", ["m"], ["y"], axis=1),
    ]
    return build(nodes, [("x", [2, 2, 3, 3])], [("y", None)], {"axes": np.array(axes, np.int64)})


def test_a_spatial_mean_becomes_global_average_pool_and_its_flatten_a_reshape():
    model = pool_graph([2, 3])
    before = run(model, x=X4)
    assert on_ir(model, lambda m: (global_pools(m.graph), flatten_pools(m.graph))) == [(1, 1)]
    pool, reshape = model.graph.node
    assert (pool.op_type, list(pool.input), list(pool.attribute)) == ("GlobalAveragePool", ["x"], [])
    assert reshape.op_type == "Reshape" and value(model, reshape.input[1]).tolist() == [0, -1]
    np.testing.assert_allclose(run(model, x=X4), before, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("axes", "keepdims"), [([1], 1), ([2], 1), ([2, 3], 0)])
def test_other_means_stay(axes, keepdims):
    model = pool_graph(axes, keepdims)
    assert run_on_graph(model, global_pools) == 0 and ops(model)[0] == "ReduceMean"


def quantized_pool_graph(s_x: float, s_y: float) -> onnx.ModelProto:
    """Q(x) -> DQ -> GlobalAveragePool over 8 x 8 positions -> Q -> DQ, uint8 with zero point 0."""
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "z"], ["xd"]),
        helper.make_node("GlobalAveragePool", ["xd"], ["m"], name="pool"),
        helper.make_node("QuantizeLinear", ["m", "sy", "z"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "sy", "z"], ["y"]),
    ]
    constants = {"sx": np.float32(s_x), "sy": np.float32(s_y), "z": np.uint8(0)}
    return build(nodes, [("x", [1, 2, 8, 8])], [("y", [1, 2, 1, 1])], constants)


def run_fused(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    import onnxruntime as ort  # ORT's default optimizations: DQ -> pool -> Q runs as QLinearGlobalAveragePool

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_pool_whose_scales_ort_refuses_keeps_a_float_output_and_others_stay_int8():
    from qdq.targets.onnxruntime.passes.pools import float_pools_out_of_range

    x = np.linspace(0, 2e-7, 128, dtype=np.float32).reshape(1, 2, 8, 8)
    dead = quantized_pool_graph(8e-10, 1.0)  # a tiny range, and a dead one (step 1): 8e-10 / 64 < 2^-32
    with pytest.raises(Exception, match="out of computation range"):
        run_fused(dead, x=x)
    assert run_on_graph(dead, float_pools_out_of_range) == 1
    assert ops(dead) == ["QuantizeLinear", "DequantizeLinear", "GlobalAveragePool", "Identity"]
    oracle = np.round(x / np.float32(8e-10)).clip(0, 255) * np.float32(8e-10)  # the input's grid, then the mean
    np.testing.assert_allclose(run_fused(dead, x=x), oracle.mean(axis=(2, 3), keepdims=True), rtol=1e-5)
    kept = quantized_pool_graph(0.02, 0.01)  # 0.02 / (0.01 * 64) is in ORT's range
    assert run_on_graph(kept, float_pools_out_of_range) == 0 and ops(kept).count("QuantizeLinear") == 2


# ------------------------------------------------------------------------------------ fusability
def conv_out_graph(tail: list[str], zero_point) -> onnx.ModelProto:
    """DQ(x), DQ(w) -> Conv -> [tail ops] -> Q(zero_point) -> DQ."""
    nodes = [
        helper.make_node("DequantizeLinear", ["xq", "s", "zi"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "s", "zi"], ["wd"]),
        helper.make_node("Conv", ["xd", "wd"], ["t0"], name="conv"),
    ]
    for i, op in enumerate(tail):
        nodes.append(helper.make_node(op, [f"t{i}"], [f"t{i + 1}"]))
    nodes += [
        helper.make_node("QuantizeLinear", [f"t{len(tail)}", "s", "zo"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "zo"], ["y"]),
    ]
    constants = {
        "xq": np.ones((1, 1, 2, 2), np.int8),
        "wq": np.ones((1, 1, 1, 1), np.int8),
        "s": np.float32(0.1),
        "zi": np.int8(0),
        "zo": zero_point,
    }
    return build(nodes, [], [("y", [1, 1, 2, 2])], constants)


@pytest.mark.parametrize(
    ("tail", "zero_point", "unfusable"),
    [
        ([], np.int8(0), []),
        (["Relu"], np.uint8(0), []),  # ORT drops a Relu before a Q whose zero point is the type's minimum
        (["Relu"], np.int8(0), ["conv"]),
        (["Relu"], np.uint8(128), ["conv"]),
        (["Sigmoid"], np.uint8(0), ["conv"]),
        (["Relu", "Relu"], np.uint8(0), ["conv"]),
    ],
)
def test_unfusable_convs(tail, zero_point, unfusable):
    assert unfusable_convs(conv_out_graph(tail, zero_point)) == unfusable


# ------------------------------------------------------------------------------------- whole rewrite
def test_the_whole_rewrite_keeps_the_values_and_runs_the_conv_in_int8(tmp_path: Path):
    from qdq.runtime.ort import fusion_report

    nodes = [
        tag(helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]), "conv._input_quantizer"),
        tag(helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]), "conv._input_quantizer"),
        tag(helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], axis=0), "conv._weight_quantizer"),
        tag(helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0), "conv._weight_quantizer"),
        helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"]),
        tag(helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["yq"]), "output_quantizer"),
        tag(helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]), "output_quantizer"),
    ]
    constants = {
        "sx": np.float32(0.5),
        "zx": np.int8(0),
        "w": np.array([[0.5, -0.25], [0.75, 1.0]], F32).reshape(2, 2, 1, 1),
        "ws": np.array([0.25, 0.125], F32),
        "wz": np.zeros(2, np.int8),
        "b": np.array([0.25, -0.5], F32),  # on the int32 grid s_x * s_w: exact
        "sy": np.float32(0.05),
        "zy": np.uint8(0),
    }
    model = build(nodes, [("x", [2, 2, 3, 3])], [("y", [2, 2, 3, 3])], constants)
    original = copy_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Conv left in float
        counts = rewrite_for_onnxruntime(model)
    assert counts["weights"] == counts["uint8"] == counts["biases"] == 1
    assert counts["float_convs"] == counts["batchnorms"] == counts["duplicates"] == 0
    assert unfusable_convs(model) == []
    np.testing.assert_array_equal(run(model, x=X4), run(original, x=X4))
    path = tmp_path / "rewritten.onnx"
    onnx.save(model, str(path))
    assert fusion_report(path, threads=1).int8_kernels == {"com.microsoft:QLinearConv": 1}


def test_a_conv_with_no_qdq_at_all_is_float_on_purpose_and_not_warned_about():
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="float_conv")]
    model = build(nodes, [("x", [1, 2, 3, 3])], [("y", [1, 2, 3, 3])], {"w": np.ones((2, 2, 1, 1), np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counts = rewrite_for_onnxruntime(model)
    assert counts["float_convs"] == 1 and unfusable_convs(model) == ["float_conv"]


def test_an_unquantized_conv_output_is_warned_about():
    model = bias_graph([0.25, -0.5], quantize_output=False)
    with pytest.warns(UserWarning, match=r"1 Conv\(s\) will run in float.*QuantConfig\(target='onnxruntime'\)"):
        counts = rewrite_for_onnxruntime(model)
    assert counts["float_convs"] == 1 and counts["float_biases"] == 1


def test_merged_names_can_be_added_to_a_tagged_node():
    n = ir.node("QuantizeLinear", [], metadata_props={"qdq.quantizer": "a"})
    add_quantizer_names(n, ["b", "a", "c"])
    assert quantizer_names(n) == ["a", "b", "c"]

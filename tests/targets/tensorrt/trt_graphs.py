"""Small hand-built Q/DQ graphs for the TensorRT rule checker: one that follows every rule and edits that break one.

The base graph is the pattern TensorRT fuses into int8 kernels (its developer guide's placement
recommendations): ``x -> Q/DQ -> Conv(Q/DQ weights per output channel) -> BatchNorm -> Add(Q/DQ skip) -> Relu ->
Q/DQ -> Conv -> y``. Each breaker edits that graph (built with ``onnx.helper``) so that exactly one rule's
subject is wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32, F16, I8, U8 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.UINT8
C = 4  # channels everywhere
RNG = np.random.default_rng(0)


def _const(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _pair(prefix: str, x: str, scale: str, zero: str, out: str, axis: int | None = None) -> list[onnx.NodeProto]:
    extra = {} if axis is None else {"axis": axis}
    return [
        helper.make_node("QuantizeLinear", [x, scale, zero], [f"{prefix}_q"], name=f"{prefix}/Q", **extra),
        helper.make_node("DequantizeLinear", [f"{prefix}_q", scale, zero], [out], name=f"{prefix}/DQ", **extra),
    ]


def base_parts() -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes and initializers of the graph that follows every rule."""
    weight = lambda: RNG.standard_normal((C, C, 3, 3)).astype(np.float32)  # noqa: E731
    inits = [
        _const("s_x", np.float32(0.05)), _const("s_r", np.float32(0.04)), _const("zp", np.int8(0)),
        _const("w1", weight()), _const("w2", weight()),
        _const("s_w", np.full(C, 0.02, np.float32)), _const("zp_w", np.zeros(C, np.int8)),
        _const("bn_scale", np.ones(C, np.float32)), _const("bn_bias", np.zeros(C, np.float32)),
        _const("bn_mean", np.zeros(C, np.float32)), _const("bn_var", np.ones(C, np.float32)),
    ]  # fmt: skip
    nodes = [
        *_pair("x", "x", "s_x", "zp", "xd"),
        *_pair("skip", "x", "s_x", "zp", "skip_d"),
        *_pair("w1", "w1", "s_w", "zp_w", "w1d", axis=0),
        helper.make_node("Conv", ["xd", "w1d"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["b1"], name="bn1"),
        helper.make_node("Add", ["b1", "skip_d"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        *_pair("r", "r", "s_r", "zp", "rd"),
        *_pair("w2", "w2", "s_w", "zp_w", "w2d", axis=0),
        helper.make_node("Conv", ["rd", "w2d"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    return nodes, inits


def make_model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], opset: int = 19,
               out_type: int = F32, in_type: int = F32) -> onnx.ModelProto:  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", in_type, [1, C, 8, 8])],
        [helper.make_tensor_value_info("y", out_type, [1, C, 8, 8])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def base_model() -> onnx.ModelProto:
    return make_model(*base_parts())


def _node(nodes: list[onnx.NodeProto], name: str) -> onnx.NodeProto:
    return next(n for n in nodes if n.name == name)


def _replace(inits: list[onnx.TensorProto], name: str, value: np.ndarray) -> None:
    index = next(i for i, t in enumerate(inits) if t.name == name)
    inits[index] = _const(name, value)


def _set_axis(node: onnx.NodeProto, axis: int) -> None:
    del node.attribute[:]
    node.attribute.append(helper.make_attribute("axis", axis))


# --- one breaker per rule: edit (nodes, inits) in place, return the model -------------------------------------
def break_qdq_pair(nodes, inits):
    dq = _node(nodes, "x/DQ")
    nodes.insert(nodes.index(dq), helper.make_node("Identity", ["x_q"], ["x_q_id"], name="between"))
    dq.input[0] = "x_q_id"
    return make_model(nodes, inits)


def break_pair_params(nodes, inits):
    inits.append(_const("s_other", np.float32(0.1)))
    _node(nodes, "r/DQ").input[1] = "s_other"
    return make_model(nodes, inits)


def break_int8_type(nodes, inits):
    inits.append(_const("zp_u8", np.uint8(0)))
    for name in ("r/Q", "r/DQ"):
        _node(nodes, name).input[2] = "zp_u8"
    return make_model(nodes, inits)


def break_zero_point(nodes, inits):
    inits.append(_const("zp_3", np.int8(3)))
    for name in ("r/Q", "r/DQ"):
        _node(nodes, name).input[2] = "zp_3"
    return make_model(nodes, inits)


def break_scale(nodes, inits):
    _replace(inits, "s_w", np.array([0.02, 0.02, 0.0, 0.02], np.float32))
    return make_model(nodes, inits)


def break_activation_per_tensor(nodes, inits):
    inits += [_const("s_r_c", np.full(C, 0.04, np.float32)), _const("zp_c", np.zeros(C, np.int8))]
    for name in ("r/Q", "r/DQ"):
        node = _node(nodes, name)
        node.input[1], node.input[2] = "s_r_c", "zp_c"
        _set_axis(node, 1)
    return make_model(nodes, inits)


def break_weight_axis(nodes, inits):
    for name in ("w1/Q", "w1/DQ"):
        _set_axis(_node(nodes, name), 1)
    return make_model(nodes, inits)


def break_weighted_op_inputs(nodes, inits):
    _node(nodes, "conv2").input[1] = "w2"  # float weight, dequantized input
    return make_model(nodes, inits)


def break_residual_add(nodes, inits):
    _node(nodes, "add").input[1] = "x"  # the skip input is float
    return make_model(nodes, inits)


def break_fused_scales(nodes, inits):
    relu = _node(nodes, "relu")
    nodes.insert(nodes.index(relu) + 1, helper.make_node("MaxPool", ["rd"], ["pooled"], name="pool",
                                                         kernel_shape=[1, 1]))  # fmt: skip
    inits.append(_const("s_pool", np.float32(0.08)))
    nodes[nodes.index(_node(nodes, "w2/Q")) : nodes.index(_node(nodes, "w2/Q"))] = _pair(
        "p", "pooled", "s_pool", "zp", "pd"
    )
    _node(nodes, "conv2").input[0] = "pd"
    return make_model(nodes, inits)


def break_integer_ops(nodes, inits):
    conv2 = _node(nodes, "conv2")
    inits += [_const("w2_int8", np.ones((C, C, 3, 3), np.int8))]
    index = nodes.index(conv2)
    nodes[index : index + 1] = [
        helper.make_node("ConvInteger", ["r_q", "w2_int8"], ["acc"], name="conv_int", pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["acc"], ["y"], name="to_float", to=F32),
    ]
    _node(nodes, "r/DQ").output[0] = "rd_unused"
    return make_model(nodes, inits)


def break_type_consistent(nodes, inits):
    relu = _node(nodes, "relu")
    nodes.insert(nodes.index(relu), helper.make_node("Cast", ["skip_d"], ["skip16"], name="to16", to=F16))
    _node(nodes, "add").input[1] = "skip16"  # Add(float32, float16)
    return make_model(nodes, inits)


def break_q_input_type(nodes, inits):
    inits.append(_const("s_r16", np.float16(0.04)))
    _node(nodes, "r/Q").input[1] = "s_r16"  # float32 input, float16 scale (legal in opset 25, not in TensorRT)
    _node(nodes, "r/DQ").input[1] = "s_r16"
    _node(nodes, "conv2").input[0] = "rd32"
    nodes.insert(nodes.index(_node(nodes, "conv2")), helper.make_node("Cast", ["rd"], ["rd32"], name="up", to=F32))
    return make_model(nodes, inits, opset=25)


def break_dq_output_type(nodes, inits):
    dq = _node(nodes, "r/DQ")
    dq.attribute.append(helper.make_attribute("output_dtype", F16))  # float16 out of a float32 scale
    nodes.insert(nodes.index(_node(nodes, "conv2")), helper.make_node("Cast", ["rd"], ["rd32"], name="up", to=F32))
    _node(nodes, "conv2").input[0] = "rd32"
    return make_model(nodes, inits, opset=25)


def break_fp32_island(nodes, inits):
    """A float16 graph (float16 input) whose Relu alone computes in float32 between Casts."""
    for name in ("s_x", "s_r"):
        _replace(inits, name, np.float16(0.05))
    _replace(inits, "s_w", np.full(C, 0.02, np.float16))
    for name in ("w1", "w2", "bn_scale", "bn_bias", "bn_mean", "bn_var"):
        tensor = next(t for t in inits if t.name == name)
        _replace(inits, name, numpy_helper.to_array(tensor).astype(np.float16))
    relu = _node(nodes, "relu")
    relu.input[0], relu.output[0] = "a32", "r32"
    index = nodes.index(relu)
    nodes.insert(index, helper.make_node("Cast", ["a"], ["a32"], name="up", to=F32))
    nodes.insert(index + 2, helper.make_node("Cast", ["r32"], ["r"], name="down", to=F16))
    return make_model(nodes, inits, out_type=F16, in_type=F16)


BREAKERS: dict[str, Callable] = {
    "qdq-pair": break_qdq_pair,
    "pair-params": break_pair_params,
    "int8-type": break_int8_type,
    "zero-point": break_zero_point,
    "scale": break_scale,
    "activation-per-tensor": break_activation_per_tensor,
    "weight-axis": break_weight_axis,
    "weighted-op-inputs": break_weighted_op_inputs,
    "residual-add": break_residual_add,
    "fused-scales": break_fused_scales,
    "integer-ops": break_integer_ops,
    "type-consistent": break_type_consistent,
    "q-input-type": break_q_input_type,
    "dq-output-type": break_dq_output_type,
    "fp32-island": break_fp32_island,
}
"""rule id -> the edit of the base graph that breaks it."""

"""The ONNX Runtime rewrite's transformer passes on small graphs built by hand: the attention mask (``Where`` of
``-inf`` before a Softmax becomes an ``Add``), a Linear on a ``[batch, sequence, K]`` input as a ``Gemm``
between Reshapes (ORT's ``QGemm``), and a residual LayerNorm kept apart from its add (no
``SkipLayerNormalization``).

Each graph runs in ONNX Runtime before and after the pass (graph optimizations off: ORT computes exactly the
nodes given; on: what ORT fuses) and the quantized outputs are compared in quantization steps.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.graphs.ir_graph import run_on_graph
from qdq.graphs.onnx import on_ir
from qdq.targets.onnxruntime.passes.attention_mask import masks_to_adds
from qdq.targets.onnxruntime.passes.biases import quantize_biases
from qdq.targets.onnxruntime.passes.gemm import matmuls_to_gemm
from qdq.targets.onnxruntime.passes.layernorms import keep_layernorms_apart
from qdq.targets.onnxruntime.passes.uint8_activations import activations_to_uint8
from qdq.targets.onnxruntime.passes.zero_biases import drop_zero_biases

F32 = np.float32
STEP = 1 / 255  # the softmax output quantizer's step (uint8, zero point 0)


def _model(nodes, inputs, outputs, constants) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), name) for name, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


def _session(model: onnx.ModelProto, options):
    """An ORT session of ``model``; on a CPU whose int8 dot products saturate (x86 without VNNI) its int8 weights
    run as uint8 (the same values, exact U8U8 kernels), as qdq's runtime runs them."""
    import onnxruntime as ort

    from qdq.cpu import int8_dot_saturates
    from qdq.targets.onnxruntime.passes.weight_encoding import encode_weights_uint8

    if int8_dot_saturates():
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        encode_weights_uint8(copy)
        model = copy
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, optimize: bool = False, **feeds) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    return _session(model, options).run(None, feeds)[0]


def mask_graph(fill_first: bool, fill: float = -np.inf, softmax: bool = True) -> onnx.ModelProto:
    """scores [2, 3, 4, 4] masked by a bool [2, 1, 4, 4] (masked_fill's form when fill_first), softmax, Q/DQ."""
    inputs = ["masked", "fill", "scores"] if fill_first else ["keep", "scores", "fill"]
    condition = helper.make_node("Not", ["keep"], ["masked"]) if fill_first else None
    nodes = [n for n in (condition,) if n is not None]
    nodes.append(helper.make_node("Where", inputs, ["filled"], name="where"))
    reader = "filled"
    if softmax:
        nodes.append(helper.make_node("Softmax", ["filled"], ["probs"], axis=-1))
        reader = "probs"
    nodes += [
        helper.make_node("QuantizeLinear", [reader, "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    return _model(
        nodes,
        [("scores", TensorProto.FLOAT, [2, 3, 4, 4]), ("keep", TensorProto.BOOL, [2, 1, 4, 4])],
        [("y", [2, 3, 4, 4])],
        {"fill": np.array(fill, F32), "s": np.array(STEP, F32), "z": np.array(0, np.uint8)},
    )


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    keep = rng.random((2, 1, 4, 4)) > 0.3
    keep[..., 0] = True  # every row attends somewhere
    return {"scores": (4 * rng.standard_normal((2, 3, 4, 4))).astype(F32), "keep": keep}


@pytest.mark.parametrize("fill_first", [True, False])
def test_a_minus_inf_mask_before_softmax_becomes_an_add_of_a_mask_sized_where(fill_first):
    model = mask_graph(fill_first)
    feeds = _feeds()
    before = _run(model, **feeds)
    assert run_on_graph(model, masks_to_adds) == 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Where"] == 1 and ops["Add"] == 1
    (where,) = [n for n in model.graph.node if n.op_type == "Where"]
    assert "scores" not in where.input  # the Where reads only the mask and constants: the mask's size
    after = _run(model, **feeds)
    # masked scores: probability exactly 0 before and after; 0 steps apart everywhere
    assert np.count_nonzero(before == 0) >= 2 * 3 * 4  # the mask did mask something
    assert np.abs(np.rint((after - before) / STEP)).max() == 0
    np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize(("fill", "softmax"), [(-1e4, True), (-np.inf, False)])
def test_other_wheres_stay(fill, softmax):
    model = mask_graph(True, fill=fill, softmax=softmax)
    assert run_on_graph(model, masks_to_adds) == 0
    assert [n.op_type for n in model.graph.node].count("Add") == 0


def residual_graph() -> onnx.ModelProto:
    """DQ(x) @ DQ(W) + b, added to the residual r, LayerNorm; batch and sequence dimensions symbolic."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "sw"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Add", ["hb", "r"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1),
    ]
    constants = {
        "sx": np.array(0.05, F32), "zx": np.array(128, np.uint8), "sw": np.array(0.01, F32),
        "w": rng.integers(-127, 128, (16, 16)).astype(np.int8), "b": rng.standard_normal(16).astype(F32),
        "gamma": np.ones(16, F32), "beta": np.zeros(16, F32),
    }  # fmt: skip
    dims = ["batch", "sequence", 16]
    model = _model(
        nodes, [("x", TensorProto.FLOAT, dims), ("r", TensorProto.FLOAT, dims)], [("y", dims)], constants
    )
    model.graph.value_info.extend(
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["unk__0", "unk__1", 16])]  # what onnx infers
    )
    return model


def _optimized_nodes(model: onnx.ModelProto, tmp_path) -> list:
    """The nodes of the graph ONNX Runtime makes of ``model`` (every optimization on)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    _session(model, options)
    return list(onnx.load(options.optimized_model_filepath).graph.node)


def _optimized_ops(model: onnx.ModelProto, tmp_path) -> collections.Counter:
    return collections.Counter(n.op_type for n in _optimized_nodes(model, tmp_path))


def _with_symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ORT's symbolic shapes recorded: the information ORT needs to fuse SkipLayerNormalization."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    del model.graph.value_info[:]
    return SymbolicShapeInference.infer_shapes(model, auto_merge=True)


def test_a_residual_layernorm_reads_its_add_through_a_reshape_and_is_not_fused(tmp_path):
    """With named shapes ORT fuses Add(bias) + Add(residual) + LayerNorm into its slow SkipLayerNormalization;
    after the pass it cannot, whatever shapes it is given, and the output is bit-identical (the same rows
    normalized) and equal to a numpy LayerNorm."""
    model = _with_symbolic_shapes(residual_graph())
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal((2, 5, 16)).astype(F32) for k in ("x", "r")}
    before = _run(model, **feeds)
    assert _optimized_ops(model, tmp_path)["SkipLayerNormalization"] == 1  # what the pass prevents

    assert run_on_graph(model, keep_layernorms_apart) == 1
    model = _with_symbolic_shapes(model)  # ORT gets every shape it could use
    ops = _optimized_ops(model, tmp_path)
    assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] == 1
    after = _run(model, **feeds)
    assert after.shape == (2, 5, 16)
    np.testing.assert_array_equal(after, before)
    # optimized, ORT's int8 product sums in another order: float rounding apart
    np.testing.assert_allclose(_run(model, optimize=True, **feeds), before, rtol=1e-5, atol=1e-5)

    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dq = lambda q, s, z=0: (q.astype(np.float64) - z) * s  # noqa: E731
    xq = np.clip(np.rint(feeds["x"] / consts["sx"]) + consts["zx"], 0, 255)
    total = dq(xq, consts["sx"], consts["zx"]) @ dq(consts["w"], consts["sw"]) + consts["b"] + feeds["r"]
    mean, var = total.mean(-1, keepdims=True), total.var(-1, keepdims=True)
    oracle = (total - mean) / np.sqrt(var + 1e-5) * consts["gamma"] + consts["beta"]
    np.testing.assert_allclose(after, oracle, rtol=1e-4, atol=1e-4)


def test_layernorms_of_other_inputs_or_shared_sums_stay(tmp_path):
    """Only an Add read by the LayerNorm alone is what ORT fuses: a sum also read elsewhere (a pre-LN block's
    residual stream) and a LayerNorm of a non-Add are left as they are."""
    model = residual_graph()
    model.graph.node.append(helper.make_node("Relu", ["sum"], ["other"]))
    model.graph.output.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, None))
    assert run_on_graph(model, keep_layernorms_apart) == 0
    norm = residual_graph()
    norm.graph.node[-1].input[0] = "hb"  # the LayerNorm reads the bias Add, which the residual Add also reads
    assert run_on_graph(norm, keep_layernorms_apart) == 0


def linear_graph(quantize_output: bool, k: int = 32, n: int = 24) -> onnx.ModelProto:
    """A Linear as torch exports it on a 3-D input: Q/DQ(x) @ Transpose(DQ(W [N, K])) + b [, Q/DQ]."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="x_dq"),
        helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0),
        helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xd", "wt"], ["h"], name="linear"),
        helper.make_node("Add", ["h", "b"], ["y" if not quantize_output else "hb"]),
    ]
    if quantize_output:
        nodes += [
            helper.make_node("QuantizeLinear", ["hb", "sy", "zy"], ["yq"]),
            helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"]),
        ]
    constants = {
        "sx": np.array(0.04, F32), "zx": np.array(128, np.uint8),
        "w": rng.integers(-127, 128, (n, k)).astype(np.int8), "sw": rng.uniform(0.002, 0.01, n).astype(F32),
        "zw": np.zeros(n, np.int8), "b": rng.standard_normal(n).astype(F32),
        "sy": np.array(0.25, F32), "zy": np.array(128, np.uint8),
    }  # fmt: skip
    return _model(nodes, [("x", TensorProto.FLOAT, ["batch", "sequence", k])], [("y", ["batch", "sequence", n])],
                  constants)  # fmt: skip


@pytest.mark.parametrize("quantize_output", [True, False])
def test_a_linear_on_a_sequence_becomes_a_gemm_that_onnx_runtime_runs_as_qgemm(quantize_output, tmp_path):
    import onnxruntime as ort

    model = linear_graph(quantize_output)
    x = np.random.default_rng(4).standard_normal((2, 5, 32)).astype(F32) * 2
    before = _run(model, x=x)
    # then int32 biases at s_x * s_w: the Gemm reads DQ(x) through the Reshape
    assert on_ir(model, lambda m: (matmuls_to_gemm(m.graph, m), quantize_biases(m.graph, []))) == [(1, 1)]
    ops = [n.op_type for n in model.graph.node]
    assert "MatMul" not in ops and "Transpose" not in ops and ops.count("Gemm") == 1
    (gemm,) = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemm.input) == 3 and next(a.i for a in gemm.attribute if a.name == "transB") == 1
    x_dq = next(n for n in model.graph.node if n.name == "x_dq")
    assert x_dq.input[0] == "xq" and x_dq.output[0] == "xd"  # the input's Q/DQ pair is untouched
    assert _run(model, x=x).shape == before.shape == (2, 5, 24)

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = _session(model, options)
    fused = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    assert fused["QGemm"] == 1 and fused["Gemm"] == 0 and fused["MatMulIntegerToFloat"] == 0
    assert fused["Add"] == 0  # the bias is inside the int8 kernel
    assert fused["QuantizeLinear"] == 1  # the input's; the output's is folded into QGemm when there is one
    got = session.run(None, {"x": x})[0]
    if quantize_output:  # in output steps: the int32 bias moves the sum by <= s_x * s_w / 2, far below a step
        assert np.abs(np.rint((got - before) / 0.25)).max() <= 1
        assert np.mean(got == before) > 0.99
    else:
        assert np.abs(got - before).max() <= 0.5 * 0.04 * 0.01 + 1e-4  # half the largest s_x * s_w


@pytest.mark.parametrize("zero", [True, False])
def test_a_gemm_bias_of_zeros_is_dropped_and_others_stay(zero, tmp_path):
    """A folded key or value bias (all 0): no bias input left, so ORT's QGemm makes no int32 bias pass."""
    model = linear_graph(True)
    if zero:
        b = next(i for i in model.graph.initializer if i.name == "b")
        b.CopyFrom(numpy_helper.from_array(np.zeros(24, F32), "b"))
    x = np.random.default_rng(4).standard_normal((2, 5, 32)).astype(F32) * 2
    before = _run(model, x=x)
    _, dropped, _ = on_ir(
        model, lambda m: (matmuls_to_gemm(m.graph, m), drop_zero_biases(m.graph), quantize_biases(m.graph, []))
    )[0]
    assert dropped == int(zero)
    (gemm,) = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert (len(gemm.input) == 3) is not zero
    np.testing.assert_array_equal(_run(model, x=x), before)  # the same product (no bias, or the same one)
    (qgemm,) = [n for n in _optimized_nodes(model, tmp_path) if n.op_type == "QGemm"]
    assert (len(qgemm.input) > 6 and bool(qgemm.input[6])) is not zero  # QGemm's input 6: the int32 bias


def test_a_linear_reading_a_layout_op_alone_stays_a_matmul():
    """The attention context (``Reshape(Transpose(probs @ V))`` read only by its Q): reading its shape would
    keep ORT from moving that Q back into the QLinearMatMul before it."""
    model = linear_graph(True)
    model.graph.node[0].input[0] = "x_moved"
    model.graph.node.insert(0, helper.make_node("Transpose", ["x"], ["x_moved"], perm=[1, 0, 2]))
    assert on_ir(model, lambda m: matmuls_to_gemm(m.graph, m)) == [0]


def scaled_query_graph(factor: float, step: float = 0.02) -> onnx.ModelProto:
    """``Q(query * factor) · DQ(K)ᵀ`` (the onnxruntime target's attention scores): Mul, Q/DQ int8, MatMul."""
    nodes = [
        helper.make_node("Mul", ["query", "factor"], ["scaled"]),
        helper.make_node("QuantizeLinear", ["scaled", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"]),
        helper.make_node("QuantizeLinear", ["keyT", "sk", "z"], ["qk"]),
        helper.make_node("DequantizeLinear", ["qk", "sk", "z"], ["dk"]),
        helper.make_node("MatMul", ["dq", "dk"], ["scores"]),
    ]
    return _model(
        nodes,
        [("query", TensorProto.FLOAT, [2, 3, 5, 8]), ("keyT", TensorProto.FLOAT, [2, 3, 8, 5])],
        [("scores", [2, 3, 5, 5]), ("dq", [2, 3, 5, 8])],
        {"factor": np.array(factor, F32), "s": np.array(step, F32), "sk": np.array(0.03, F32),
         "z": np.array(0, np.int8)},
    )


def _query_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    # values on and next to rounding boundaries of the scaled grid: x * factor / step = n + 0.5 exactly
    query = (rng.integers(-300, 300, (2, 3, 5, 8)) + 0.5).astype(F32) * F32(0.02) / F32(0.125)
    query.reshape(-1)[::7] = rng.standard_normal(query.size)[::7].astype(F32) * 10
    return {"query": query, "keyT": rng.standard_normal((2, 3, 8, 5)).astype(F32)}


@pytest.mark.parametrize("factor", [0.125, 0.25, 2.0])
def test_power_of_two_mul_folds_into_the_quantizer_exactly(factor):
    from qdq.graphs.onnx_tags import INPUT_SCALE_KEY
    from qdq.targets.onnxruntime.passes.scaled_inputs import fold_scaled_inputs

    model = scaled_query_graph(factor)
    feeds = _query_feeds()
    before = _run(model, **feeds)
    q_before = _run(_with_output(model, "dq"), **feeds)
    assert run_on_graph(model, fold_scaled_inputs) == 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Mul"] == 0
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.output[0] == "q")
    assert q.input[0] == "query"
    step = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == q.input[1]))
    assert step * F32(factor) == F32(0.02) and step == F32(0.02) / F32(factor)
    assert {p.key: p.value for p in q.metadata_props}[INPUT_SCALE_KEY] == repr(factor)
    # the DQ is unchanged: the same codes, so the same scores, bit for bit (ties at n + 0.5 included)
    np.testing.assert_array_equal(_run(_with_output(model, "dq"), **feeds), q_before)
    np.testing.assert_array_equal(_run(model, **feeds), before)
    np.testing.assert_array_equal(_run(model, optimize=True, **feeds), before)  # ORT's fused int8 matmul


@pytest.mark.parametrize("factor", [1 / np.sqrt(32), 0.0, -0.125])
def test_other_multipliers_are_left(factor):
    from qdq.targets.onnxruntime.passes.scaled_inputs import fold_scaled_inputs

    model = scaled_query_graph(factor)
    assert run_on_graph(model, fold_scaled_inputs) == 0
    assert collections.Counter(n.op_type for n in model.graph.node)["Mul"] == 1


def test_a_mul_read_elsewhere_is_left():
    from qdq.targets.onnxruntime.passes.scaled_inputs import fold_scaled_inputs

    model = scaled_query_graph(0.125)
    model.graph.output.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [2, 3, 5, 8]))
    assert run_on_graph(model, fold_scaled_inputs) == 0


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of ``model`` whose first output is ``name``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    first = next(o for o in copy.graph.output if o.name == name)
    kept = [o for o in copy.graph.output if o.name != name]
    del copy.graph.output[:]
    copy.graph.output.extend([first, *kept])
    return copy


def packed_qkv_graph(bias: bool = True) -> onnx.ModelProto:
    """timm's packed qkv after the gemm pass (int8 activations, float bias: the passes after it retype them):
    Q/DQ(x [2, 5, 8]) -> Reshape [-1, 8] -> Gemm(W [3*2*4, 8] per row) -> Reshape back [2, 5, 24] ->
    Reshape [-1, 5, 3, 2, 4] -> Transpose (2, 0, 3, 1, 4) -> Slice/Squeeze per part -> Q/DQ (three scales)."""
    rng = np.random.default_rng(5)
    w = rng.integers(-127, 128, (24, 8)).astype(np.int8)
    constants = {"sx": np.array(0.05, F32), "zx": np.array(0, np.int8), "w": w,
                 "sw": (rng.random(24) * 0.01 + 0.005).astype(F32), "zw": np.zeros(24, np.int8),
                 "rows": np.array([-1, 8]), "columns": np.array([24]), "view": np.array([-1, 5, 3, 2, 4]),
                 "zero": np.array([0]), "axis0": np.array([0])}  # fmt: skip
    if bias:
        constants["b"] = rng.standard_normal(24).astype(F32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("Reshape", ["xd", "rows"], ["x2d"]),
        helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0),
        helper.make_node("Gemm", ["x2d", "wd"] + (["b"] if bias else []), ["y2d"], transB=1),
        helper.make_node("Shape", ["x"], ["lead"], start=0, end=-1),
        helper.make_node("Concat", ["lead", "columns"], ["shape"], axis=0),
        helper.make_node("Reshape", ["y2d", "shape"], ["y"]),
        helper.make_node("Reshape", ["y", "view"], ["v"]),
        helper.make_node("Transpose", ["v"], ["t"], perm=[2, 0, 3, 1, 4]),
    ]
    outputs = []
    for i, step in enumerate((0.04, 0.03, 0.02)):
        constants[f"s{i}"], constants[f"at{i}"], constants[f"to{i}"] = (np.array(step, F32), np.array([i]),
                                                                         np.array([i + 1]))  # fmt: skip
        nodes += [
            helper.make_node("Slice", ["t", f"at{i}", f"to{i}", "axis0"], [f"cut{i}"]),
            helper.make_node("Squeeze", [f"cut{i}", "axis0"], [f"part{i}"]),
            helper.make_node("QuantizeLinear", [f"part{i}", f"s{i}", "zx"], [f"q{i}"]),
            helper.make_node("DequantizeLinear", [f"q{i}", f"s{i}", "zx"], [f"out{i}"]),
        ]
        outputs.append((f"out{i}", [2, 2, 5, 4]))
    return _model(nodes, [("x", TensorProto.FLOAT, [2, 5, 8])], outputs, constants)


def _run_all(model: onnx.ModelProto, optimize: bool, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    session = _session(model, options)
    return session.run(None, {"x": x})


@pytest.mark.parametrize("bias", [True, False])
def test_packed_projection_becomes_one_gemm_per_quantized_part(bias, tmp_path):
    from qdq.targets.onnxruntime.passes.packed_projections import split_packed_projections

    model = packed_qkv_graph(bias)
    x = (np.random.default_rng(6).standard_normal((2, 5, 8)) * 2).astype(F32)
    before = _run_all(model, False, x)
    assert run_on_graph(model, split_packed_projections) == 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Gemm"] == 3 and ops["Slice"] == ops["Squeeze"] == 0 and ops["Transpose"] == 3
    for got, expected in zip(_run_all(model, False, x), before):  # reference kernels: the same codes
        np.testing.assert_array_equal(got, expected)
    # the passes after it, as the rewrite runs them: uint8 activations, int32 biases
    on_ir(model, lambda m: (activations_to_uint8(m.graph), quantize_biases(m.graph, [])))
    for got, expected, step in zip(_run_all(model, True, x), before, (0.04, 0.03, 0.02)):
        assert np.abs(got - expected).max() <= step * 1.001  # QGemm requantizes in float, int32 bias: <= 1 step
    fused = _optimized_ops(model, tmp_path)
    assert fused["QGemm"] == 3 and fused["Split"] == 0 and fused["QuantizeLinear"] == 1  # x's Q alone


def test_a_packed_projection_with_a_float_part_is_left():
    from qdq.targets.onnxruntime.passes.packed_projections import split_packed_projections

    model = packed_qkv_graph()
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "part2")
    q.op_type, q.input[:] = "Relu", ["part2"]  # one part read by a float op: the cut stays
    del model.graph.node[[n.output[0] for n in model.graph.node].index("out2")]
    model.graph.output[2].name = "q2"
    assert run_on_graph(model, split_packed_projections) == 0


def bias_graph(reader: str) -> onnx.ModelProto:
    """DQ(x [6, 8]) -> Gemm(DQ(W [16, 8]), float bias) -> ``reader``: ``"gelu"``, a Gelu; ``"gelu_3d"``, a Reshape
    to [2, 3, 16] and a Gelu (a transformer's fc1 in the gemm pass's form); ``"residual"``, that Reshape, an Add
    of a float skip, a LayerNormalization (BERT's fc2)."""
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0),
        helper.make_node("Gemm", ["xd", "wd", "b"], ["y"], transB=1),
    ]
    constants = {"sx": np.array(0.05, np.float32), "zx": np.array(128, np.uint8),
                 "w": rng.integers(-127, 128, (16, 8)).astype(np.int8), "sw": np.full(16, 0.01, np.float32),
                 "zw": np.zeros(16, np.int8), "b": rng.standard_normal(16).astype(np.float32)}  # fmt: skip
    inputs = [("x", TensorProto.FLOAT, [6, 8])]
    if reader == "gelu":
        nodes.append(helper.make_node("Gelu", ["y"], ["out"]))
    elif reader == "gelu_3d":
        nodes += [helper.make_node("Reshape", ["y", "shape"], ["y3"]), helper.make_node("Gelu", ["y3"], ["out"])]
        constants["shape"] = np.array([2, 3, 16])
    else:
        # the gemm pass's form: the Gemm between Reshapes, [2, 3, 16] back (ORT fuses SkipLayerNorm on 3-D only)
        nodes += [helper.make_node("Reshape", ["y", "shape"], ["y3"]),
                  helper.make_node("Add", ["y3", "skip"], ["sum"]),
                  helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["out"], axis=-1)]  # fmt: skip
        constants |= {"gamma": rng.uniform(0.5, 1.5, 16).astype(np.float32), "shape": np.array([2, 3, 16]),
                      "beta": rng.standard_normal(16).astype(np.float32)}  # fmt: skip
        inputs.append(("skip", TensorProto.FLOAT, [2, 3, 16]))
    model = _model(nodes, inputs, [("out", [6, 16] if reader == "gelu" else [2, 3, 16])], constants)
    model.opset_import[0].version = 20  # Gelu
    return model


@pytest.mark.parametrize(
    ("reader", "fused"),
    [("gelu", "BiasGelu"), ("gelu_3d", "Gelu"), ("residual", "SkipLayerNormalization")],
)
def test_the_bias_of_a_gemm_before_a_gelu_or_residual_layernorm_becomes_a_float_add(reader, fused, tmp_path):
    """Before the gemm pass's Reshape, the Add stays apart from the Gelu (ORT's BiasGelu is the slower form); a
    2-D Gemm read by the Gelu itself leaves ORT to fuse them."""
    from qdq.targets.onnxruntime.passes.float_biases import biases_to_float_adds

    model = bias_graph(reader)
    rng = np.random.default_rng(9)
    feeds = {"x": (rng.standard_normal((6, 8)) * 3).astype(F32)}
    if reader == "residual":
        feeds["skip"] = rng.standard_normal((2, 3, 16)).astype(F32)
    before = _run(model, **feeds)
    assert run_on_graph(model, biases_to_float_adds) == 1
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert len(gemm.input) == 2
    np.testing.assert_allclose(_run(model, **feeds), before, rtol=1e-6, atol=1e-6)  # the same float bias, after
    np.testing.assert_allclose(_run(model, optimize=True, **feeds), before, rtol=1e-5, atol=1e-5)
    ops = _optimized_ops(model, tmp_path)
    assert ops[fused] == 1 and ops["QGemm"] == 1  # the int8 product, then the float bias and the op
    if reader == "gelu_3d":  # the Add on the Gemm's 2-D output, the Reshape, the Gelu
        assert ops["BiasGelu"] == 0 and ops["Add"] == 1
        add = next(n for n in model.graph.node if n.op_type == "Add")
        assert add.input[0] == gemm.output[0]
    else:
        assert ops["Add"] == 0  # in one kernel with the op


def test_a_gemm_read_by_other_ops_keeps_its_bias():
    from qdq.targets.onnxruntime.passes.float_biases import biases_to_float_adds

    model = bias_graph("residual")
    norm = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    norm.op_type, norm.input[:] = "Relu", ["sum"]  # an add no LayerNorm reads (e.g. a CNN's): nothing fuses it
    for attribute in list(norm.attribute):
        norm.attribute.remove(attribute)
    assert run_on_graph(model, biases_to_float_adds) == 0

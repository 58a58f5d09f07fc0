"""Attention written out op by op in an ONNX file is one ``Attention`` op of the view, and the targets' attention facts
place its Q/DQ: the forms exporters write (a scale after ``Q·Kᵀ``, or on Q and Kᵀ before it; a mask ``Add``; the
NaN guard of torch's scaled-dot-product export; paddle2onnx's Flatten and Reshape around the softmax), the softmax
scale moved onto the query for ONNX Runtime, TensorRT's head sizes and lengths. Small graphs written with
``onnx.helper``; the file's outputs against the float graph's, on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.graphs.onnx_tags import qdq_sites
from qdq.onnx_in.attention import find_attention

FLOAT = TensorProto.FLOAT


def _attention(form: str, head: int = 16) -> onnx.ModelProto:
    """One attention of two heads over ``head`` features, as an exporter writes it (``form``): ``"div"`` (Q·Kᵀ / sqrt(E)
    + mask), ``"sdpa"`` (Q and Kᵀ each times E^-1/4, + mask, the NaN guard), ``"paddle"`` (Q times E^-1/2, Flatten,
    Softmax, Reshape to Q·Kᵀ's shape)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    inits = [numpy_helper.from_array(np.array(np.sqrt(head), np.float32), "root"),
             numpy_helper.from_array(np.array(head ** -0.25, np.float32), "quarter"),
             numpy_helper.from_array(np.array(head ** -0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]  # fmt: skip
    query, key = "q", "kt"
    if form == "sdpa":
        nodes += [helper.make_node("Mul", ["q", "quarter"], ["qs"]), helper.make_node("Mul", ["kt", "quarter"], ["ks"])]
        query, key = "qs", "ks"
    elif form == "paddle":
        nodes += [helper.make_node("Mul", ["q", "half"], ["qs"])]
        query = "qs"
    nodes.append(helper.make_node("MatMul", [query, key], ["scores"], name="scores"))
    if form == "div":
        nodes.append(helper.make_node("Div", ["scores", "root"], ["scaled"]))
    if form == "paddle":
        nodes += [helper.make_node("Shape", ["scores"], ["shape"]), helper.make_node("Flatten", ["scores"], ["flat"],
                  axis=3), helper.make_node("Softmax", ["flat"], ["soft"]),
                  helper.make_node("Reshape", ["soft", "shape"], ["probs"])]  # fmt: skip
    else:
        nodes += [helper.make_node("Add", ["scaled" if form == "div" else "scores", "mask"], ["masked"]),
                  helper.make_node("Softmax", ["masked"], ["probs" if form == "div" else "soft"], axis=-1)]  # fmt: skip
    if form == "sdpa":
        nodes += [helper.make_node("IsNaN", ["soft"], ["nan"]), helper.make_node("Where", ["nan", "zero", "soft"],
                                                                                 ["probs"])]  # fmt: skip
    nodes.append(helper.make_node("MatMul", ["probs", "v"], ["y"], name="context"))
    shape = [1, 2, "length", head]
    inputs = [helper.make_tensor_value_info(name, FLOAT, shape) for name in "qkv"]
    if form != "paddle":
        inputs.append(helper.make_tensor_value_info("mask", FLOAT, [1, 1, 1, "length"]))
    graph = helper.make_graph(nodes, form, inputs, [helper.make_tensor_value_info("y", FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(model: onnx.ModelProto, length: int = 6, count: int = 3) -> list[dict[str, np.ndarray]]:
    found = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        feed = {name: rng.normal(size=(1, 2, length, 16)).astype(np.float32) for name in "qkv"}
        if any(i.name == "mask" for i in model.graph.input):
            feed["mask"] = np.where(np.arange(length) < length - 1, 0.0, -1e4).astype(np.float32).reshape(1, 1, 1, -1)
        found.append(feed)
    return found


def _run(model: onnx.ModelProto | str, feed: dict[str, np.ndarray]) -> np.ndarray:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("form", ["div", "sdpa", "paddle"])
@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_attention_written_out_is_one_op_with_its_four_tensors_quantized(tmp_path, form, target):
    model = _attention(form)
    (found,) = find_attention(ir.from_proto(model).graph, {t.name: 1 for t in model.graph.initializer}).values()
    assert len(found.nodes) == {"div": 5, "sdpa": 6, "paddle": 5}[form]
    feeds = _feeds(model)
    result = qdq.quantize_onnx(model, feeds, tmp_path / "int8.onnx", target=target, method="max", progress=False)
    written = onnx.load(str(result.path))
    producers = {out: node for node in written.graph.node for out in node.output}
    context, scores = (next(n for n in written.graph.node if n.name == name) for name in ("context", "scores"))
    assert all(producers[name].op_type == "DequantizeLinear" for name in [*context.input, scores.input[0]])
    assert producers[scores.input[1]].op_type == "DequantizeLinear"  # the key as Q·Kᵀ reads it
    assert len(qdq_sites(written)) == 4
    assert result.int8_ops.get("Attention") == 1  # the mask, added in float, does not make it a float op
    div = [n for n in written.graph.node if n.op_type == "Div"]
    assert len(div) == (1 if form == "div" and target == "tensorrt" else 0)  # ONNX Runtime: the scale is on Q
    reference, got = _run(model, feeds[0]), _run(str(result.path), feeds[0])
    assert np.abs(got - reference).max() < 0.1 * np.abs(reference).max()


def test_onnx_runtime_gets_the_softmax_scale_folded_into_the_query_quantizer(tmp_path):
    model = _attention("div")
    result = qdq.quantize_onnx(model, _feeds(model), tmp_path / "int8.onnx", target="onnxruntime", method="max",
                               progress=False)  # fmt: skip
    written = onnx.load(str(result.path))
    assert not [n for n in written.graph.node if n.op_type in ("Div", "Mul")]  # 1/sqrt(16): exact, folded
    (query,) = [s for s in qdq_sites(written) if s.input_scale != 1.0]
    assert query.input_scale == 0.25 and query.input == "q"
    q = np.concatenate([f["q"] for f in _feeds(model)])
    assert float(query.step) == pytest.approx(0.25 * np.abs(q).max() / 127, rel=1e-6)  # the scaled query's range


@pytest.mark.parametrize(("head", "length", "why"), [(16, 6, None), (8, 6, "head size 8"),
                                                     (16, 520, "sequence length 520")])  # fmt: skip
def test_tensorrt_keeps_attention_float_outside_its_fused_shapes(tmp_path, head, length, why):
    model = _attention("div", head)
    feeds = [{k: (v[..., :head] if k in "qkv" else v) for k, v in f.items()} for f in _feeds(model, length, 1)]
    result = qdq.quantize_onnx(model, feeds, tmp_path / "int8.onnx", target="tensorrt", method="max", progress=False)
    if why is None:
        assert "scores" not in result.float_ops and len(qdq_sites(onnx.load(str(result.path)))) == 4
    else:
        assert why in result.float_ops["scores"] and not qdq_sites(onnx.load(str(result.path)))
    onnx_runtime = qdq.quantize_onnx(model, feeds, tmp_path / "ort.onnx", target="onnxruntime", method="max",
                                     progress=False)  # fmt: skip
    assert len(qdq_sites(onnx.load(str(onnx_runtime.path)))) == 4  # any shape


def test_a_softmax_read_twice_is_no_attention():
    model = _attention("div")
    model.graph.output.append(helper.make_tensor_value_info("probs", FLOAT, [1, 2, "length", "length"]))
    assert find_attention(ir.from_proto(model).graph, {t.name: 1 for t in model.graph.initializer}) == {}

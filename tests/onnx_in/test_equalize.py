"""qdq.onnx_in.equalize: cross-layer equalization in the ONNX front end, on small generated conv -> act -> conv
graphs whose channels differ in scale by construction.

The scales are checked against a numpy oracle (the activation's per-channel peaks computed by hand, ``s_c = (M /
m_c) ** alpha``), the rewritten graph against the original (the same float function), and the written int8 file
against the same file without equalization (closer to the float model on inputs calibration did not see)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.runtime import load_runtime
from qdq.workflow.equalization import SCALE_CAP, UNDO_DB, Scaling, scaled_second


def _pair_model(path, activation="Relu", groups=1, share_weight=False, seed=0):
    """x [N, 3, 8, 8] -> Conv (8 channels, 3x3; channel c's weights scaled by 2**c: peaks spread 128x) -> activation
    -> Conv (1x1, 8 -> 4, or depthwise 8 -> 8; input channel c's weights divided by 2**c: each channel counts as
    much in the output, as when a network's next layer makes up for its previous one's gains) -> y;
    ``share_weight``: a second branch reads conv1's weight too."""
    rng = np.random.default_rng(seed)
    spread = (2.0 ** np.arange(8)).astype(np.float32)[:, None, None, None] / 16
    w1 = rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * spread
    b1 = rng.normal(size=8).astype(np.float32) * spread.reshape(-1) * 0.1
    w2 = rng.normal(size=(4 if groups == 1 else 8, 8 // groups, 1, 1)).astype(np.float32)
    w2 = scaled_second(w2, groups, spread.reshape(-1))
    b2 = np.zeros(w2.shape[0], np.float32)
    act = [helper.make_node("Relu", ["h"], ["a"], name="act")] if activation == "Relu" else [
        helper.make_node("Clip", ["h", "lo", "hi"], ["a"], name="act")]  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="conv1", pads=[1, 1, 1, 1]), *act,
             helper.make_node("Conv", ["a", "w2", "b2"], ["y"], name="conv2", group=groups)]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", w2.shape[0], 8, 8])]
    if share_weight:
        nodes.append(helper.make_node("Conv", ["x", "w1"], ["z"], name="other", pads=[1, 1, 1, 1]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 8, 8, 8]))
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"), numpy_helper.from_array(np.array(6, np.float32),
                                                                                              "hi")]  # fmt: skip
    graph = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              outputs, inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path, w1, b1


def _data(count, seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(8, 3, 8, 8)).astype(np.float32)} for _ in range(count)]


def _activation(x, w1, b1, activation):
    """relu(conv1(x)) (or its clip to [0, 6]) in numpy: padded 3x3 patches."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    patches = np.stack([padded[:, :, i : i + 8, j : j + 8] for i in range(3) for j in range(3)], axis=-1)
    h = np.einsum("nchwk,ock->nohw", patches, w1.reshape(8, 3, 9)) + b1[None, :, None, None]
    return np.clip(h, 0, 6 if activation == "Clip" else np.inf)


def _run(path, feeds):
    with load_runtime(path, "onnxruntime") as runtime:
        return np.concatenate([runtime.run(f)[0] for f in feeds])


def _dequantized_weight(path, conv):
    """The int8 weight of node ``conv`` in the written file, dequantized, and its per-channel step."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    dq = producer[next(n for n in graph.node if n.name == conv).input[1]]
    step = inits[dq.input[1]].reshape(-1, 1, 1, 1)
    zero = inits[dq.input[2]].astype(np.float32).reshape(-1, 1, 1, 1) if len(dq.input) > 2 else 0.0
    return (inits[dq.input[0]].astype(np.float32) - zero) * step, step


def _sqnr(reference, out):
    return 10 * np.log10(np.sum(reference**2) / np.sum((reference - out) ** 2))


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_scales_are_the_oracles_and_the_int8_file_is_closer_to_float(tmp_path, activation):
    source, w1, b1 = _pair_model(tmp_path / "pair.onnx", activation)
    calibration, unseen = _data(4, seed=1), _data(4, seed=2)
    plain = qdq.quantize_onnx(source, calibration, tmp_path / "plain.onnx", target="onnxruntime", method="max",
                              equalize=False, progress=False)  # fmt: skip
    result = qdq.quantize_onnx(source, calibration, tmp_path / "eq.onnx", target="onnxruntime", method="max",
                               equalize=True, progress=False)  # fmt: skip
    assert plain.equalized == []
    [scaling] = result.equalized
    assert (scaling.first, scaling.second) == ("conv1", "conv2")
    peaks = np.concatenate([_activation(b["x"], w1, b1, activation) for b in calibration]).max(axis=(0, 2, 3))
    oracle = (peaks.max() / np.maximum(peaks, peaks.max() / SCALE_CAP)) ** scaling.alpha
    np.testing.assert_allclose(scaling.scales, oracle, rtol=1e-5)
    assert scaling.predicted_db <= -1.0
    assert "Cross-layer equalization: 1 convolution pair(s)" in result.report()
    reference = _run(source, unseen)
    assert _sqnr(reference, _run(result.path, unseen)) > _sqnr(reference, _run(plain.path, unseen)) + 1.0


def test_the_rewritten_graph_computes_the_same_function(tmp_path):
    from qdq.onnx_in.equalize import equalize
    from qdq.onnx_in.prepared import PreparedModel
    from qdq.targets import resolve_target

    source, _, _ = _pair_model(tmp_path / "pair.onnx")
    placement = PreparedModel.load(source).place(resolve_target("onnxruntime"))
    [scaling] = equalize(placement.model, placement.view, _data(2, seed=1), progress=False)
    assert scaling.scales.max() > 2  # a real rescaling, not the identity
    onnx.save(placement.model, str(tmp_path / "equalized.onnx"))
    feeds = _data(2, seed=3)
    np.testing.assert_allclose(_run(tmp_path / "equalized.onnx", feeds), _run(source, feeds), rtol=1e-4, atol=1e-4)


def test_a_depthwise_second_conv_is_equalized_per_channel(tmp_path):
    source, _, _ = _pair_model(tmp_path / "pair.onnx", groups=8)
    calibration, unseen = _data(4, seed=1), _data(4, seed=2)
    result = qdq.quantize_onnx(source, calibration, tmp_path / "eq.onnx", target="tensorrt", method="max",
                               equalize=True, progress=False)  # fmt: skip
    plain = qdq.quantize_onnx(source, calibration, tmp_path / "plain.onnx", target="tensorrt", method="max",
                              equalize=False, progress=False)  # fmt: skip
    assert [s.second for s in result.equalized] == ["conv2"]
    reference = _run(source, unseen)
    assert _sqnr(reference, _run(result.path, unseen)) > _sqnr(reference, _run(plain.path, unseen)) + 1.0


def test_a_weight_another_op_reads_is_left_alone(tmp_path):
    source, _, _ = _pair_model(tmp_path / "pair.onnx", share_weight=True)
    result = qdq.quantize_onnx(source, _data(2, seed=1), tmp_path / "eq.onnx", target="onnxruntime", method="max",
                               equalize=True, progress=False)  # fmt: skip
    assert result.equalized == []


def test_an_earlier_calls_scalings_are_written_again_without_measuring(tmp_path):
    source, _, _ = _pair_model(tmp_path / "pair.onnx")
    calibration, unseen = _data(4, seed=1), _data(2, seed=2)
    first = qdq.quantize_onnx(source, calibration, tmp_path / "a.onnx", target="onnxruntime", progress=False)
    assert first.equalized  # the default (auto) equalizes
    again = qdq.quantize_onnx(source, calibration[:1], tmp_path / "b.onnx", target="onnxruntime", progress=False,
                              value_ranges=first.value_ranges, bias_shifts=first.bias_shifts,
                              equalized=first.equalized, keep_float=first.auto.stem.ops)  # fmt: skip
    np.testing.assert_array_equal(_run(again.path, unseen), _run(first.path, unseen))


def test_scalings_written_again_reach_a_pair_the_new_placement_leaves_float(tmp_path):
    """tune's reuse: the ranges of the first call were calibrated on the scaled activation, so a later file that
    keeps ``conv1`` float still takes the scaling (its float function is the same)."""
    source, w1, _ = _pair_model(tmp_path / "pair.onnx")
    calibration = _data(4, seed=1)
    first = qdq.quantize_onnx(source, calibration, tmp_path / "a.onnx", target="onnxruntime", progress=False)
    again = qdq.quantize_onnx(source, calibration[:1], tmp_path / "b.onnx", target="onnxruntime", progress=False,
                              value_ranges=first.value_ranges, equalized=first.equalized,
                              keep_float=["conv1"])  # fmt: skip
    assert [(s.first, s.second) for s in again.equalized] == [("conv1", "conv2")]
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(again.path)).graph.initializer}
    scales = first.equalized[0].scales.reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(written["w1"], w1 * scales, rtol=1e-6)  # conv1 float: its weight as scaled


def test_a_scaling_the_held_out_samples_reject_is_undone(tmp_path, monkeypatch):
    """A harmful scaling (forced: every other channel 64x up, the rest 64x down) scores lower on the held-out
    samples than the weights as they were: the file keeps its weights, and the scores say why."""
    import qdq.onnx_in.equalize as equalize

    def harmful(pair, stats, weight, groups, levels):
        scales = np.where(np.arange(stats.peak.size) % 2, 64.0, 1 / 64).astype(np.float32)
        return Scaling(pair.first.name, pair.second.name, 0.5, scales, -20.0)

    monkeypatch.setattr(equalize, "plan_scaling", harmful)
    source, w1, _ = _pair_model(tmp_path / "pair.onnx")
    result = qdq.quantize_onnx(source, _data(8, seed=1), tmp_path / "q.onnx", target="onnxruntime", progress=False)
    with_it, without = result.auto.equalization
    assert with_it <= without - UNDO_DB and result.equalized == [] and result.auto.equalized == []
    assert "equalization not kept" in result.auto.summary()
    weight, step = _dequantized_weight(result.path, "conv1")
    assert np.all(np.abs(weight - w1) <= step / 2 + 1e-7)  # conv1's int8 weight is w1's, not w1 scaled


def test_undoing_a_chain_of_pairs_restores_the_conv_both_pairs_changed(tmp_path):
    """x -> conv1 -> Relu -> conv2 -> Relu -> conv3: conv2 is the second of one pair and the first of the next;
    undone, each weight is the file's own again (the earliest original), not a half-undone one."""
    from qdq.onnx_in.equalize import _restore, equalize
    from qdq.onnx_in.prepared import PreparedModel
    from qdq.targets import resolve_target

    rng = np.random.default_rng(3)
    spread = (2.0 ** np.arange(8)).astype(np.float32)
    weights = {"w1": rng.normal(size=(8, 3, 3, 3)) * spread[:, None, None, None] / 16,
               "w2": rng.normal(size=(8, 8, 1, 1)) / spread[None, :, None, None] * spread[:, None, None, None],
               "w3": rng.normal(size=(4, 8, 1, 1)) / spread[None, :, None, None]}  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h1"], ["a1"], name="relu1"),
             helper.make_node("Conv", ["a1", "w2"], ["h2"], name="conv2"),
             helper.make_node("Relu", ["h2"], ["a2"], name="relu2"),
             helper.make_node("Conv", ["a2", "w3"], ["y"], name="conv3")]  # fmt: skip
    inits = [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()]
    ends = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", c, 8, 8]) for n, c in (("x", 3), ("y", 4))]
    graph = helper.make_graph(nodes, "chain", ends[:1], ends[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "chain.onnx"))
    placement = PreparedModel.load(tmp_path / "chain.onnx").place(resolve_target("onnxruntime"))
    scalings = equalize(placement.model, placement.view, _data(2, seed=1), progress=False)
    assert [s.second for s in scalings] == ["conv2", "conv3"]
    _restore(placement.model, scalings)
    restored = {t.name: numpy_helper.to_array(t) for t in placement.model.graph.initializer}
    for name, weight in weights.items():
        np.testing.assert_array_equal(restored[name], weight.astype(np.float32))

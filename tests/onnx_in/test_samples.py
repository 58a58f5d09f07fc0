"""Where an ONNX model's batches hold their samples (qdq.onnx_in.samples): declared axes, cuts, halves, and what auto
gets from them on a recurrent model fed its state."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq.onnx_in.samples import SampleAxes, one_sample, split


def _io(*dims, outputs=()):
    inputs = [helper.make_tensor_value_info(f"i{n}", TensorProto.FLOAT, d) for n, d in enumerate(dims)]
    outs = [helper.make_tensor_value_info(f"o{n}", TensorProto.FLOAT, d) for n, d in enumerate(outputs)]
    return helper.make_model(helper.make_graph([], "g", inputs, outs))


def test_one_sample_is_cut_only_where_the_inputs_say_which_axis_holds_them():
    feed = {"i0": np.zeros((4, 3)), "i1": np.zeros((4, 5))}
    cut = one_sample(_io(["n", 3], [None, 5]), feed)
    assert {k: v.shape for k, v in cut.items()} == {"i0": (1, 3), "i1": (1, 5)}  # dynamic batch: one sample
    assert one_sample(_io([1, 3]), {"i0": np.zeros((1, 3))})["i0"].shape == (1, 3)  # the graph fixes one
    # a recurrent state naming the batch on axis 1 and a scalar (silero-vad's): cut where the batch is named
    state = {"i0": np.arange(12.0).reshape(4, 3), "i1": np.arange(40.0).reshape(2, 4, 5), "i2": np.array(7.0)}
    cut = one_sample(_io(["n", 3], [2, "n", 5], []), state)
    assert {k: v.shape for k, v in cut.items()} == {"i0": (1, 3), "i1": (2, 1, 5), "i2": ()}
    np.testing.assert_array_equal(cut["i1"], state["i1"][:, :1])
    assert float(cut["i2"]) == 7.0
    # which axis is unknown: the batch unnamed, or an input that does not name it (silero's If file: no names)
    assert one_sample(_io([None, 3], [2, None, 5]), {"i0": np.zeros((4, 3)), "i1": np.zeros((2, 4, 5))}) is None
    assert one_sample(_io(["n", 3], [2, "m", 5]), {"i0": np.zeros((4, 3)), "i1": np.zeros((2, 4, 5))}) is None
    assert one_sample(_io(["n", 3], [2, "n", "n"]), {"i0": np.zeros((4, 3)), "i1": np.zeros((2, 4, 4))}) is None


def test_a_named_batch_axis_cuts_feeds_and_outputs_along_it_and_feeds_a_scalar_whole():
    axes = SampleAxes.of(_io(["n", 3], [2, "n", 5], [], outputs=[["n", 1], ["d0", "n", "d2"]]))
    assert axes == SampleAxes({"i0": 0, "i1": 1, "i2": None}, (0, 1))
    feed = {"i0": np.arange(18.0).reshape(6, 3), "i1": np.arange(60.0).reshape(2, 6, 5), "i2": np.array(16000.0)}
    assert axes.samples(feed) == 6
    kept, held = split(axes, feed, 2)
    np.testing.assert_array_equal(kept["i1"], feed["i1"][:, :4])
    np.testing.assert_array_equal(held["i1"], feed["i1"][:, 4:])
    np.testing.assert_array_equal(held["i0"], feed["i0"][4:])
    assert float(held["i2"]) == 16000.0 and float(kept["i2"]) == 16000.0
    outputs = [np.arange(6.0).reshape(6, 1), np.arange(60.0).reshape(2, 6, 5)]
    first, last = axes.halves((feed, outputs))
    np.testing.assert_array_equal(first[1][1], outputs[1][:, :3])
    np.testing.assert_array_equal(last[1][0], outputs[0][3:])
    np.testing.assert_array_equal(last[0]["i1"], feed["i1"][:, 3:])
    # outputs that do not name the batch: the feed can still be cut, a held-out pair cannot be halved
    unnamed = SampleAxes.of(_io(["n", 3], [2, "n", 5], outputs=[[None, 1]]))
    assert unnamed.outputs is None and unnamed.halves((feed, outputs[:1])) is None
    assert split(unnamed, {"i0": feed["i0"], "i1": feed["i1"]}, 2)[1]["i0"].shape == (2, 3)
    # dimension 0 dynamic in every input: the outputs are read along dimension 0 too
    assert SampleAxes.of(_io([None, 3], ["b", 5], outputs=[[None]])) == SampleAxes({"i0": 0, "i1": 0}, (0,))
    assert split(None, feed, 2) == (None, feed)  # nowhere to cut: the whole batch held out
    # dimension 0 dynamic everywhere but named differently: not one axis ([batch, sequence] and [sequence])
    assert SampleAxes.of(_io(["batch", "sequence"], ["sequence"])) is None


def _recurrent(named: bool) -> onnx.ModelProto:
    """Three linear layers on ``x [n, 16]``, a state ``[2, n, 8]`` carried (halved, plus the last layer's output) and
    a scalar gain ``sr``: silero-vad's inputs in miniature. ``named``: the batch axis is named ``n``; else unnamed."""
    rng = np.random.default_rng(0)
    n = "n" if named else None
    weights = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), f"w{k}")
               for k, shape in enumerate([(16, 32), (32, 32), (32, 8)])]  # fmt: skip
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    axis = numpy_helper.from_array(np.array([0], np.int64), "axis")
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"]), helper.make_node("Relu", ["m0"], ["r0"]),
        helper.make_node("MatMul", ["r0", "w1"], ["m1"]), helper.make_node("Relu", ["m1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"]), helper.make_node("Mul", ["m2", "sr"], ["y"]),
        helper.make_node("Unsqueeze", ["m2", "axis"], ["u"]), helper.make_node("Mul", ["state", "half"], ["s"]),
        helper.make_node("Add", ["s", "u"], ["stateN"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "recurrent",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 16]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, n, 8]),
         helper.make_tensor_value_info("sr", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, 8]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, n, 8])],
        [*weights, half, axis],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("named", [True, False])
def test_auto_holds_out_samples_of_every_batch_where_a_recurrent_model_names_its_batch_axis(tmp_path, named):
    import qdq

    rng = np.random.default_rng(1)
    data = [{"x": rng.normal(size=(16, 16)).astype(np.float32),
             "state": rng.normal(size=(2, 16, 8)).astype(np.float32), "sr": np.array(2.0, np.float32)}
            for _ in range(4)]  # fmt: skip
    result = qdq.quantize_onnx(_recurrent(named), data, tmp_path / "q.onnx", target="onnxruntime", progress=False)
    stem = result.auto.stem
    if named:  # the last quarter of each of the 4 batches held out: two halves to check a gain on
        assert stem.skipped == "" and stem.tried >= 1
    else:  # the 4th batch held out whole: one batch, no halves
        assert stem.skipped.startswith("fewer than two held-out batches") and stem.tried == 0


def test_an_input_whose_shape_the_graph_fixes_is_fed_whole_to_every_part():
    # a sequence model's initial state fixed at one stream (silero-vad's sequence file: input [sequence_length, 576],
    # h and c [1, 1, 128]): the sequence is cut, the state goes whole to both parts
    model = _io(["sequence_length", 6], [1, 1, 4], [1, 1, 4], outputs=[["sequence_length"], [1, "m", 4]])
    axes = SampleAxes.of(model)
    assert axes.inputs == {"i0": 0, "i1": None, "i2": None} and axes.outputs is None
    feed = {"i0": np.arange(48.0).reshape(8, 6), "i1": np.ones((1, 1, 4)), "i2": np.zeros((1, 1, 4))}
    kept, held = split(axes, feed, 2)
    assert kept["i0"].shape == (6, 6) and held["i0"].shape == (2, 6) and held["i1"].shape == (1, 1, 4)
    # one step of the sequence is no sample of its own: not timed on one
    assert one_sample(model, feed) is None
    # an input with a dynamic axis that is not the named one still cannot be cut
    assert SampleAxes.of(_io(["n", 6], [1, None, 4])) is None

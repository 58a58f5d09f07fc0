"""qdq.onnx_in.data: the calibration batches ``qdq quantize --model x.onnx --data ...`` reads from disk."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_models import constant_weight_conv
from qdq.cli import main
from qdq.errors import QdqConfigError
from qdq.onnx_in.data import calibration_batches


@pytest.fixture
def model(tmp_path):
    return constant_weight_conv(tmp_path / "net.onnx")  # one input "x": [batch, 3, height, width]


def test_an_npz_is_cut_into_batches_along_axis_0(tmp_path, model):
    x = np.random.default_rng(0).random((10, 3, 4, 4), np.float32)
    np.savez(tmp_path / "cal.npz", x=x, unused=np.zeros(3))
    batches = calibration_batches(str(tmp_path / "cal.npz"), model, batch_size=4)
    assert [b["x"].shape[0] for b in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)


def test_a_folder_of_arrays_is_one_batch_per_file_in_name_order(tmp_path, model):
    folder = tmp_path / "cal"
    folder.mkdir()
    for i in (2, 0, 1):
        np.save(folder / f"b{i}.npy", np.full((2, 3, 4, 4), i, np.float32))
    batches = calibration_batches(str(folder), model)
    assert [float(b["x"][0, 0, 0, 0]) for b in batches] == [0.0, 1.0, 2.0]


def test_an_image_folder_is_read_as_rgb_in_0_1_then_normalized(tmp_path, model):
    Image = pytest.importorskip("PIL.Image", reason="reading images needs Pillow (pip install pillow)")
    folder = tmp_path / "images" / "class_a"
    folder.mkdir(parents=True)
    pixel = (255, 0, 51)
    Image.new("RGB", (6, 6), pixel).save(folder / "a.png")
    Image.new("RGB", (6, 6), pixel).save(folder / "b.jpg", quality=100)
    with pytest.raises(QdqConfigError, match="no fixed height and width"):
        calibration_batches(f"imagefolder:{tmp_path / 'images'}", model)
    mean, std = [0.5, 0.5, 0.5], [0.25, 0.5, 1.0]
    (batch,) = calibration_batches(f"imagefolder:{tmp_path / 'images'}", model, image_size=4, mean=mean, std=std)
    assert batch["x"].shape == (2, 3, 4, 4) and batch["x"].dtype == np.float32
    expected = (np.array(pixel) / 255.0 - 0.5) / np.array(std)  # [2.0, -1.0, -0.3]
    np.testing.assert_allclose(batch["x"][0, :, 1, 1], expected, atol=1e-6)


def test_arrays_that_do_not_match_the_graph_inputs_are_refused(tmp_path, model):
    np.savez(tmp_path / "wrong.npz", images=np.zeros((2, 3, 4, 4), np.float32))
    with pytest.raises(QdqConfigError, match=r"no array for the graph input\(s\) \['x'\]"):
        calibration_batches(str(tmp_path / "wrong.npz"), model)
    with pytest.raises(QdqConfigError, match=r"give a \.npz"):
        calibration_batches(str(tmp_path / "nothing.txt"), model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(QdqConfigError, match=r"holds no \.npz or \.npy"):
        calibration_batches(str(tmp_path / "empty"), model)


def test_the_cli_quantizes_an_onnx_file_and_prints_its_report(tmp_path, model, capsys):
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).random((8, 3, 8, 8), np.float32))
    out = tmp_path / "out" / "int8.onnx"
    code = main(["quantize", "--model", str(model), "--data", str(tmp_path / "cal.npy"), "--out", str(out),
                 "--target", "onnxruntime", "--calib", "percentile", "--keep-float", "op:Relu"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and out.is_file()
    assert "Conv" in printed and f"wrote {out}" in printed
    assert main(["quantize", "--model", str(model), "--out", str(out)]) != 0
    assert "needs --data" in capsys.readouterr().err


def _fixed_batch(model, tmp_path, rows: int):
    """``model`` with its input's batch dimension fixed at ``rows`` (as u2netp fixes it at 1)."""
    import onnx

    proto = onnx.load(str(model))
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = rows
    path = tmp_path / f"fixed{rows}.onnx"
    onnx.save(proto, str(path))
    return path


def test_a_graph_that_fixes_its_batch_size_gets_batches_of_that_size(tmp_path, model):
    fixed = _fixed_batch(model, tmp_path, 3)
    x = np.random.default_rng(0).random((10, 3, 4, 4), np.float32)
    np.savez(tmp_path / "cal.npz", x=x)
    batches = calibration_batches(str(tmp_path / "cal.npz"), fixed, batch_size=4)
    assert [b["x"].shape[0] for b in batches] == [3, 3, 3]  # the 10th sample makes no whole batch
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x[:9])


def test_a_batch_the_graph_cannot_take_is_one_clear_error_before_any_run(tmp_path, model):
    import qdq

    fixed = _fixed_batch(model, tmp_path, 1)
    rng = np.random.default_rng(0)
    with pytest.raises(QdqConfigError, match=r"takes batches of exactly 1 sample\(s\). Give batches of 1"):
        qdq.quantize_onnx(fixed, [{"x": rng.random((8, 3, 4, 4), np.float32)}], tmp_path / "q.onnx",
                          target="onnxruntime", progress=False)  # fmt: skip
    with pytest.raises(QdqConfigError, match=r"dimension 1 is fixed at 3"):
        qdq.quantize_onnx(model, [{"x": rng.random((2, 4, 4, 4), np.float32)}], tmp_path / "q.onnx",
                          target="onnxruntime", progress=False)  # fmt: skip
    with pytest.raises(QdqConfigError, match=r"4 dimensions"):
        qdq.quantize_onnx(model, [{"x": rng.random((3, 4, 4), np.float32)}], tmp_path / "q.onnx",
                          target="onnxruntime", progress=False)  # fmt: skip


def test_a_negative_dimension_is_dynamic_as_onnx_runtime_reads_it(tmp_path, model):
    # Paddle's exporter writes -1 for a dynamic axis (PP-OCR's direction classifier: [-1, 3, ?, ?])
    import qdq
    from qdq.graphs.onnx_types import value_dims
    from qdq.onnx_in.samples import SampleAxes

    proto = onnx.load(str(model))
    for dim in proto.graph.input[0].type.tensor_type.shape.dim[::2]:  # the batch axis and the height
        dim.Clear()
        dim.dim_value = -1
    path = tmp_path / "paddle.onnx"
    onnx.save(proto, str(path))
    assert value_dims(proto.graph.input[0]) == [None, 3, None, None]
    assert SampleAxes.of(proto).inputs == {"x": 0}  # samples along dimension 0: a held-out batch can be split
    rng = np.random.default_rng(0)
    data = [{"x": rng.random((8, 3, 4, 4), np.float32)} for _ in range(4)]
    result = qdq.quantize_onnx(path, data, tmp_path / "q.onnx", target="onnxruntime", progress=False)
    assert result.int8_ops.get("Conv") == 1
    assert [b["x"].shape[0] for b in calibration_batches(str(_npz(tmp_path)), path, batch_size=4)] == [4, 4, 2]


def _npz(tmp_path):
    np.savez(tmp_path / "ten.npz", x=np.random.default_rng(1).random((10, 3, 4, 4), np.float32))
    return tmp_path / "ten.npz"


def test_an_npz_for_a_model_fed_its_state_is_cut_along_each_inputs_batch_axis(tmp_path):
    # silero-vad's inputs: audio [batch, 576], a state [2, batch, 128] and the rate, a scalar
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6]),
              helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "n", 4]),
              helper.make_tensor_value_info("sr", TensorProto.INT64, [])]  # fmt: skip
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])])  # fmt: skip
    path = tmp_path / "stateful.onnx"
    onnx.save(helper.make_model(graph), str(path))
    x, state = np.arange(60.0).reshape(10, 6), np.arange(80.0).reshape(2, 10, 4)
    np.savez(tmp_path / "d.npz", x=x, state=state, sr=np.array(16000))
    batches = calibration_batches(str(tmp_path / "d.npz"), path, batch_size=4)
    assert [b["x"].shape[0] for b in batches] == [4, 4, 2]
    assert [b["state"].shape for b in batches] == [(2, 4, 4), (2, 4, 4), (2, 2, 4)]
    np.testing.assert_array_equal(batches[2]["state"], state[:, 8:])
    assert all(int(b["sr"]) == 16000 for b in batches)
    np.savez(tmp_path / "bad.npz", x=x, state=state[:, :9], sr=np.array(16000))  # 10 samples against 9
    with pytest.raises(QdqConfigError, match="one number of samples along their batch axes"):
        calibration_batches(str(tmp_path / "bad.npz"), path, batch_size=4)
    # a graph that names no batch axis (silero's If file): cut along axis 0, and the advice for the rest
    for value in graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.Clear()
    onnx.save(helper.make_model(graph), str(tmp_path / "unnamed.onnx"))
    with pytest.raises(QdqConfigError, match=r"names no batch axis.*a folder of \.npz files, one batch each"):
        calibration_batches(str(tmp_path / "d.npz"), tmp_path / "unnamed.onnx", batch_size=4)

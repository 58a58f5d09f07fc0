"""The Keras door's stem (``auto``, :mod:`qdq.workflow.stem`): the layers nearest the inputs stay float where int8
cannot hold what they read, as in the PyTorch and ONNX doors (tests/workflow/test_stem.py, the same model)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import keras
import qdq.keras as qk

LOUD = 100.0
BODY = 12  # layers after the stem: each quantized one carries a small share of the output's error


def quiet_input(quiet: float) -> keras.Model:
    """tests/workflow/test_stem.py's ``_QuietInput`` channels-last, with 1x1 convolutions as Dense layers: the stem
    scales two input channels of sizes ``LOUD`` and ``quiet`` to one size; a quiet channel of 0.01 next to a loud one
    of 100 is below one int8 step of the input, so only a float stem keeps it."""
    rng = np.random.default_rng(0)
    inputs = keras.Input((32, 2))
    stem = keras.layers.Dense(2, use_bias=False, name="stem")
    x = keras.layers.ReLU()(stem(inputs))
    body = []
    for i in range(BODY):
        body.append(keras.layers.Dense(2, name=f"body{i}"))
        x = keras.layers.ReLU()(body[-1](x))
    model = keras.Model(inputs, x)
    stem.set_weights([np.diag([1 / LOUD, 1 / quiet]).astype(np.float32)])
    for layer in body:  # near the identity: both channels reach the output
        layer.set_weights([(np.eye(2) + 0.1 * rng.random((2, 2))).astype(np.float32), np.zeros(2, np.float32)])
    return model


def signals(quiet: float, count: int = 8, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = np.array([LOUD, quiet], np.float32)
    return [(rng.uniform(-1, 1, size=(16, 32, 2)) * scale).astype(np.float32) for _ in range(count)]


def _sqnr(reference: np.ndarray, output: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / np.sum((output - reference) ** 2)))


@pytest.mark.parametrize("quiet", [0.01, LOUD])
def test_auto_keeps_the_stem_float_only_where_int8_cannot_hold_its_input(tmp_path, quiet):
    model = quiet_input(quiet)
    qmodel = qk.quantize_model(model, target="onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qk.calibrate(qmodel, signals(quiet))
    result = qk.auto_result(qmodel)
    stem = qmodel.get_layer("quant_stem")
    unseen = signals(quiet, count=1, seed=1)[0]
    sqnr = _sqnr(model.predict_on_batch(unseen), qmodel.predict_on_batch(unseen))
    if quiet < 1:  # the PyTorch door's choice on the same model: the stem alone, tens of dB
        assert result.stem.ops == ["quant_stem"] and result.stem.gain_db > 10, result.stem.summary()
        assert stem.kept_float and sqnr > 30
        path = qk.export_onnx(qmodel, unseen[:1], tmp_path / "q.onnx", target="onnxruntime")
        graph = onnx.load(path).graph
        producers = {out: node.op_type for node in graph.node for out in node.output}
        first = next(node for node in graph.node if node.op_type in ("MatMul", "Gemm"))
        assert all(producers.get(name) != "DequantizeLinear" for name in first.input), "the stem exports float"
        qmodel.save(tmp_path / "q.keras")
        reloaded = keras.models.load_model(tmp_path / "q.keras")
        assert reloaded.get_layer("quant_stem").kept_float
        np.testing.assert_allclose(reloaded.predict_on_batch(unseen), qmodel.predict_on_batch(unseen), rtol=1e-6)
    else:  # both channels of one size: int8 holds the input, the stem's float layers would not pay
        assert result.stem.levels == 0 and not stem.kept_float, result.stem.summary()
    assert "stem" in result.summary()


@pytest.mark.parametrize("order", [("auto", "max"), ("max", "auto")])
def test_ptq_keeps_the_stem_auto_left_float_only_where_auto_wins(order):
    """The PyTorch door's rule (tests/workflow/test_stem.py): the stem auto leaves float stays float only where
    auto's row wins; the methods scored after it, and the model returned when another wins, quantize it."""
    qmodel = qk.quantize_model(quiet_input(0.01), target="onnxruntime")
    stem = qmodel.get_layer("quant_stem")
    seen: list[bool] = []

    def last_wins(model) -> float:  # each call scores higher: the grid's last method wins
        seen.append(stem.kept_float)
        return float(len(seen))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qk.ptq(qmodel, signals(0.01), last_wins, methods=list(order))
    assert result.best.method == order[-1]
    assert seen[1:] == [name == "auto" for name in order]  # auto scored with its stem float, max with it int8
    assert stem.kept_float == (order[-1] == "auto")


@pytest.mark.parametrize("quiet", [0.01, LOUD])
def test_the_keras_and_onnx_doors_choose_the_same_stem(tmp_path, quiet):
    """The same model through both doors (its float export quantized by ``quantize_onnx``, the same batches): the
    same number of levels left float, and in the ONNX file the stem's MatMul is the op left float."""
    import qdq

    model = quiet_input(quiet)
    qmodel = qk.quantize_model(model, target="onnxruntime")
    path = qk.export_float_onnx(model, tmp_path / "fp32.onnx", "onnxruntime")
    name = onnx.load(path).graph.input[0].name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qk.calibrate(qmodel, signals(quiet))
        result = qdq.quantize_onnx(path, [{name: x} for x in signals(quiet)], tmp_path / "q.onnx",
                                   target="onnxruntime", progress=False)  # fmt: skip
    keras_stem, onnx_stem = qk.auto_result(qmodel).stem, result.auto.stem
    assert keras_stem.levels == onnx_stem.levels == (1 if quiet < 1 else 0), (keras_stem.summary(), onnx_stem.summary())
    if quiet < 1:
        graph = onnx.load(path).graph
        first = next(node for node in graph.node if node.op_type in ("MatMul", "Gemm"))
        assert onnx_stem.ops == [first.name]

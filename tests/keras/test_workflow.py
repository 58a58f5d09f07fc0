"""Keras PTQ (one pass, every method) and QAT (the seed schedule), and sub-8-bit grids against numpy."""

import numpy as np
import onnx
import pytest
from keras_models import residual_cnn, trained
from onnx import numpy_helper

import keras
import qdq
import qdq.keras as qk
from qdq.calib import HistogramCalibrator
from qdq.errors import QdqConfigError
from qdq.keras.quantizer import fake_quant
from qdq.workflow.auto_calibration import candidates
from qdq.workflow.post_training import DEFAULT_PERCENTILES, PTQResult


def accuracy(model, x, y):
    return 100.0 * float((model.predict_on_batch(x).argmax(1) == y).mean())


@pytest.mark.slow
@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("num_bits", [2, 4, 7])
def test_sub_8_bit_grid_equals_the_numpy_oracle(num_bits, unsigned):
    rng = np.random.default_rng(num_bits)
    x = (rng.normal(size=4096) * 2).astype(np.float32)
    amax = np.float32(2.5)
    qmax = 2**num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    qmin = 0 if unsigned else -qmax - 1
    step = amax / np.float32(qmax)
    expected = np.clip(np.rint(x / step), qmin, qmax).astype(np.float32) * step
    got = fake_quant(x, amax, num_bits, unsigned=unsigned).numpy()
    # TensorFlow multiplies by 1/step where numpy divides: a value a float32 rounding from a half step may go
    # to the neighbouring level
    off = np.abs(got - expected) / step
    assert off.max() <= 1.0 + 1e-5 and (off > 1e-3).mean() < 1e-3
    assert np.unique(np.rint(got / step)).size <= qmax - qmin + 1


def test_per_channel_4_bit_weights_keep_each_channel_grid():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 3, 4, 5)).astype(np.float32)
    amax = np.abs(w).max(axis=(0, 1, 2))
    got = fake_quant(w, amax, 4, axis=3).numpy()
    step = (amax / np.float32(7)).astype(np.float32)
    levels = got / step
    assert np.allclose(levels, np.rint(levels), atol=1e-4) and levels.min() >= -8 and levels.max() <= 7
    np.testing.assert_allclose(got, np.clip(np.rint(w / step), -8, 7) * step, atol=1e-6)


def test_more_than_8_bits_is_refused(cnn):
    with pytest.raises(QdqConfigError, match="at most 8 bits"):
        qk.quantize_model(cnn[0], num_bits=12)


def test_w4a4_export_clips_to_the_4_bit_levels_and_matches_keras(cnn, tmp_path):
    model, x, _ = cnn
    qmodel = qk.quantize_model(model, num_bits=4, target="tensorrt")
    ranges = qk.calibrate(qmodel, x, method="max")
    path = qk.export_onnx(qmodel, None, tmp_path / "w4a4.onnx")
    graph = onnx.load(path).graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    activation_q = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in constants]
    steps = {np.float32(a) / np.float32(7) for a in ranges.values()}
    for q in activation_q:  # Clip to [-8, 7] steps (a layout op may sit between), then the int8 Q of that step
        assert constants[q.input[1]][()] in steps, q.name
        source = producer[q.input[0]]
        while source.op_type in ("Transpose", "Reshape"):
            source = producer[source.input[0]]
        assert source.op_type in ("Clip", "Max", "Min"), q.name  # tf2onnx writes clip_by_value as Max(Min())
    result = qdq.verify(qk.fold_batchnorms(qmodel), path, [x[:32], x[32:]])
    assert result.top1_agreement == 100.0 and result.max_error_steps <= 1.0, str(result)


def test_ptq_tries_every_method_from_one_pass_and_keeps_the_best(cnn):
    model, x, y = cnn
    qmodel = qk.quantize_model(model, target="onnxruntime")
    calls = []

    def evaluate(m):
        calls.append(1)
        return accuracy(m, x, y)

    result = qk.ptq(qmodel, [x[:32], x[32:]], evaluate)
    assert isinstance(result, PTQResult)
    percentiles = [f"percentile {p}" for p in DEFAULT_PERCENTILES]
    assert [r.label for r in result.results] == ["max", "entropy", "mse", *percentiles]
    assert len(calls) == 1 + len(result.results)
    assert result.float_score == accuracy(model, x, y)  # the bypassed wrappers compute the float model
    assert result.best.score == max(r.score for r in result.results)
    assert accuracy(qmodel, x, y) == result.best.score  # the best ranges are the ones left loaded
    stats = qk.collect_stats(qmodel, [x[:32], x[32:]], "histogram")
    assert stats.ranges(result.best.method, **result.best.options) == result.best.amax
    with pytest.raises(QdqConfigError, match="'auto' chooses among the methods by running"):
        stats.ranges("auto")


def test_ptq_takes_auto_and_records_its_choice_when_it_is_the_best(cnn):
    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    batches = [x[:32], x[32:]]
    result = qk.ptq(qmodel, batches, lambda m: 1.0 if qk.auto_result(m) is not None else 0.0, ("max", "auto"))
    assert [r.label for r in result.results] == ["max", "auto"] and result.best.label == "auto"
    chosen = qk.auto_result(qmodel).chosen  # recorded again after the best ranges were set back
    assert set(result.best.quantizer_methods.values()) == {f"auto: {chosen}"}
    method, options = next((m, o) for m, o in candidates() if m.label(o) == chosen)
    # every sample's statistics, with the options the method was scored with (what was scored is what is set)
    assert qk.collect_stats(qmodel, batches).ranges(method.name, **options) == result.best.amax
    qk.ptq(qmodel, batches, lambda m: 0.0 if qk.auto_result(m) is not None else 1.0, ("auto", "max"))
    assert qk.auto_result(qmodel) is None  # max kept: auto's choice is not the model's ranges


def test_ptq_ranges_are_those_of_qdq_calib_on_the_same_values(cnn):
    # one implementation for both front ends: the Keras entropy range of an input equals qdq.calib's on it
    import torch

    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    stats = qk.collect_stats(qmodel, [x], "histogram")
    head = qmodel.get_layer("quant_head")
    with qk.bypassed(qmodel):  # the float model's values, as calibration sees them
        values = keras.Model(qmodel.inputs, head._inbound_nodes[0].input_tensors[0]).predict_on_batch(x)
    reference = HistogramCalibrator()
    reference.collect(torch.from_numpy(np.asarray(values, np.float32)))
    assert stats.ranges("entropy")["quant_head/input_0"] == float(reference.compute_amax("entropy"))


def test_a_second_pass_reuses_the_traced_probe_and_sees_the_same_float_values(cnn):
    import torch

    from qdq.keras.calibration import _PROBE_ATTRIBUTE

    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    first = qk.collect_stats(qmodel, [x[:32], x[32:]], "histogram").histograms()
    probe = getattr(qmodel, _PROBE_ATTRIBUTE)[1]
    traced = probe.traces()
    qk.calibrate(qmodel, [x[:32]], method="max")  # static ranges now: the probe must still see float values
    second = qk.collect_stats(qmodel, [x[:32], x[32:]], "histogram").histograms()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name].bin_counts, second[name].bin_counts), name
    assert getattr(qmodel, _PROBE_ATTRIBUTE)[1] is probe
    assert probe.traces() == traced  # nothing traced again


def test_the_probe_is_traced_once_for_every_batch_size(cnn):
    # auto holds the last quarter of each batch out and a last batch is often smaller: each size used to trace the
    # probe again (seconds on a large model); one trace with the batch axis left open serves them all
    from qdq.keras.calibration import _PROBE_ATTRIBUTE

    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    qk.calibrate(qmodel, [x[:16], x[16:32], x[32:48], x[48:53]])  # auto: 12 + 4 samples, then 4 + 1
    assert getattr(qmodel, _PROBE_ATTRIBUTE)[1].traces() == 2  # forward and forward_with_outputs, once each


def test_a_calibrator_error_inside_the_traced_pass_reaches_the_caller_as_itself(cnn, monkeypatch):
    # collection runs in a tf.py_function: TensorFlow would wrap the error in its own; the user gets qdq's
    from qdq.errors import QdqCalibrationError

    model, x, _ = cnn
    qmodel = qk.quantize_model(model)

    def refuse(self, x):
        raise QdqCalibrationError("refused on purpose")

    monkeypatch.setattr(HistogramCalibrator, "collect", refuse)
    with pytest.raises(QdqCalibrationError, match="refused on purpose"):
        qk.collect_stats(qmodel, [x], "histogram")
    assert not any(w.bypass for w in qk.wrappers_of(qmodel))  # the wrappers quantize again


def test_qat_follows_the_seed_schedule_and_records_each_epoch():
    keras.utils.set_random_seed(0)
    model, x, y = trained(residual_cnn(), epochs=3)
    qmodel = qk.quantize_model(model, target="onnxruntime")
    qk.calibrate(qmodel, x)
    result = qk.qat(qmodel, x, y, epochs=2, lr=0.1, eval_fn=lambda m: accuracy(m, x, y), batch_size=16)
    assert [e["epoch"] for e in result.epochs] == [1, 2]
    assert result.epochs[-1]["lr"] == pytest.approx(0.1 * 0.01 * 0.01, rel=1e-4)  # 1 % of lr, annealed to 1 %
    assert result.final_score == result.epochs[-1]["score"] == accuracy(qmodel, x, y)
    assert all(np.isfinite(e["loss"]) for e in result.epochs)


def test_qat_refuses_a_bad_schedule(cnn):
    model, x, y = cnn
    with pytest.raises(QdqConfigError, match="epochs >= 1"):
        qk.qat(qk.quantize_model(model), x, y, epochs=0, lr=0.1)

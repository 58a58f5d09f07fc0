"""Export: Q/DQ placement in the ONNX graph, BN folded, and ONNX Runtime against Keras in quantization steps."""

import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from keras_models import residual_cnn, trained
from onnx import numpy_helper

import keras
import qdq
import qdq.keras as qk
from qdq.errors import QdqExportError
from qdq.runtime.ort import fusion_report


def ops(path):
    return Counter(node.op_type for node in onnx.load(path).graph.node)


def run(path, x, extra_outputs=()):
    model = onnx.load(path)
    for name in extra_outputs:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


@pytest.fixture
def calibrated(cnn):
    model, x, y = cnn
    qmodel = qk.quantize_model(model, custom_qdq_cases=[qk.ResNetV1QDQCase()])
    qk.calibrate(qmodel, x, method="percentile", percentile=99.9)
    return qmodel, x, y


def test_tensorrt_graph_has_qdq_pairs_on_inputs_and_weights_and_no_batchnorm(calibrated, tmp_path):
    qmodel, _, _ = calibrated
    path = qk.export_onnx(qmodel, None, tmp_path / "trt.onnx", target="tensorrt")
    counts = ops(path)
    # inputs: stem, block_conv, block_add[1] (shares block_conv's tensor: one pair), dw, pool, gap, head;
    # weights: stem, block_conv, dw, head
    assert counts["QuantizeLinear"] == counts["DequantizeLinear"] == 10
    assert counts["Conv"] == 3 and counts["MatMul"] == 1
    assert not {"Mul", "BatchNormalization"} & set(counts)  # BN folded into the convs
    graph = onnx.load(path).graph
    producer = {out: n for n in graph.node for out in n.output}
    for node in graph.node:
        if node.op_type == "DequantizeLinear":  # Q directly followed by DQ, nothing in between
            assert producer[node.input[0]].op_type == "QuantizeLinear"
        if node.op_type == "Conv":  # weights: DQ of an int8 initializer feeds the Conv directly
            weight_dq = producer[node.input[1]]
            assert weight_dq.op_type == "DequantizeLinear"
    metadata = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert metadata["qdq.target"] == "tensorrt"


def test_onnxruntime_engine_matches_keras_within_one_output_step(calibrated, tmp_path):
    qmodel, x, y = calibrated
    qmodel.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qmodel.fit(x, y, epochs=1, batch_size=16, verbose=0)  # QAT moves weights; the export follows them
    for target in ("tensorrt", "onnxruntime"):
        path = qk.export_onnx(qmodel, None, tmp_path / f"{target}.onnx", target=target)
        result = qdq.verify(qk.fold_batchnorms(qmodel), path, [x[:32], x[32:]])
        assert result.top1_agreement == 100.0, (target, str(result))
        assert result.max_error_steps <= 1.0, (target, str(result))
        unfolded = qdq.verify(qmodel, path, [x])  # against the training-form model (BN separate)
        assert unfolded.top1_agreement == 100.0 and unfolded.max_error_steps <= 1.0, str(unfolded)


def test_quantize_linear_codes_equal_keras_levels_within_one(tmp_path):
    """The integers ORT computes at the input Q equal round(keras_fake_quant / step), off by one on ~1e-6."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32, 32, 4))
    model = keras.Model(inputs, keras.layers.Conv2D(8, 3, name="conv")(inputs))
    qmodel = qk.quantize_model(model)
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 32, 32, 4)) * 2).astype(np.float32)
    ranges = qk.calibrate(qmodel, x, method="mse")
    path = qk.export_onnx(qmodel, None, tmp_path / "one.onnx")
    graph = onnx.load(path).graph
    transpose = next(n for n in graph.node if n.op_type == "Transpose" and n.input[0] == "input")  # NHWC -> NCHW
    q_input = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == transpose.output[0])
    scale = numpy_helper.to_array(next(t for t in graph.initializer if t.name == q_input.input[1]))
    amax = np.float32(ranges["quant_conv/input_0"])
    assert scale == amax / np.float32(127)  # y_scale is the float32 step of the calibrated range
    codes = run(path, x, [q_input.output[0]])[1].astype(np.int32).transpose(0, 2, 3, 1)
    from qdq.keras.quantizer import fake_quant

    levels = np.rint(fake_quant(x, amax).numpy() / scale).astype(np.int32)
    off = np.abs(codes - levels)
    assert off.max() <= 1 and (off > 0).mean() < 1e-4


def test_export_needs_calibrated_ranges_and_opset_13(cnn, tmp_path):
    model, _, _ = cnn
    qmodel = qk.quantize_model(model)
    with pytest.raises(QdqExportError, match=r"no calibrated input range.*qdq.keras.calibrate"):
        qk.export_onnx(qmodel, None, tmp_path / "m.onnx")
    with pytest.raises(QdqExportError, match="opset >= 13"):
        qk.export_onnx(qmodel, None, tmp_path / "m.onnx", opset=11)
    assert not (tmp_path / "m.onnx").exists()


def test_bn_folding_keeps_the_keras_outputs(calibrated):
    qmodel, x, _ = calibrated
    folded = qk.fold_batchnorms(qmodel)
    assert not any(type(layer).__name__ == "BatchNormalization" for layer in folded.layers)
    a, b = qmodel.predict_on_batch(x), folded.predict_on_batch(x)
    assert np.abs(a - b).max() <= 0.02 * np.abs(a).max()  # float32 rounding of w * k, a level here and there
    assert (a.argmax(1) == b.argmax(1)).mean() == 1.0


def test_calibration_methods_order_ranges_as_expected(cnn):
    model, x, _ = cnn
    ranges = {}
    for method in ("max", "percentile", "entropy", "mse"):
        qmodel = qk.quantize_model(model)
        ranges[method] = qk.calibrate(qmodel, x, method=method)
    for key, value in ranges["max"].items():
        assert max(ranges[m][key] for m in ("percentile", "entropy", "mse")) <= value + 1e-6
    stem = ranges["max"]["quant_stem/input_0"]
    assert stem == pytest.approx(float(np.abs(x).max()))  # the model input: max calibration is max|x|


def test_calibrate_rejects_bad_input(cnn):
    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    with pytest.raises(qdq.QdqConfigError, match=r"unknown calibration method 'entropi'.*entropy"):
        qk.calibrate(qmodel, x, method="entropi")
    with pytest.raises(qdq.QdqConfigError, match="no data"):
        qk.calibrate(qmodel, [])
    with pytest.raises(qdq.QdqConfigError, match="no quantized inputs"):
        qk.calibrate(residual_cnn(), x)
    from qdq.calib import CalibrationMethod, register_method, unregister_method

    register_method(CalibrationMethod("torch_pass", "histogram", select=lambda model, data, **_: None))
    try:  # a model-level method other than auto runs on a PyTorch model: refused before any work
        with pytest.raises(qdq.QdqConfigError, match="'torch_pass' is not available for Keras models"):
            qk.calibrate(qmodel, x, method="torch_pass")
    finally:
        unregister_method("torch_pass")


def test_a_model_with_unfused_ops_still_matches(tmp_path):
    """Concatenate and MaxPool quantized through the spec; exported and run. The Concatenate's inputs share one
    range (calibrated on all of them: the range of its output), so TensorRT concatenates int8 data."""
    inputs = keras.Input((12, 12, 3))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="a")(inputs)
    b = keras.layers.Conv2D(4, 1, name="b")(inputs)
    c = keras.layers.Concatenate(name="cat")([a, b])
    c = keras.layers.MaxPooling2D(name="maxpool")(c)
    out = keras.layers.Dense(3, name="head")(keras.layers.Flatten()(c))
    model, x, _ = trained(keras.Model(inputs, out))
    spec = qk.QuantizationSpec()
    spec.add(["Concatenate", "MaxPooling2D"], is_keras_class=True)
    qmodel = qk.quantize_model(model, quantization_spec=spec)
    histogram = qk.calibrate(qmodel, x, method="percentile")  # both inputs: the histogram of the output
    assert histogram["quant_cat/input_0"] == histogram["quant_cat/input_1"] == histogram["quant_maxpool/input_0"]
    ranges = qk.calibrate(qmodel, x, method="max")
    assert ranges["quant_cat/input_0"] == ranges["quant_cat/input_1"] == ranges["quant_maxpool/input_0"]
    path = qk.export_onnx(qmodel, None, tmp_path / "cat.onnx")  # checked against TensorRT's rules (tests/conftest.py)
    result = qdq.verify(qmodel, path, [x])
    assert result.top1_agreement == 100.0 and result.max_error_steps <= 1.0, str(result)


def test_grouped_convolutions_export_as_one_conv_with_groups(tmp_path):
    """``Conv2D(groups=g)`` (ConvNeXt writes its depthwise convs so): Keras's TensorFlow backend compiles it with
    XLA, which tf2onnx cannot convert (a ``StatefulPartitionedCall``). Exported as one ``Conv`` with ``group``, equal
    to Keras in float and, quantized for ONNX Runtime, an int8 kernel within one output step of Keras."""
    inputs = keras.Input((10, 10, 8))
    x = keras.layers.Conv2D(8, 3, padding="same", groups=8, name="depthwise")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", groups=2, activation="relu", name="two_groups")(x)
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, out)
    x = np.random.default_rng(0).normal(size=(16, 10, 10, 8)).astype(np.float32)

    path = qk.export_float_onnx(model, tmp_path / "float.onnx", "onnxruntime")
    groups = sorted(a.i for n in onnx.load(path).graph.node if n.op_type == "Conv" for a in n.attribute
                    if a.name == "group")  # fmt: skip
    assert groups == [2, 8]
    np.testing.assert_allclose(run(path, x)[0], model(x).numpy(), rtol=1e-4, atol=1e-5)

    qmodel = qk.quantize_model(model, target="onnxruntime")
    qk.calibrate(qmodel, x, method="max")
    path = qk.export_onnx(qmodel, None, tmp_path / "int8.onnx", target="onnxruntime")
    assert fusion_report(path).int8_kernels.get("com.microsoft:QLinearConv") == 2
    result = qdq.verify(qk.fold_batchnorms(qmodel), path, [x])
    assert result.max_error_steps <= 1.0, str(result)


def test_exact_gelu_exports_through_erf(tmp_path):
    """Keras's exact GELU is ``0.5 * x * erfc(-x / sqrt(2))``; tf2onnx has no ``Erfc`` and left it in the graph,
    which ``onnx.checker`` refuses (ConvNeXt). It is ``1 - Erf``, equal to Keras on both sides of zero."""
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(6, activation="gelu")(inputs)  # exact: erfc
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    x = 3 * np.random.default_rng(0).normal(size=(8, 10)).astype(np.float32)
    path = qk.export_float_onnx(model, tmp_path / "gelu.onnx", "onnxruntime")
    assert ops(path)["Erf"] == 1 and "Erfc" not in ops(path)
    np.testing.assert_allclose(run(path, x)[0], model(x).numpy(), rtol=1e-5, atol=1e-5)


def convnext_block(channels=8, size=8):
    """ConvNeXt's block (keras.applications): a depthwise conv written ``Conv2D(groups=channels)``, LayerNorm,
    pointwise Dense layers on NHWC maps with an exact GELU between them, a residual add."""
    inputs = keras.Input((size, size, channels))
    x = keras.layers.Conv2D(channels, 7, padding="same", groups=channels)(inputs)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    x = keras.layers.Dense(4 * channels)(x)
    x = keras.layers.Activation("gelu")(x)  # exact: erfc
    x = keras.layers.Add()([inputs, keras.layers.Dense(channels)(x)])
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x)))


def test_convnext_block_for_tensorrt_reads_every_quantized_activation_through_its_dq(tmp_path):
    """tf2onnx's transpose optimizer pushes the NHWC Transpose before a pointwise Dense through the activation's Q
    but not its DQ (``Q -> Transpose -> DQ``: ``qdq check`` FAIL, qdq-pair); the export moves it before the Q, as
    it does for ``Q -> DQ -> Transpose``. The file passes TensorRT's rules (tests/conftest.py checks every export)
    and matches Keras within one output step."""
    model = convnext_block()
    x = np.random.default_rng(0).normal(size=(16, 8, 8, 8)).astype(np.float32)
    qmodel = qk.quantize_model(model, target="tensorrt")
    qk.calibrate(qmodel, x, method="max")
    path = qk.export_onnx(qmodel, None, tmp_path / "block.onnx", target="tensorrt")
    graph = onnx.load(path).graph
    producers = {out: node for node in graph.node for out in node.output}
    dq_sources = {producers[n.input[0]].op_type for n in graph.node if n.op_type == "DequantizeLinear"
                  if n.input[0] in producers}  # fmt: skip
    assert dq_sources == {"QuantizeLinear"}, dq_sources
    result = qdq.verify(qk.fold_batchnorms(qmodel), path, [x])
    assert result.max_error_steps <= 1.0, str(result)


class ScaledSum(keras.layers.Layer):
    """InceptionResNetV2's ``CustomScaleLayer`` (``x + branch * scale``, the scale 1 in its last block): a residual
    add inside a layer of the model's own class."""

    def call(self, inputs):
        return inputs[0] + inputs[1]


def _scaled_sum_model(branch_reads_trunk: bool) -> keras.Model:
    """A trunk conv and a branch conv summed inside :class:`ScaledSum`, quantized for TensorRT and calibrated; the
    branch reads the trunk (the skip tensor is then quantized for it) or the model's input."""
    inputs = keras.Input((8, 8, 4))
    trunk = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="trunk")(inputs)
    branch = keras.layers.Conv2D(4, 1, name="branch")(trunk if branch_reads_trunk else inputs)
    summed = ScaledSum(name="scaled_sum")([trunk, branch])
    model = keras.Model(inputs, keras.layers.Conv2D(2, 1, name="head")(summed))
    qmodel = qk.quantize_model(model, target="tensorrt")
    qk.calibrate(qmodel, np.random.default_rng(0).normal(size=(8, 8, 8, 4)).astype(np.float32), method="max")
    return qmodel


def test_a_residual_add_inside_a_layer_of_the_models_own_reads_the_skip_tensors_quantizer(tmp_path):
    """The Keras view sees a custom layer as one opaque op, so placement cannot quantize the skip input of the add
    inside it (InceptionResNetV2's last block). The skip tensor is quantized for the branch conv that reads it too,
    so the TensorRT export makes the add read that quantizer: no warning, ``qdq check`` PASS."""
    from qdq.targets.tensorrt.check import check_tensorrt

    path = tmp_path / "scaled_sum.onnx"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*breaks .* rules")
        qk.export_onnx(_scaled_sum_model(branch_reads_trunk=True), None, path, target="tensorrt")
    report = check_tensorrt(onnx.load(path))
    assert report.ok, str(report)


@pytest.mark.trt_rules_exempt("residual-add", reason="the skip tensor has no quantizer to read")
def test_a_tensorrt_file_that_breaks_a_rule_is_said_once_at_export(tmp_path):
    """A skip input with no quantizer anywhere (the trunk read by the custom layer alone) leaves TensorRT's residual
    rule broken, with no range to repair it from: the export says so, naming the rule and the node, where the file
    was written silently before (``qdq check`` FAIL)."""
    qmodel = _scaled_sum_model(branch_reads_trunk=False)
    with pytest.warns(UserWarning, match=r"breaks 1 of the rules .*residual-add at .*scaled_sum.*qdq check"):
        qk.export_onnx(qmodel, None, tmp_path / "scaled_sum.onnx", target="tensorrt")

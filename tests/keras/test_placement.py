"""Keras placement for the onnxruntime target: which inputs get Q/DQ, which are unsigned, and what ONNX
Runtime then runs in int8 (every Conv a QLinearConv, the Dense a QGemm), matching Keras."""

from collections import Counter

import numpy as np
import onnx
import pytest
from keras_models import set_batchnorm_statistics
from onnx import numpy_helper

import keras
import qdq
import qdq.keras as qk
from qdq.errors import QdqConfigError, QdqExportError
from qdq.runtime import load_runtime
from qdq.runtime.ort import fusion_report


def placement(qmodel):
    """``{layer: (quantized input positions, unsigned positions)}`` of every wrapper."""
    out = {}
    for wrapper in qk.wrappers_of(qmodel):
        n = len(wrapper._inbound_nodes[0].input_tensors)
        out[wrapper.layer.name] = (wrapper.quantized_positions(n), wrapper.unsigned_indices)
    return out


def test_residual_cnn_placement_for_onnxruntime(cnn):
    model, _, _ = cnn
    qmodel = qk.quantize_model(model, target="onnxruntime")
    # stem reads the image (signed); block_conv, dw, pool, gap and head read ReLU outputs or pools of them
    # (unsigned); block_add reads block_bn (a conv output: signed) and stem_relu (unsigned), both quantized
    assert placement(qmodel) == {
        "stem": ((0,), ()),
        "block_conv": ((0,), (0,)),
        "block_add": ((0, 1), (1,)),
        "dw": ((0,), (0,)),
        "pool": ((0,), (0,)),
        "gap": ((0,), (0,)),
        "head": ((0,), (0,)),
    }
    assert "block_add" not in placement(qk.quantize_model(model))  # the toolkit's (TensorRT) placement


def test_conv_output_read_by_an_unwrapped_layer_gets_a_plain_wrapper():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    x = keras.layers.ZeroPadding2D(1, name="pad")(x)  # no registered wrapper
    outputs = keras.layers.Conv2D(4, 3, name="conv2")(x)
    qmodel = qk.quantize_model(keras.Model(inputs, outputs), target="onnxruntime")
    assert placement(qmodel)["pad"] == ((0,), (0,))  # after the conv's own ReLU: unsigned
    assert type(qmodel.get_layer("quant_pad")) is qk.QuantizeWrapper
    assert placement(qmodel)["conv2"] == ((0,), (0,))  # a padding of a ReLU output is still >= 0


def test_unsigned_quantizer_is_the_uint8_grid():
    from qdq.keras.quantizer import fake_quant

    x = np.array([-1.0, 0.0, 0.3, 1.0, 2.55, 3.0], np.float32)
    got = fake_quant(x, 2.55, 8, unsigned=True).numpy()
    step = np.float32(2.55) / np.float32(255)  # 0.01
    expected = np.clip(np.rint(x / step), 0, 255).astype(np.float32) * step
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert got[0] == 0.0 and np.isclose(got[-1], 2.55)


@pytest.fixture
def ort_model(cnn, tmp_path):
    model, x, y = cnn
    qmodel = qk.quantize_model(model, target="onnxruntime")
    ranges = qk.calibrate(qmodel, x, method="max")
    return qmodel, x, y, ranges


def test_every_weighted_layer_runs_in_int8_and_matches_keras(ort_model, tmp_path):
    qmodel, x, y, _ = ort_model
    qmodel.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qmodel.fit(x, y, epochs=1, batch_size=16, verbose=0)  # QAT with unsigned quantizers
    path = qk.export_onnx(qmodel, None, tmp_path / "ort.onnx")  # the model's own target
    report = fusion_report(path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 3, "com.microsoft:QGemm": 1}
    assert report.float_kernels == {}
    result = qdq.verify(qk.fold_batchnorms(qmodel), path, [x[:32], x[32:]])
    assert result.top1_agreement == 100.0 and result.max_error_steps <= 1.0, str(result)


def test_unsigned_sites_export_as_uint8_with_zero_point_0(ort_model, tmp_path):
    qmodel, _, _, ranges = ort_model
    path = qk.export_onnx(qmodel, None, tmp_path / "ort.onnx", target_options={"weights": "int8"})
    model = onnx.load(path)
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    unsigned = {np.float32(ranges[f"quant_{name}/input_{i}"]) / np.float32(255)
                for name, (_, positions) in placement(qmodel).items() for i in positions}  # fmt: skip
    found = Counter()
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in constants:
            continue
        scale, zero = constants[node.input[1]], constants[node.input[2]]
        assert zero.dtype == np.uint8  # signed activations: uint8 with zero point 128, the same grid
        found["unsigned" if int(zero) == 0 else "signed"] += 1
        if int(zero) == 0:
            assert scale[()] in unsigned, node.name
    # unsigned: stem_relu (block_conv and block_add[1] share one pair), block_relu, dw_relu, pool, gap;
    # signed: the image, block_bn
    assert found == {"unsigned": 5, "signed": 2}


def test_the_target_is_remembered_and_enforced(ort_model, tmp_path):
    qmodel, x, _, _ = ort_model
    with pytest.raises(QdqExportError, match="placed for target 'onnxruntime'"):
        qk.export_onnx(qmodel, None, tmp_path / "trt.onnx", target="tensorrt")
    qmodel.save(tmp_path / "q.keras")
    loaded = keras.models.load_model(tmp_path / "q.keras")
    path = qk.export_onnx(loaded, None, tmp_path / "loaded.onnx")
    assert {p.key: p.value for p in onnx.load(path).metadata_props}["qdq.target"] == "onnxruntime"
    np.testing.assert_array_equal(loaded.predict_on_batch(x[:4]), qmodel.predict_on_batch(x[:4]))


def test_unknown_target_raises_listing_the_registered_ones(cnn):
    with pytest.raises(QdqConfigError, match="onnxruntime"):
        qk.quantize_model(cnn[0], target="onnxrt")


def test_swish_inside_a_conv_is_split_out_so_the_conv_fuses(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="swish", name="conv")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="sigmoid", name="gate")(x)
    outputs = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling2D(name="gap")(x))
    model = keras.Model(inputs, outputs)
    x_data = np.random.default_rng(0).normal(size=(8, 12, 12, 3)).astype(np.float32)
    split = qk.split_activations(model)
    assert [type(layer).__name__ for layer in split.layers].count("Activation") == 2
    np.testing.assert_allclose(split.predict_on_batch(x_data), model.predict_on_batch(x_data), rtol=1e-5, atol=1e-6)
    qmodel = qk.quantize_model(model, target="onnxruntime")
    # Q/DQ between the conv and its swish, written x * sigmoid(x) with the sigmoid quantized (unsigned), as the
    # PyTorch path writes nn.SiLU: QLinearSigmoid and QLinearMul
    assert placement(qmodel)["conv_activation_sigmoid"] == ((0,), ())
    assert placement(qmodel)["conv_activation_product"] == ((0, 1), (1,))
    qk.calibrate(qmodel, x_data)
    report = fusion_report(qk.export_onnx(qmodel, None, tmp_path / "swish.onnx"))
    assert report.int8_kernels.get("com.microsoft:QLinearConv") == 2 and not report.float_kernels


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV2", "EfficientNetB0"])
def test_applications_run_every_weighted_layer_in_int8(name, tmp_path):
    size = 32
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).uniform(-1, 1, size=(8, size, size, 3)).astype(np.float32)
    build = getattr(keras.applications, name)
    model = set_batchnorm_statistics(
        build(weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None), x
    )
    qmodel = qk.quantize_model(model, target="onnxruntime")
    qk.calibrate(qmodel, [x], method="max")
    path = qk.export_onnx(qmodel, None, tmp_path / f"{name}.onnx")
    convs = Counter(n.op_type for n in onnx.load(path).graph.node)["Conv"]
    report = fusion_report(path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": convs, "com.microsoft:QGemm": 1}
    assert report.float_kernels == {}
    # the int8 kernels compute the graph: against ONNX Runtime's reference kernels on the same file
    with load_runtime(path, "onnxruntime", optimization_level="disable") as runtime:
        reference = runtime.run(x)[0]
    with load_runtime(path, "onnxruntime") as runtime:
        engine = runtime.run(x)[0]
    assert (engine.argmax(1) == reference.argmax(1)).mean() >= 0.75


def test_a_pytorch_only_rule_on_every_target_leaves_keras_as_it_was(cnn):
    """register_placement_rule adds a PyTorch-only rule to every target; the Keras front end skips it."""
    from qdq.placement import register_placement_rule, unregister_placement_rule

    model = cnn[0]
    before = placement(qk.quantize_model(model, target="onnxruntime"))
    register_placement_rule("test_torch_only", lambda ctx: None)
    try:
        assert placement(qk.quantize_model(model, target="onnxruntime")) == before
    finally:
        unregister_placement_rule("test_torch_only")

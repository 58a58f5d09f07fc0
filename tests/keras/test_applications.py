"""keras.applications networks (random weights): the built-in cases place Q/DQ as TensorRT needs, and
each network quantizes, trains a step, exports and runs in ONNX Runtime matching Keras."""

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from keras_models import set_batchnorm_statistics
from onnx import numpy_helper

import keras
import qdq
import qdq.keras as qk
from qdq.keras.quantizer import fake_quant

SIZE = 32  # the smallest input these networks accept: the graph is the same as at 224


def network(name):
    keras.utils.set_random_seed(0)
    build = getattr(keras.applications, name)
    return build(weights=None, input_shape=(SIZE, SIZE, 3), classes=10, classifier_activation=None)


def placement(qmodel):
    out = {}
    for wrapper in qk.wrappers_of(qmodel):
        n = len(wrapper._inbound_nodes[0].input_tensors)
        out[wrapper.layer.name] = wrapper.quantized_positions(n)
    return out


def test_resnet50_v1_case_quantizes_only_the_shortcut_input_of_each_add():
    """keras.applications writes ``Add([shortcut, main])``. In the 4 projection blocks both inputs come from
    Conv-BN; the main branch (3 convs) is the one TensorRT fuses, so the shortcut (1 conv) is quantized, as in
    every identity block and as on torchvision's ResNet (tests/targets/test_residual.py)."""
    model = network("ResNet50")
    spec = qk.ResNetV1QDQCase().case(model, qk.QuantizationSpec())
    adds = {entry.name: entry.quantization_index for entry in spec}
    assert len(adds) == 16
    assert all(index == (0,) for index in adds.values()), adds


def test_resnet50_for_tensorrt_quantizes_the_shortcut_by_the_placement_rule_alone():
    """The tensorrt target's residual_add rule, without a case: the same 16 shortcut inputs as the case and as
    the PyTorch path on torchvision's ResNet-50 (tests/targets/test_residual.py)."""
    qmodel = qk.quantize_model(network("ResNet50"), target="tensorrt")
    adds = {name: positions for name, positions in placement(qmodel).items() if name.endswith("_add")}
    assert len(adds) == 16 and set(adds.values()) == {(0,)}, adds


def test_resnet50_v2_case_adds_preactivation_batchnorms_and_maxpools():
    model = network("ResNet50V2")
    spec = qk.ResNetV2QDQCase().case(model, qk.QuantizationSpec())
    by_class = {}
    for entry in spec:
        by_class.setdefault(type(model.get_layer(entry.name)).__name__, []).append(entry)
    assert len(by_class["Add"]) == 16
    assert len(by_class["BatchNormalization"]) == 17  # 16 pre-activation BNs + post_bn
    assert len(by_class["MaxPooling2D"]) == 4


def test_efficientnet_case_quantizes_both_inputs_of_squeeze_excitation_multiplies():
    model = network("EfficientNetB0")
    spec = qk.EfficientNetQDQCase().case(model, qk.QuantizationSpec())
    multiplies = [e for e in spec if type(model.get_layer(e.name)).__name__ == "Multiply"]
    assert len(multiplies) == 16 and all(e.quantization_index == (0, 1) for e in multiplies)


def activation_codes_agree(path, x, amaxes):
    """Every activation QuantizeLinear of the graph, teacher-forced: run ONNX Runtime once, take each Q's
    input and output, and compare its integers with the Keras op applied to that same input.

    Returns the number of activation quantizers checked. Asserts: each scale is ``amax / 127`` (float32)
    of a calibrated Keras range, and the integers agree, but for values on a rounding boundary (``x / step =
    k + 1/2`` to float32 precision), which may go one level apart (TensorFlow multiplies by ``127 / amax``
    where ONNX divides by the step). End-to-end outputs are not
    compared on these random networks: their quantization noise grows layer after layer (the quantized
    network is far from the float one too), so a single level that float summation order puts on the
    other side of a rounding boundary changes the logits - that is the network, not the engine.
    """
    model = onnx.load(path)
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    sites = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in constants]
    for node in sites:
        for name in (node.input[0], node.output[0]):
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input": x})))
    by_scale = {np.float32(a) / np.float32(127): np.float32(a) for a in amaxes}
    for node in sites:
        scale = constants[node.input[1]]
        assert scale.ndim == 0 and scale[()] in by_scale, (node.name, scale)
        zero = int(constants[node.input[2]]) if len(node.input) > 2 else 0
        codes = values[node.output[0]].astype(np.int32) - zero
        keras_levels = np.rint(fake_quant(values[node.input[0]], by_scale[scale[()]]).numpy() / scale).astype(np.int32)
        off = np.abs(codes - keras_levels)
        assert off.max() <= 1, node.name
        # each disagreement is a value on a rounding boundary (to float32 precision): x / step = k + 1/2
        ratio = values[node.input[0]][off > 0].astype(np.float64) / np.float64(scale[()])
        assert np.all(np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-5), node.name
    return len(sites)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "case"),
    [
        ("ResNet50", qk.ResNetV1QDQCase),
        ("MobileNetV2", qk.MobileNetQDQCase),
        ("EfficientNetB0", qk.EfficientNetQDQCase),
    ],
)
def test_network_quantizes_trains_exports_and_matches_onnxruntime(name, case, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(16, SIZE, SIZE, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=16)
    model = set_batchnorm_statistics(network(name), x)
    qmodel = qk.quantize_model(model, custom_qdq_cases=[case()])
    ranges = qk.calibrate(qmodel, [x[:8], x[8:]], method="max")
    qmodel.compile(keras.optimizers.SGD(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.numpy().copy() for w in qmodel.trainable_weights]
    history = qmodel.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    changed = [not np.array_equal(a, w.numpy()) for a, w in zip(before, qmodel.trainable_weights)]
    assert all(changed), "every trainable weight gets a straight-through gradient"
    path = qk.export_onnx(qmodel, None, tmp_path / f"{name}.onnx")
    graph = onnx.load(path).graph
    counts = Counter(n.op_type for n in graph.node)
    assert ("BatchNormalization" not in counts and "Mul" not in counts) or name == "EfficientNetB0"  # SE/swish Muls
    producer = {out: n for n in graph.node for out in n.output}
    for conv in (n for n in graph.node if n.op_type == "Conv"):
        assert producer[conv.input[1]].op_type == "DequantizeLinear", conv.name  # int8 weights, per channel
    checked = activation_codes_agree(path, x, set(ranges.values()))
    assert checked >= len({v for v in ranges.values()}) // 2
    result = qdq.verify(qmodel, path, [x])
    assert result.samples == 16 and np.isfinite(result.sqnr_db[0])


def test_mobilenet_v3_for_onnxruntime_calibrates_and_exports_with_its_convs_fused(tmp_path):
    """MobileNetV3's ``hard_sigmoid`` writes ``ReLU6(x + 3.0) * (1 / 6)``. Keras marks the product of a dense tensor
    and a Python float sparse when it infers shapes, and the squeeze-excite Multiply's quantizer failed on it
    (calibration crashed); tf2onnx's transpose optimizer failed on the 0-d constant of ``x + 3.0`` after a conv and
    left an NHWC Transpose between every conv and its quantizer (54 of 54 convs float). Now only the gate convs,
    whose output the ``+ 3.0`` reads (no rule quantizes it), stay float, said once with that reason."""
    from qdq.targets.onnxruntime.passes.float_convs import unfusable_convs

    x = np.random.default_rng(0).uniform(-1, 1, size=(8, SIZE, SIZE, 3)).astype(np.float32)
    model = set_batchnorm_statistics(network("MobileNetV3Small"), x)
    qmodel = qk.quantize_model(model, target="onnxruntime")
    qk.calibrate(qmodel, [x[:4], x[4:]])
    with pytest.warns(UserWarning, match=r"9 Conv\(s\) will run in float .* quantized for this target"):
        path = qk.export_onnx(qmodel, x[:1], tmp_path / "mobilenet_v3.onnx")
    proto = onnx.load(path)
    graph = proto.graph
    reader_of = {name: node.op_type for node in graph.node for name in node.input}
    convs = [n for n in graph.node if n.op_type == "Conv"]
    floats = set(unfusable_convs(proto))
    layers = model.layers  # the counts, from the Keras model: every conv, and one gate conv per squeeze-excite block
    assert len(convs) == sum(isinstance(layer, keras.layers.Conv2D | keras.layers.DepthwiseConv2D) for layer in layers)
    assert len(floats) == sum(layer.name.endswith("squeeze_excite_mul") for layer in layers) > 0
    assert {reader_of[c.output[0]] for c in convs if c.name in floats} == {"Add"}
    assert "Transpose" not in {reader_of[c.output[0]] for c in convs}
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {graph.input[0].name: x[:4]})
    assert np.isfinite(out[0]).all()

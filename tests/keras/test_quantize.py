"""quantize_model: which layers get Q/DQ, the original stays untouched, bad input gets one clear error."""

import numpy as np
import pytest
from keras_models import residual_cnn

import keras
import qdq.keras as qk
from qdq.errors import QdqConfigError, QdqTypeError


def placement(qmodel):
    """``{wrapped layer: (input positions, weight quantized)}``."""
    out = {}
    for wrapper in qk.wrappers_of(qmodel):
        n_inputs = len(wrapper._inbound_nodes[0].input_tensors)
        out[wrapper.layer.name] = (wrapper.quantized_positions(n_inputs), wrapper.quantize_weight)
    return out


def test_full_mode_wraps_convs_dense_and_average_pools_only():
    model = residual_cnn()
    assert placement(qk.quantize_model(model)) == {
        "stem": ((0,), True),
        "block_conv": ((0,), True),
        "dw": ((0,), True),
        "pool": ((0,), False),
        "gap": ((0,), False),
        "head": ((0,), True),
    }


def test_spec_and_cases_add_layers_and_name_entries_override():
    model = residual_cnn()
    spec = qk.QuantizationSpec()
    spec.add("stem", quantize_input=False)  # weight only
    spec.add("head", quantize_input=False, quantize_weight=False)  # kept float
    spec.add("BatchNormalization", is_keras_class=True)
    got = placement(qk.quantize_model(model, quantization_spec=spec, custom_qdq_cases=[qk.ResNetV1QDQCase()]))
    assert got["stem"] == ((), True)
    assert "head" not in got
    assert got["block_add"] == ((1,), False)  # the skip input; the Conv-BN branch fuses in TensorRT
    assert {"stem_bn", "block_bn", "dw_bn"} <= set(got)


def test_partial_mode_quantizes_only_what_the_spec_names():
    spec = qk.QuantizationSpec()
    spec.add(["block_conv", "block_add"], quantization_index=[None, [0, 1]])
    got = placement(qk.quantize_model(residual_cnn(), "partial", spec))
    assert got == {"block_conv": ((0,), True), "block_add": ((0, 1), False)}


def test_the_original_model_and_the_users_spec_are_untouched(cnn):
    model, x, _ = cnn
    before = [w.copy() for w in model.get_weights()]
    spec = qk.QuantizationSpec()
    spec.add("block_conv")
    qmodel = qk.quantize_model(model, quantization_spec=spec, custom_qdq_cases=[qk.ResNetV1QDQCase()])
    assert len(spec) == 1  # the case's entries were not appended to the user's object
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not any(isinstance(layer, qk.QuantizeWrapper) for layer in model.layers)
    for wrapper in qk.wrappers_of(qmodel):  # weights copied bit for bit
        source = model.get_layer(wrapper.layer.name)
        assert all(np.array_equal(a, b) for a, b in zip(source.get_weights(), wrapper.layer.get_weights()))
    # uncalibrated: dynamic ranges; 8-bit output close to the float model
    float_out, quant_out = model.predict_on_batch(x), qmodel.predict_on_batch(x)
    assert np.abs(float_out - quant_out).max() < 0.05 * np.abs(float_out).max()


def test_sequential_models_are_supported():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(2, name="d2")])
    assert set(placement(qk.quantize_model(model))) == {"d1", "d2"}


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_raises_naming_its_class():
    model = Subclassed()
    model(np.zeros((1, 4), np.float32))
    with pytest.raises(QdqConfigError, match=r"'Subclassed' is a subclassed model.*Functional API"):
        qk.quantize_model(model)


def _spec(*entries):
    spec = qk.QuantizationSpec()
    for args, kwargs in entries:
        spec.add(*args, **kwargs)
    return spec


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            _spec(
                (("block_cnv",), {}),
            ),
            "no layer of that name.*block_conv",
        ),
        (
            _spec(
                (("stem_relu",), {}),
            ),
            "layer 'stem_relu' of class ReLU, which qdq has no quantized wrapper",
        ),
        (
            _spec(
                (("LSTM",), {"is_keras_class": True}),
            ),
            "Keras class 'LSTM', which qdq has no quantized wrapper",
        ),
        (
            _spec(
                (("block_add",), {"quantization_index": [2]}),
            ),
            "'block_add' has 2 input.*\\[2\\] is out of range",
        ),
    ],
)
def test_bad_specs_raise_one_clear_error_naming_the_layer(spec, match):
    with pytest.raises(QdqConfigError, match=match):
        qk.quantize_model(residual_cnn(), quantization_spec=spec)


def test_bad_arguments_raise_early():
    with pytest.raises(QdqConfigError, match="quantization_mode must be one of"):
        qk.quantize_model(residual_cnn(), "ful")
    with pytest.raises(QdqConfigError, match="partial"):
        qk.quantize_model(residual_cnn(), "partial")
    with pytest.raises(QdqTypeError, match="Keras 3 model"):
        qk.quantize_model("model.keras")
    with pytest.raises(QdqTypeError, match="CustomQDQInsertionCase"):
        qk.quantize_model(residual_cnn(), custom_qdq_cases=[qk.ResNetV1QDQCase])


def test_saved_and_reloaded_model_computes_the_same(cnn, tmp_path):
    model, x, _ = cnn
    qmodel = qk.quantize_model(model)
    qk.calibrate(qmodel, x)
    path = tmp_path / "q.keras"
    qmodel.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(reloaded.predict_on_batch(x), qmodel.predict_on_batch(x))

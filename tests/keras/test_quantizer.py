"""The Keras fake-quant op against numpy oracles: TensorFlow's arithmetic exactly, ONNX's within one step."""

import numpy as np
import pytest
import tensorflow as tf

from qdq.keras.quantizer import dynamic_amax, fake_quant, weight_amax
from reference import quant_np


def tf_oracle(x, amax, num_bits=8):
    """TensorFlow's QuantizeAndDequantize for a symmetric full range, in float32 numpy: clamp to
    ``[-2**(b-1), 2**(b-1)-1] * amax / qmax``, multiply by ``qmax / amax``, round half to even, times the step."""
    x, amax = np.float32(x), np.float32(amax)
    qmax = np.float32(2 ** (num_bits - 1) - 1)
    step = amax / qmax
    scale = qmax / amax
    lo = np.float32(-(qmax + 1)) * step
    return (np.rint(np.clip(x, lo, amax) * scale) * step).astype(np.float32)


@pytest.mark.parametrize("num_bits", [8, 4])
def test_per_tensor_equals_tensorflow_oracle_and_onnx_within_one_step(num_bits):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=200_000) * 3).astype(np.float32)
    amax = np.float32(4.7)
    got = fake_quant(tf.constant(x), amax, num_bits).numpy()
    np.testing.assert_array_equal(got, tf_oracle(x, amax, num_bits))
    q_onnx, step = quant_np(x, amax, num_bits)
    levels_off = np.abs(np.rint(got / step) - q_onnx)
    assert levels_off.max() <= 1
    assert (levels_off > 0).mean() < 1e-4  # multiply-by-reciprocal vs division: rare boundary cases only


def test_per_channel_weights_use_each_channels_range():
    rng = np.random.default_rng(2)
    kernel = (rng.normal(size=(3, 3, 4, 6)) * np.array([0.1, 1, 5, 0.01, 2, 3])).astype(np.float32)
    amax = weight_amax(tf.constant(kernel), axis=3).numpy()
    np.testing.assert_array_equal(amax, np.abs(kernel).max(axis=(0, 1, 2)))
    got = fake_quant(tf.constant(kernel), amax, 8, axis=3).numpy()
    for c in range(6):
        np.testing.assert_array_equal(got[..., c], tf_oracle(kernel[..., c], amax[c]))


def test_straight_through_gradient_is_zero_outside_the_range():
    x = tf.constant(np.linspace(-3, 3, 601, dtype=np.float32))
    amax = np.float32(2.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fake_quant(x, amax)
    grad = tape.gradient(y, x).numpy()
    inside = np.abs(x.numpy()) <= amax  # the range as given, as in qdq's PyTorch quantizer
    np.testing.assert_array_equal(grad, inside.astype(np.float32))


def test_dynamic_range_is_the_batch_max_and_half_inputs_keep_their_dtype():
    x = tf.constant([[-3.5, 1.0], [2.0, 0.25]], dtype=tf.float16)
    assert float(dynamic_amax(x)) == 3.5
    y = fake_quant(x, dynamic_amax(x))
    assert y.dtype == tf.float16
    np.testing.assert_array_equal(y.numpy(), tf_oracle(x.numpy().astype(np.float32), 3.5).astype(np.float16))


def test_zero_range_gives_zeros_not_nan():
    y = fake_quant(tf.zeros((4,)), 0.0).numpy()
    np.testing.assert_array_equal(y, np.zeros(4, np.float32))

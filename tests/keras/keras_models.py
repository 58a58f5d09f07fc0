"""Small Keras models and data for the Keras tests."""

import numpy as np

import keras


def residual_cnn(size: int = 16, classes: int = 10) -> keras.Model:
    """Conv-BN-ReLU, a residual block (Conv-BN + skip), depthwise conv, average pooling, dense."""
    inputs = keras.Input((size, size, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    y = keras.layers.Conv2D(8, 3, padding="same", name="block_conv")(x)
    y = keras.layers.BatchNormalization(name="block_bn")(y)
    z = keras.layers.Add(name="block_add")([y, x])
    z = keras.layers.ReLU(name="block_relu")(z)
    z = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(z)
    z = keras.layers.BatchNormalization(name="dw_bn")(z)
    z = keras.layers.ReLU(name="dw_relu")(z)
    z = keras.layers.AveragePooling2D(2, name="pool")(z)
    z = keras.layers.GlobalAveragePooling2D(name="gap")(z)
    outputs = keras.layers.Dense(classes, name="head")(z)
    return keras.Model(inputs, outputs, name="residual_cnn")


def trained(model: keras.Model, seed: int = 0, epochs: int = 2) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """``model`` fitted a little on random data (so BN statistics are not the identity), and that data."""
    rng = np.random.default_rng(seed)
    shape = (64, *model.inputs[0].shape[1:])
    x = rng.normal(size=shape).astype(np.float32)
    y = rng.integers(0, model.outputs[0].shape[-1], size=64)
    keras.utils.set_random_seed(seed)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=epochs, batch_size=16, verbose=0)
    return model, x, y


def set_batchnorm_statistics(model: keras.Model, x: np.ndarray) -> keras.Model:
    """Give each BatchNormalization the moving mean/variance of its input on ``x``, in graph order.

    A random-init network's BNs hold mean 0, variance 1, so in inference mode its activations blow up or
    vanish layer after layer and its logits carry no signal. With data statistics every BN normalises,
    as in a trained network, and comparisons of two engines measure something.

    One eager inference pass: each BN, when its turn comes, first takes the statistics of the input it receives
    (so later BNs see earlier ones already set), then normalises with them.
    """
    batchnorms = [layer for layer in model.layers if type(layer).__name__ == "BatchNormalization"]

    def setting(layer, call):
        def call_with_statistics(inputs, *args, **kwargs):
            value = np.asarray(inputs, np.float64)
            axes = tuple(range(value.ndim - 1))
            layer.moving_mean.assign(value.mean(axis=axes).astype(np.float32))
            layer.moving_variance.assign(value.var(axis=axes).astype(np.float32))
            return call(inputs, *args, **kwargs)

        return call_with_statistics

    for layer in batchnorms:
        layer.call = setting(layer, layer.call)
    try:
        model(x, training=False)
    finally:
        for layer in batchnorms:
            del layer.call  # the class's call again
    return model

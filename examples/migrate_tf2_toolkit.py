"""NVIDIA's TF2 quantization toolkit's calls with qdq.keras: the same names, qdq's calibrators and export.

The toolkit's ``quantize_model`` with its modes, a ``QuantizationSpec`` and a custom Q/DQ case; then what the
toolkit left to the user (calibration, ONNX export with BN folded) as qdq.keras calls.

    pip install -e ".[tf]" && python examples/migrate_tf2_toolkit.py
"""

import numpy as np

import keras
import qdq.keras as qk  # was: import tensorflow_quantization as tq (and `from tensorflow_quantization import ...`)

keras.utils.set_random_seed(0)
inputs = keras.Input((16, 16, 3))
x = keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inputs)
x = keras.layers.ReLU(name="relu1")(keras.layers.BatchNormalization(name="bn1")(x))
y = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(x)
x = keras.layers.Add(name="add")([x, keras.layers.BatchNormalization(name="bn2")(y)])
outputs = keras.layers.Dense(10, name="head")(keras.layers.GlobalAveragePooling2D(name="gap")(x))
model = keras.Model(inputs, outputs)
batches = [np.random.default_rng(i).normal(size=(16, 16, 16, 3)).astype(np.float32) for i in range(4)]

# quantization_mode="full": every supported layer (the toolkit's default).
full = qk.quantize_model(model)
# "partial": only the layers a spec names; here conv2 with its input quantized, and only the Add's second input.
spec = qk.QuantizationSpec()
spec.add(name="conv2")
spec.add(name="add", quantization_index=[1])
partial = qk.quantize_model(model, quantization_mode="partial", quantization_spec=spec)
# A custom case (the toolkit's CustomQDQInsertionCase) or the predefined ones: ResNetV1QDQCase, MobileNetQDQCase...
residual = qk.quantize_model(model, custom_qdq_cases=[qk.ResNetV1QDQCase()])

for name, qmodel in (("full", full), ("partial", partial), ("resnet case", residual)):
    qk.calibrate(qmodel, batches, method="max")  # the toolkit took ranges from the last training batch
    path = qk.export_onnx(qmodel, batches[0], f"keras_{name.replace(' ', '_')}.onnx")  # toolkit: SavedModel + tf2onnx
    wrapped = sum(isinstance(layer, qk.QuantizeWrapper) for layer in qmodel.layers)
    print(f"{name}: {wrapped} layers wrapped, exported to {path}")

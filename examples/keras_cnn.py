"""A Keras 3 model to INT8 Q/DQ ONNX with qdq.keras (NVIDIA's TF2 toolkit API, qdq's calibrators).

Builds and briefly fits a small residual CNN on random data (use your trained model), quantizes a copy with the
ResNet placement case, calibrates, exports for TensorRT and for ONNX Runtime, and checks the ONNX Runtime
engine against the Keras model.

    pip install -e ".[tf]" && python examples/keras_cnn.py
"""

import numpy as np

import keras
import qdq
import qdq.keras as qk

keras.utils.set_random_seed(0)
inputs = keras.Input((16, 16, 3), name="image")
x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
y = keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(x))
x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
model = keras.Model(inputs, outputs)  # what you hold: a trained Functional or Sequential model

data = np.random.default_rng(0).normal(size=(128, 16, 16, 3)).astype(np.float32)
labels = np.random.default_rng(1).integers(0, 10, size=128)
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(data, labels, epochs=2, batch_size=32, verbose=0)
batches = [data[i : i + 32] for i in range(0, 128, 32)]

# For TensorRT: the toolkit's cases place Q/DQ as TensorRT fuses them (the original model is left untouched).
qmodel = qk.quantize_model(model, custom_qdq_cases=[qk.ResNetV1QDQCase()])
qk.calibrate(qmodel, batches)  # method="auto": the method whose outputs stay closest to float
print(qk.auto_result(qmodel).summary())  # what it chose, and every candidate's score
print("TensorRT file:", qk.export_onnx(qmodel, batches[0], "keras_trt.onnx", target="tensorrt"))  # BN folded, opset 13

# For ONNX Runtime's int8 CPU kernels: quantize for that target; the model remembers it and exports for it.
cpu_model = qk.quantize_model(model, target="onnxruntime")
qk.calibrate(cpu_model, batches, method="percentile")
path = qk.export_onnx(cpu_model, batches[0], "keras_ort.onnx")  # (model, example, path): as qdq.export_onnx
print(qdq.verify(qk.fold_batchnorms(cpu_model), path, batches).verdict_line())

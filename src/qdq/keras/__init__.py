"""qdq for Keras 3 (TensorFlow backend): the NVIDIA TF2 QAT toolkit's API, calibrated and exported like qdq's
PyTorch path.

    import qdq.keras as qk
    qmodel = qk.quantize_model(model, custom_qdq_cases=[qk.ResNetV1QDQCase()])  # model is left untouched
    qk.calibrate(qmodel, calibration_batches)                                # static ranges, method="auto"
    print(qk.auto_result(qmodel).table())                                    # what auto chose, and why
    qmodel.compile(...); qmodel.fit(...)                                     # QAT (optional)
    qk.export_onnx(qmodel, x[:1], "model.onnx", target="tensorrt")          # the PyTorch path's arguments
    qdq.verify(qmodel, "model.onnx", batches)                                # the engine vs Keras

For ONNX Runtime's int8 kernels quantize with ``qk.quantize_model(model, target="onnxruntime")`` (conv
outputs, every input of residual adds, unsigned post-ReLU ranges: the target's rules, the ones the PyTorch
path runs); the model remembers its target and ``export_onnx`` exports for it.

Importing ``qdq.keras`` imports nothing; TensorFlow is imported when a name below is first used (install
it with ``pip install 'qdq[tf]'``).
"""

from __future__ import annotations

from qdq.lazy import lazy_names

_LAZY = {
    "quantize_model": "qdq.keras.quantize",
    "QUANTIZATION_MODES": "qdq.keras.quantize",
    "QuantizationSpec": "qdq.keras.spec",
    "LayerConfig": "qdq.keras.spec",
    "calibrate": "qdq.keras.calibration",
    "auto_result": "qdq.keras.calibration",
    "collect_stats": "qdq.keras.calibration",
    "CalibrationStats": "qdq.keras.calibration",
    "set_ranges": "qdq.keras.calibration",
    "ptq": "qdq.keras.post_training",
    "bypassed": "qdq.keras.post_training",
    "qat": "qdq.keras.fine_tuning",
    "export_onnx": "qdq.keras.export",
    "export_float_onnx": "qdq.keras.export",
    "fold_batchnorms": "qdq.keras.fold",
    "split_activations": "qdq.keras.placement",
    "placed_target": "qdq.targets.marks",
    "fake_quant": "qdq.keras.quantizer",
    "QuantizeWrapper": "qdq.keras.wrappers",
    "register_wrapper": "qdq.keras.wrappers",
    "wrappers_of": "qdq.keras.wrappers",
    "WRAPPERS": "qdq.keras.wrappers",
    "CustomQDQInsertionCase": "qdq.keras.cases",
    "ResidualConnectionQDQCase": "qdq.keras.cases",
    "BNQDQCase": "qdq.keras.cases",
    "MaxPoolQDQCase": "qdq.keras.cases",
    "ResNetV1QDQCase": "qdq.keras.cases",
    "ResNetV2QDQCase": "qdq.keras.cases",
    "MobileNetQDQCase": "qdq.keras.cases",
    "EfficientNetQDQCase": "qdq.keras.cases",
    "InceptionQDQCase": "qdq.keras.cases",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

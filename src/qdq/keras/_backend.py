"""TensorFlow and Keras 3, imported on first use with one clear error when they are missing."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from typing import Any

from qdq.errors import QdqBackendUnavailable

_HINT = "install the TensorFlow extra: pip install 'qdq[tf]' (TensorFlow >= 2.16 with Keras 3, and tf2onnx)"


def _import_triton_first() -> None:
    """Import Triton now if it is installed (it comes with torch's CUDA builds): imported *after* TensorFlow,
    loading its native library crashes the process (segmentation fault, seen with TensorFlow 2.21 and Triton
    3.x), and torch imports it late (``torch.compile``, torchvision's ops)."""
    if importlib.util.find_spec("triton") is not None:
        with contextlib.suppress(Exception):  # a broken Triton is torch's business; TensorFlow does not need it
            import triton  # noqa: F401


@functools.cache
def tf() -> Any:
    """The ``tensorflow`` module (Keras 3 on the TensorFlow backend)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banner, not errors
    if "tensorflow" not in sys.modules:
        _import_triton_first()
    try:
        import tensorflow
    except ImportError as err:
        raise QdqBackendUnavailable(f"qdq.keras needs TensorFlow, which is not installed: {_HINT}.") from err
    return tensorflow


@functools.cache
def keras() -> Any:
    """The ``keras`` module, checked to be Keras 3 on the TensorFlow backend."""
    tf()
    import keras as keras_module

    major = int(keras_module.__version__.split(".")[0])
    if major < 3:
        raise QdqBackendUnavailable(f"qdq.keras needs Keras 3, found {keras_module.__version__}: {_HINT}.")
    backend = keras_module.config.backend()
    if backend != "tensorflow":
        raise QdqBackendUnavailable(
            f"qdq.keras runs on Keras's TensorFlow backend; KERAS_BACKEND is {backend!r}. Set "
            "KERAS_BACKEND=tensorflow before importing keras (on the torch backend, quantize the torch "
            "model with qdq.quantize_model instead)."
        )
    return keras_module


@functools.cache
def tf2onnx() -> Any:
    """The ``tf2onnx`` module (export only)."""
    tf()
    try:
        import tf2onnx as module
        import tf2onnx.convert
        import tf2onnx.optimizer
    except ImportError as err:
        raise QdqBackendUnavailable(f"qdq.keras export needs tf2onnx, which is not installed: {_HINT}.") from err
    return module

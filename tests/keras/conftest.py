"""Keras tests skip cleanly where TensorFlow (or tf2onnx) is not installed."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
from qdq.errors import QdqBackendUnavailable
from qdq.keras import _backend

try:
    _backend.tf()  # imports Triton first where it is installed: imported after TensorFlow it crashes
except QdqBackendUnavailable:
    pytest.skip("the Keras front end needs TensorFlow: pip install 'qdq[tf]'", allow_module_level=True)
pytest.importorskip("tf2onnx", reason="the Keras export needs tf2onnx: pip install 'qdq[tf]'")

sys.path.insert(0, str(Path(__file__).parent))

from keras_models import residual_cnn, trained

import keras


@pytest.fixture
def cnn():
    keras.utils.set_random_seed(0)
    return trained(residual_cnn())

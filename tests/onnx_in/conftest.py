"""The ONNX front end's tests import their small models from ``onnx_models`` beside them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

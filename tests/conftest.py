import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _tensorrt_rules(request):
    """Check every "tensorrt"-target ONNX this test exports against TensorRT's rules (tests/tensorrt_rules.py).

    A private MonkeyPatch: the test's own ``monkeypatch`` fixture keeps its usual setup and teardown order."""
    from qdq.export import onnx_export
    from tensorrt_rules import checked_finish_onnx, exempt_rules

    checked = checked_finish_onnx(onnx_export.finish_onnx, exempt_rules(request.node))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_export, "finish_onnx", checked)
        yield

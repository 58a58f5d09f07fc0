import importlib.util
import os
import sys
from pathlib import Path

# Under pytest-xdist the workers share the cores: one compute thread each (torch's OpenMP, TensorFlow's pools) instead
# of every worker spinning as many threads as there are cores. Set before torch or TensorFlow is imported; a value
# the caller exported wins. Inherited by the examples the tests run in subprocesses.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    for _variable in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(_variable, "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# tf2onnx deep-copies the whole graph before each of its optimizers so that it can skip one that fails (a third of
# a ResNet-50 export's time); the tests want such a failure loud and the time back. Inherited by the examples the
# tests run in subprocesses.
os.environ.setdefault("TF2ONNX_CATCH_ERRORS", "false")


def pytest_addoption(parser):
    parser.addoption("--skipped-to", metavar="PATH", default=None,
                     help="write the id of every skipped test or module to PATH, one per line (a pytest argument "
                          "file: `pytest @PATH` runs them again; .ci/run's second pass, with the extras installed)")


class _SkippedRecorder:
    """Collects the ids of skipped tests and skipped modules (a module-level ``importorskip``); on the controller
    under xdist, which receives every worker's reports."""

    def __init__(self, path: Path):
        self.path, self.ids = path, []

    def pytest_collectreport(self, report):
        if report.skipped:
            self.ids.append(report.nodeid)

    def pytest_runtest_logreport(self, report):
        if report.skipped and report.when in ("setup", "call") and not hasattr(report, "wasxfail"):  # not xfails
            self.ids.append(report.nodeid)

    def pytest_sessionfinish(self):
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(f"{nodeid}\n" for nodeid in dict.fromkeys(self.ids)))
        tmp.replace(self.path)


def pytest_configure(config):
    path = config.getoption("--skipped-to")
    if path and not hasattr(config, "workerinput"):  # the xdist controller or a plain run, not a worker
        config.pluginmanager.register(_SkippedRecorder(Path(path)), "qdq-skipped-recorder")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly where CUDA is not available; the demo application's tests (``tests/app/``
    and those marked ``app``) where the ``app`` extra is not installed."""
    _skip_without_app_extra(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _skip_without_app_extra(items):
    from qdq.cli import APP_EXTRA_MODULES

    missing = [name for name in APP_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    app_tests = Path(__file__).parent / "app"
    skip = pytest.mark.skip(reason=f"the demo application needs the app extra ({', '.join(missing)} not installed)")
    for item in items:
        if item.get_closest_marker("app") or item.path.is_relative_to(app_tests):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _tensorrt_rules(request):
    """Check every "tensorrt"-target ONNX this test exports against TensorRT's rules (tests/tensorrt_rules.py).

    A private MonkeyPatch: the test's own ``monkeypatch`` fixture keeps its usual setup and teardown order."""
    from qdq.export import onnx_export
    from tensorrt_rules import exempt_rules, failing_rule_warning

    checked = failing_rule_warning(onnx_export._warn_broken_rules, exempt_rules(request.node))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_export, "_warn_broken_rules", checked)
        yield

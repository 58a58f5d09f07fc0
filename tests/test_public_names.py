"""Each public name of ``qdq`` and ``qdq.workflow`` has one meaning, whatever has been imported.

The trap this guards against: a lazily exported function living in a submodule of the same name
(``qdq.workflow.calibrate`` the function in ``qdq/workflow/calibrate.py``): once the submodule is
imported, Python binds the package attribute to the module and the function is gone.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys
import types

import pytest

import qdq
import qdq.workflow
from qdq.errors import QdqBackendUnavailable

FUNCTIONS = (
    "calibrate", "collect_stats", "load_amax", "ptq", "qat", "sensitivity", "keep_float", "verify", "smooth_inputs"
)  # fmt: skip


def _lazy_names(package: types.ModuleType) -> list[str]:
    return sorted(package._LAZY)


@pytest.mark.parametrize("package", [qdq, qdq.workflow], ids=["qdq", "qdq.workflow"])
def test_no_submodule_is_named_like_a_lazy_name(package):
    clashes = [n for n in _lazy_names(package) if importlib.util.find_spec(f"{package.__name__}.{n}") is not None]
    assert clashes == [], f"{package.__name__}: submodules named like exported names: {clashes}"


def _import_or_skip(name: str) -> bool:
    """Import module ``name``; False when it needs an optional backend that is not installed (TensorFlow for
    ``qdq.keras``: it says so with ``QdqBackendUnavailable``)."""
    try:
        importlib.import_module(name)
    except QdqBackendUnavailable:
        return False
    return True


def test_importing_every_submodule_changes_no_public_name():
    """The same objects before and after importing every module of qdq (those of an absent optional backend
    excepted); the workflow entry points are functions (not modules), identical under ``qdq.<name>`` and
    ``qdq.workflow.<name>``."""
    before = {(p.__name__, n): getattr(p, n) for p in (qdq, qdq.workflow) for n in _lazy_names(p)}
    imported = [_import_or_skip(info.name) for info in pkgutil.walk_packages(qdq.__path__, "qdq.")]
    assert sum(imported) > 50  # the modules without an optional backend: nearly all of them
    after = {(p.__name__, n): getattr(p, n) for p in (qdq, qdq.workflow) for n in _lazy_names(p)}
    changed = [key for key in before if after[key] is not before[key]]
    assert changed == []
    for name in FUNCTIONS:
        assert isinstance(getattr(qdq, name), types.FunctionType), name
        assert getattr(qdq, name) is getattr(qdq.workflow, name), name


def test_in_a_fresh_process_the_submodule_import_order_does_not_matter():
    """Import the implementation modules first, then read the names (the order that used to break)."""
    code = (
        "import types, qdq, qdq.workflow.calibration, qdq.workflow.post_training, qdq.workflow.fine_tuning, "
        "qdq.workflow.sensitivity_analysis, qdq.workflow.verification\n"
        f"bad = [n for n in {FUNCTIONS!r} if not isinstance(getattr(qdq.workflow, n), types.FunctionType)]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("package", [qdq, qdq.workflow], ids=["qdq", "qdq.workflow"])
def test_the_old_compute_amax_name_says_where_it_went(package):
    with pytest.raises(AttributeError, match=r"renamed .*load_amax"):
        package.compute_amax  # noqa: B018


def test_qdq_distributed_error_lives_in_errors():
    from qdq.errors import QdqDistributedError, QdqError
    from qdq.workflow import distributed

    assert qdq.QdqDistributedError is QdqDistributedError and issubclass(QdqDistributedError, QdqError)
    assert QdqDistributedError.__module__ == "qdq.errors"
    assert "QdqDistributedError" not in distributed.__all__


def test_each_package_exports_what_a_user_imports():
    """The top of each package holds the user's names; the rest lives one level down, still importable there, and a
    name that used to be exported here says where it went."""
    import qdq.runtime
    import qdq.targets

    seed = {"QuantDescriptor", "TensorQuantizer", "tensor_quant", "nn", "quant_modules", "calib", "utils", "optim"}
    entry_points = {"quantize_model", "QuantConfig", "calibrate", "export_onnx", "quantize_onnx", "verify", "tune",
                    "ptq", "qat"}  # fmt: skip
    assert seed | entry_points | {"QdqError", "errors"} <= set(qdq.__all__)
    assert len(qdq.__all__) <= 40 and len(qdq.runtime.__all__) <= 25 and len(qdq.targets.__all__) <= 16
    from qdq.placement import apply_placement
    from qdq.runtime.ort import OrtRuntime, fusion_report
    from qdq.targets.marks import placed_target
    from qdq.tensor_quant import fake_tensor_quant

    moved = [(qdq, "qdq.placement", apply_placement), (qdq, "qdq.tensor_quant", fake_tensor_quant),
             (qdq.runtime, "qdq.runtime.ort", OrtRuntime), (qdq.runtime, "qdq.runtime.ort", fusion_report),
             (qdq.targets, "qdq.targets.marks", placed_target)]  # fmt: skip
    for package, home, value in moved:
        name = value.__name__
        assert name not in package.__all__ and name not in dir(package)
        assert getattr(importlib.import_module(home), name) is value
        with pytest.raises(AttributeError, match=rf"moved to {home}: from {home} import {name}$"):
            getattr(package, name)
    assert qdq.placement is importlib.import_module("qdq.placement")  # every submodule is still an attribute

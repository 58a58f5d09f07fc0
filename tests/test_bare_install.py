"""`pip install qdq` without extras: the library works without the demo application's packages (the app extra).

The library's flow (quantize_model -> calibrate -> export_onnx -> ONNX Runtime) runs in a subprocess where the app
extra's modules cannot be imported (``sys.modules[name] = None``: the import raises, ``find_spec`` finds nothing),
so it proves the point whether or not they are installed here; the CLI's app commands say which extra to install.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qdq.cli import APP_COMMANDS, APP_EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]
BLOCK = f"import sys\nfor _name in {APP_EXTRA_MODULES!r}:\n    sys.modules[_name] = None\n"


def _run_blocked(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "bare.py"
    script.write_text(BLOCK + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)


def _requirement_names(requirements: list[str]) -> set[str]:
    return {req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for req in requirements}


def test_the_app_extra_is_neither_a_library_nor_a_test_dependency():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11's")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    app = _requirement_names(project["optional-dependencies"]["app"])
    assert app == {"matplotlib", "scikit-learn", "mlxtend", "torchvision"}
    assert not app & _requirement_names(project["dependencies"])
    # the bare pass of .ci/run installs [test]: torchvision (test models) yes, the demo's packages no
    assert _requirement_names(project["optional-dependencies"]["test"]) & app == {"torchvision"}
    import_names = {"scikit-learn": "sklearn"}
    assert {import_names.get(name, name) for name in app} == set(APP_EXTRA_MODULES)


def test_quantize_calibrate_export_and_run_on_onnxruntime_without_the_app_extra(tmp_path):
    result = _run_blocked(
        """
        import numpy as np
        import torch
        from torch import nn

        import qdq
        from qdq.runtime import load_runtime

        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(),
                              nn.Linear(8 * 6 * 6, 4)).eval()
        model = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
        batches = [torch.randn(4, 3, 8, 8) for _ in range(3)]
        qdq.calibrate(model, batches, method="percentile")
        path = qdq.export_onnx(model, batches[0], "model.onnx")
        with load_runtime(path, "onnxruntime", threads=1) as rt:
            engine = np.asarray(rt.run(batches[0].numpy())[0])
        with torch.no_grad():
            reference = model(batches[0]).numpy()
        assert engine.shape == (4, 4), engine.shape
        step = np.abs(reference).max() / 127
        assert np.abs(engine - reference).max() <= 2 * step, np.abs(engine - reference).max()
        loaded = sorted(name for name in ("matplotlib", "sklearn", "mlxtend", "torchvision") if sys.modules[name])
        print("ok", loaded)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "ok []"


def test_the_cli_names_the_extra_an_app_command_needs(tmp_path):
    assert {"demo", "quantize", "verify"} == APP_COMMANDS
    result = _run_blocked(
        """
        from qdq.cli import main
        codes = [main(["demo", "--quick", "--out", "demo"]), main(["verify", "out"]),
                 main(["quantize", "--model", "digits_resnet", "--random-init", "--data", "digits"])]
        print(codes)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[2, 2, 2]"
    lines = result.stderr.strip().split("\n")
    assert [line.split(":")[0] for line in lines] == ["qdq demo", "qdq verify", "qdq quantize"]
    for line in lines:
        assert "needs the 'app' extra (matplotlib, sklearn, mlxtend, torchvision not installed)" in line
        assert "pip install 'qdq[app]'" in line
    assert "Traceback" not in result.stderr and not (tmp_path / "demo").exists()


def test_library_commands_need_no_app_extra(tmp_path):
    result = _run_blocked(
        """
        from qdq.cli import main, missing_app_extra
        print([missing_app_extra(command) for command in ("bench", "check")], main(["check", "absent.onnx"]))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[None, None] 2"
    assert "app" not in result.stderr and "absent.onnx" in result.stderr

"""Every script in examples/ and every Python block of the README runs, offline, so the guides (which include the
scripts from their files) and the landing page cannot rot.

A script whose imports need an optional extra that is not installed skips, naming the extra; each one's output is
checked for what it exists to show.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# an import of the first -> the modules it needs and the extra that installs them
EXTRAS = {
    "keras": (("tensorflow", "tf2onnx"), "tf"),
    "tensorflow": (("tensorflow", "tf2onnx"), "tf"),
    "transformers": (("transformers",), "transformers"),
    "timm": (("timm",), "transformers"),
    "openvino": (("openvino",), "openvino"),
    "sklearn": (("sklearn",), "app"),
    "mlxtend": (("mlxtend",), "app"),
    "matplotlib": (("matplotlib",), "app"),
}
# what each script's output must show
EXPECTED = {
    "calibration.py": [r"auto: \d+\.\d+ %", r"warning: .*clip"],
    "cpu_cnn.py": [r"PASS: top-1 agreement .* \(onnxruntime\)", r"onnxruntime: FP32 .* speed-up \d"],
    # the two ranks write one pipe: unbuffered, print writes its text and its newline apart, so one rank's line can
    # run on into the other's ("... 4.257812rank 1 of 2: ..."); the range is read as the number it prints
    "distributed.py": [r"rank 0 of 2: first input range (\d+\.\d{6})", r"rank 1 of 2: first input range (\d+\.\d{6})",
                       r"wrote"],
    "keras_cnn.py": [r"TensorRT file: keras_trt\.onnx", r"PASS: top-1 agreement"],
    "migrate_pytorch_quantization.py": [r"the two recipes give the same ranges: True"],
    "migrate_tf2_toolkit.py": [r"partial: 2 layers wrapped", r"resnet case: \d+ layers wrapped"],
    "onnx_file.py": [r"accuracy: FP32 0\.\d+, INT8 0\.\d+", r"TensorRT file: digits_trt11\.onnx, rule check PASS",
                     r"against FP32 digits_fp32\.onnx.*\n.*PASS: top-1 agreement"],
    "qat.py": [r"W4A8 after QAT epoch 2 \(resumed from epoch 1\)"],
    "tensorrt_cnn.py": [r"trtexec --onnx=resnet18_trt11\.onnx", r"PASS"],
    "tune_budget.py": [r"plain INT8 meets the budget: False", r"Search cost: \d+ evaluations, \d+ files written"],
    "transformer.py": [r"engine logits \(2, 3\)", r"smoothed [1-9]\d* Linear inputs"],
    "verify_and_benchmark.py": [r"PASS|FAIL", r"INT8"],
}
COMMANDS = {"distributed.py": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]}

pytestmark = pytest.mark.slow


def _missing_extra(source: str) -> str | None:
    """``"the tf extra (tensorflow not installed)"`` when the code imports a module an absent extra installs."""
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            modules, extra = EXTRAS.get(name.split(".")[0], ((), ""))
            missing = [m for m in modules if importlib.util.find_spec(m) is None]
            if missing:
                return f"needs the {extra} extra ({', '.join(missing)} not installed): pip install -e '.[{extra}]'"
    return None


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def test_every_example_has_its_expectations():
    assert {path.name for path in EXAMPLES} == set(EXPECTED)


@pytest.mark.parametrize("script", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(script, tmp_path):
    reason = _missing_extra(script.read_text())
    if reason:
        pytest.skip(reason)
    out = _run([sys.executable, *COMMANDS.get(script.name, []), str(script)], tmp_path)
    matches = [re.search(pattern, out) for pattern in EXPECTED[script.name]]
    assert all(matches), f"{script.name}: expected {EXPECTED[script.name]} in:\n{out[-3000:]}"
    if script.name == "distributed.py":  # every rank loads the same range, bit for bit
        assert matches[0].group(1) == matches[1].group(1)


def _readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)


def test_the_readme_has_three_python_examples():
    assert len(_readme_blocks()) == 3


README_EXPECTED = {  # each Python block of the README: what it prints, what it writes
    "pytorch": (r"(PASS|FAIL): top-1 agreement", "resnet18_int8.onnx"),
    "transformer": (None, "bert_int8.onnx"),
    "keras": (r"(PASS|FAIL): top-1 agreement", "keras_int8.onnx"),
}


@pytest.mark.parametrize("name", README_EXPECTED)
def test_readme_example_runs(name, tmp_path):
    code = _readme_blocks()[list(README_EXPECTED).index(name)]
    reason = _missing_extra(code)
    if reason:
        pytest.skip(reason)
    (tmp_path / "example.py").write_text(code)
    out = _run([sys.executable, "example.py"], tmp_path)
    pattern, written = README_EXPECTED[name]
    assert pattern is None or re.search(pattern, out), out[-3000:]
    assert (tmp_path / written).is_file()

"""The `qdq` CLI end to end on a tiny budget, config files, and one-line user errors (exit code 2)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qdq.app.pipeline import PipelineConfig
from qdq.cli import main
from qdq.errors import QdqConfigError, QdqTypeError


def _run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "qdq.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return out, result


def test_demo_quick_end_to_end(quick_demo):
    out, result = quick_demo
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^\| digits_resnet W8A8 +\|", result.stdout, flags=re.M)  # the demo table's row
    run = out / "digits_resnet" / "W8A8"
    for name in ("model.onnx", "model_fp32.onnx", "quantized_state_dict.pt", "report.md", "report.html",
                 "summary.json", "accuracy.png", "latency.png"):  # fmt: skip
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())["pipeline"]
    engine = summary["engines"]["onnxruntime"]
    assert engine["top1_agreement"] >= 99.0
    assert set(summary["accuracy"]) >= {"FP32", "QAT", "INT8 engine (onnxruntime)"}
    assert "auto" in summary["ptq"]["methods"]  # --calib all includes auto
    kept = summary["ptq"]["best"]
    methods = {q["method"] for q in summary["calibration"]["quantizers"]}  # the kept ranges' diagnostics
    assert methods == {kept} or (kept == "auto" and all(m.startswith("auto: ") for m in methods))
    assert "## Calibration diagnostics" in (run / "report.md").read_text() and (run / "calibration_worst.png").is_file()


def test_verify_command_on_demo_output(quick_demo, capsys):
    out, result = quick_demo
    assert result.returncode == 0
    code, stdout, _ = _run(["verify", str(out / "digits_resnet" / "W8A8"), "--batches", "2"], capsys)
    assert code == 0 and "top-1 agreement" in stdout


def test_config_round_trip(tmp_path):
    cfg = PipelineConfig(model="digits_mobilenet", calib="entropy", qat_epochs=2, runtimes=["openvino"],
                         weight_bits=4, out=str(tmp_path / "o"))  # fmt: skip
    path = tmp_path / "qdq.yaml"
    path.write_text(cfg.to_yaml())
    assert PipelineConfig.from_yaml_file(path) == cfg
    with pytest.raises(QdqTypeError, match="Did you mean 'calib'"):
        PipelineConfig.from_dict({"calb": "max"})
    with pytest.raises(QdqConfigError, match="target"):
        PipelineConfig(target="tflite")


def test_cli_flags_override_config_file(tmp_path):
    from qdq.cli import build_parser, pipeline_config

    path = tmp_path / "qdq.yaml"
    path.write_text(PipelineConfig(calib="mse", qat_epochs=3).to_yaml())
    args = build_parser().parse_args(["quantize", "--config", str(path), "--qat-epochs", "1", "--runtime", "openvino"])
    cfg = pipeline_config(args)
    assert (cfg.calib, cfg.qat_epochs, cfg.runtimes) == ("mse", 1, ["openvino"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "torchvision:resnet5O"], "resnet5"),
        (["--model", "digits_resnet", "--weights", "missing.pt"], "missing.pt"),
        (["--model", "digits_resnet", "--data", "imagefolder:EMPTY"], "no images"),
        (["--model", "digits_resnet", "--data", "mnist"], "unknown data spec"),
        (["--model", "digits_resnet", "--calib", "kl"], "calib must be one of"),
        (["--config", "nope.yaml"], "does not exist"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").mkdir()
    code, _, err = _run(["quantize", *args, "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


def test_model_that_rejects_the_data_shape(tmp_path, capsys):
    factory = tmp_path / "net.py"
    factory.write_text("import torch\ndef make_model():\n    return torch.nn.Linear(5, 2)\n")
    code, _, err = _run(["quantize", "--model", f"{factory}:make_model", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not accept" in err


def test_weights_of_another_model_are_one_line_exit_2(tmp_path, capsys):
    from qdq.app.models import load_model

    weights = tmp_path / "w.pt"
    torch.save(load_model("digits_resnet").state_dict(), weights)
    assert Path(weights).is_file()
    code, _, err = _run(["quantize", "--model", "digits_mobilenet", "--weights", str(weights),
                         "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert (code == 2 and "missing" in err.lower()) or "unexpected" in err.lower()

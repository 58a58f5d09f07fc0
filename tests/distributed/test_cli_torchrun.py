"""`qdq quantize` under torchrun (2 processes, gloo unless $QDQ_TEST_DIST_BACKEND=nccl): the same job,
files written once by rank 0."""

import json
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.app]  # qdq quantize --data digits: scikit-learn


def test_quantize_command_under_torchrun(tmp_path, torchrun_env):
    env = torchrun_env(QDQ_DIST_TIMEOUT="300")
    if env["QDQ_DIST_BACKEND"] != "gloo":
        pytest.skip("the `qdq quantize` job keeps its model on the CPU: its DDP fine-tuning needs gloo")
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "qdq.cli", "quantize", "--model", "digits_resnet", "--random-init", "--data", "digits",
        "--calib", "max", "--calib-batches", "2", "--qat-epochs", "1", "--runtime", "onnxruntime", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"^\| stage +\| top-1 % \|$", result.stdout, flags=re.M)) == 1  # printed by rank 0 only
    summary = json.loads((out / "summary.json").read_text())["pipeline"]
    assert summary["engines"]["onnxruntime"]["top1_agreement"] >= 99.0
    assert (out / "model.onnx").is_file() and (out / "checkpoints" / "qat_checkpoint.pt").is_file()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temp files left behind

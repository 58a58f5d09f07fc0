"""`qdq quantize` under torchrun (2 CPU processes, gloo): the same job, files written once by rank 0."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_quantize_command_under_torchrun(tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "qdq.cli", "quantize", "--model", "digits_resnet", "--calib", "max", "--calib-batches", "2",
        "--qat-epochs", "1", "--runtime", "onnxruntime", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QDQ_DIST_TIMEOUT": "300"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("| stage | top-1 % |") == 1  # printed by rank 0 only
    summary = json.loads((out / "summary.json").read_text())["pipeline"]
    assert summary["engines"]["onnxruntime"]["top1_agreement"] >= 99.0
    assert (out / "model.onnx").is_file() and (out / "checkpoints" / "qat_checkpoint.pt").is_file()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temp files left behind

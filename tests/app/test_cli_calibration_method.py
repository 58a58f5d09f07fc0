"""``qdq quantize --calib NAME`` with a calibration method registered from outside qdq (tests/batch_maxima.py)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import batch_maxima
from qdq.app.data import make_loaders, parse_data_spec
from qdq.cli import main

FACTORY = """import torch
from torch import nn


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 10))
"""
# a small, fast job: 8x8 digits, one evaluation batch, no engine
CONFIG = """image_size: 8
batch_size: 16
eval_batches: 1
runtimes: []
"""


@pytest.mark.slow
def test_quantize_with_a_registered_method(tmp_path, capsys):
    (tmp_path / "net.py").write_text(FACTORY)
    (tmp_path / "qdq.yaml").write_text(CONFIG)
    out = tmp_path / "job"
    args = ["quantize", "--config", str(tmp_path / "qdq.yaml"), "--model", f"{tmp_path / 'net.py'}:make_model",
            "--data", "digits", "--calib", batch_maxima.NAME, "--calib-batches", "3", "--out", str(out)]  # fmt: skip
    with batch_maxima.registered():
        assert main(["quantize", "--help"]) == 0
        assert f"percentile,auto,{batch_maxima.NAME}" in "".join(capsys.readouterr().out.split())  # any wrapping
        assert main(args) == 0, capsys.readouterr().err
    assert main(args) == 2  # unregistered: one line naming the registered methods
    assert "calib must be one of ['all', 'max', 'entropy', 'mse', 'percentile', 'auto']" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())["pipeline"]
    assert list(summary["ptq"]["methods"]) == [batch_maxima.NAME] and summary["ptq"]["best"] == batch_maxima.NAME
    assert {q["method"] for q in summary["calibration"]["quantizers"]} == {batch_maxima.NAME}
    # the input range: the median over the 3 calibration batches of their max |x| (the job's data, rebuilt here)
    train, test = parse_data_spec("digits", size=8, seed=0)
    batches = [x.numpy() for x, _ in itertools.islice(iter(make_loaders(train, test, batch_size=16, seed=0)[0]), 3)]
    state = torch.load(out / "quantized_state_dict.pt", weights_only=True)
    assert float(state["0._input_quantizer._amax"]) == pytest.approx(batch_maxima.median_of_maxima(batches), rel=1e-6)

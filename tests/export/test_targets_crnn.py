"""A CRNN text recognizer (benchmarks/crnn_int8.py: VGG-style convs, two bidirectional LSTMs, a Linear head,
CTC-shaped output; random init) quantized, calibrated, exported and run for both targets.

* target "onnxruntime": the LSTMs stay float (the target's ``float_recurrent`` rule: ONNX Runtime runs ONNX
  ``LSTM`` nodes in its own float kernel), every one of the 6 convs is a ``QLinearConv`` in the graph ONNX
  Runtime optimizes, no Q/DQ sits between the two LSTMs, and the engine's log-probabilities stay within one
  output step of the PyTorch model with the same best class in every frame (but ties).
* target "tensorrt": the seed's fused QuantLSTM stays, and every Q/DQ pair computes the PyTorch quantizer's
  function bit for bit (teacher forced), the LSTMs' per-time-step quantizers included.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_helpers import ort_session, run_ort, steps_apart, teacher_forced_mismatches
from torch import nn

import qdq
from qdq import nn as qnn
from qdq.export import export_onnx
from qdq.workflow.calibration import calibrate

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _crnn_module():
    sys.path.insert(0, str(BENCHMARKS))  # crnn_int8 imports its sibling cpu_int8
    spec = importlib.util.spec_from_file_location("crnn_int8", BENCHMARKS / "crnn_int8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CRNN = _crnn_module()
X = CRNN.calibration_batches(count=1, batch=3)[0]


def placed(target: str) -> nn.Module:
    model = qdq.quantize_model(copy.deepcopy(CRNN.crnn()), qdq.QuantConfig(target=target))
    calibrate(model, CRNN.calibration_batches(count=2), method="max", progress=False)
    return model.eval()


@pytest.mark.slow
def test_onnxruntime_target_runs_every_conv_in_int8_and_the_lstms_in_float(tmp_path):
    model = placed("onnxruntime")
    assert [type(m).__name__ for m in (model.rnn1, model.rnn2)] == ["LSTM", "LSTM"]
    assert not any(isinstance(m, qnn.QuantLSTM) for m in model.modules())
    path = export_onnx(model, X, tmp_path / "crnn.onnx", dynamo=False)
    graph = onnx.load(str(path)).graph
    lstms = [n for n in graph.node if n.op_type == "LSTM"]
    assert len(lstms) == 2
    producer = {out: n for n in graph.node for out in n.output}
    source = producer[lstms[1].input[0]]
    while source.op_type in ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Concat"):
        source = producer[source.input[0]]
    assert source is lstms[0]  # LSTM -> LSTM, no Q/DQ between them
    optimized = tmp_path / "crnn_optimized.onnx"
    engine = ort_session(path, optimize=True, optimized_path=optimized).run(None, {"input": X.numpy()})[0]
    kernels = Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
    assert kernels["QLinearConv"] == 6 and kernels["Conv"] == kernels["FusedConv"] == 0
    assert kernels["LSTM"] == 2
    with torch.no_grad():
        reference = model(X).numpy()
    assert engine.shape == reference.shape == (32, 3, 37)  # (time, batch, classes): what nn.CTCLoss takes
    assert steps_apart(reference, engine) <= 1.0
    assert_same_decoding(reference, engine)


def assert_same_decoding(reference: np.ndarray, engine: np.ndarray) -> None:
    """The best class of every frame agrees, but where two classes of the random model are within the
    engine's largest difference of each other (a tie either may break)."""
    off = np.abs(engine - reference).max()
    best, chosen = reference.argmax(-1), engine.argmax(-1)
    margin = np.take_along_axis(reference, best[..., None], -1) - np.take_along_axis(reference, chosen[..., None], -1)
    assert np.all((best == chosen) | (margin[..., 0] <= 2 * off))

@pytest.mark.slow
def test_tensorrt_target_keeps_the_quantized_lstms_bit_exact_at_every_quantizer(tmp_path):
    model = placed("tensorrt")
    assert isinstance(model.rnn1, qnn.QuantLSTM) and isinstance(model.rnn2, qnn.QuantLSTM)
    path = export_onnx(model, X, tmp_path / "crnn.onnx", dynamo=False)
    assert teacher_forced_mismatches(model, path, X) == {}
    with torch.no_grad():
        reference = model(X).numpy()
    engine = run_ort(path, X)
    assert steps_apart(reference, engine) <= 1.0
    assert_same_decoding(reference, engine)

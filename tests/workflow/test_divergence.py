"""locate_divergence against a file's own Q/DQ graph (model=None), and qdq.verify / `qdq verify` with an FP32
ONNX file as the reference: what quantizing cost, measured on the same batches."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import qdq
from onnx_models import ConvNet, batches, export
from qdq.cli import main
from qdq.runtime import backend
from qdq.runtime.ort import inference_session, session_options
from qdq.workflow.divergence import locate_divergence
from qdq.workflow.verification import verify


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("divergence")
    torch.manual_seed(0)
    float_path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp / "net.onnx")
    data = batches((4, 3, 16, 16))
    result = qdq.quantize_onnx(float_path, data, tmp / "int8.onnx", target="onnxruntime", progress=False, method="max")
    return float_path, result.path, data


def _run(path, feed):
    return inference_session(path, session_options(threads=1)).run(None, feed)


def test_an_exact_engine_agrees_with_its_q_dq_graph_at_every_quantizer(files):
    _, int8, data = files
    found = locate_divergence(None, int8, data[0], "onnxruntime")
    proto = onnx.load(str(int8))
    constants = {t.name for t in proto.graph.initializer}
    activations = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in constants]
    assert found.first is None and len(found.compared) == len(activations) >= 5
    assert all(c.differing <= 0.02 for c in found.compared)  # fixed-point requantization moves a few codes
    assert "agrees with its Q/DQ graph" in str(found)


def test_an_engine_that_moves_one_quantizers_codes_is_caught_there(files, monkeypatch):
    _, int8, data = files
    proto = onnx.load(str(int8))
    constants = {t.name for t in proto.graph.initializer}
    activations = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in constants]
    target = activations[len(activations) // 2]
    step = float(onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == target.input[1])))
    real = backend.load_runtime

    class Shifted:  # the engine of the cut that ends at `target` adds 3 steps to every value
        def __init__(self, engine):
            self.engine = engine

        def __enter__(self):
            self.engine.__enter__()
            return self

        def __exit__(self, *exc):
            return self.engine.__exit__(*exc)

        def run(self, feed):
            outputs = self.engine.run(feed)
            shift = 3 * step if self.engine.output_names == [target.output[0]] else 0.0
            return [o + shift for o in outputs]

    monkeypatch.setattr("qdq.runtime.load_runtime", lambda *a, **k: Shifted(real(*a, **k)))
    found = locate_divergence(None, int8, data[0], "onnxruntime")
    name = target.name.removesuffix("/DequantizeLinear")
    assert found.first is not None and found.first.name == name and found.first.differing == 1.0
    assert found.first.max_steps == pytest.approx(3.0, abs=1e-3)
    assert f"departs from its Q/DQ graph at {name}" in str(found)


def test_verify_against_the_fp32_file_measures_what_quantizing_cost(files):
    float_path, int8, data = files
    seen = []

    def close(reference, engine):  # fraction of values within 0.05 of FP32
        seen.append((len(reference), reference[0].shape))
        return float(np.mean(np.abs(reference[0] - engine[0]) < 0.05))

    result = verify(float_path, int8, data, metric=close, min_metric=0.5, min_agreement=90.0)
    ref = np.concatenate([_run(float_path, b)[0] for b in data]).astype(np.float64)
    got = np.concatenate([_run(int8, b)[0] for b in data]).astype(np.float64)
    assert seen == [(1, (12, 4, 16, 16))] and result.samples == 12
    assert result.sqnr_db[0] == pytest.approx(10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)), abs=0.05)
    assert result.top1_agreement == pytest.approx(100 * np.mean(ref.argmax(1) == got.argmax(1)), abs=0.5)
    assert result.metric == pytest.approx(np.mean(np.abs(ref - got) < 0.05), abs=0.01)
    assert result.reference == "FP32 net.onnx" and result.max_allowed_steps == float("inf")
    assert "max error" not in result.verdict_line() and "close" in result.verdict_line()
    assert verify(float_path, int8, data, metric=close, min_metric=1.01).verdict == "FAIL"


def test_the_cli_verifies_an_int8_file_against_its_fp32_file(files, tmp_path, capsys):
    float_path, int8, data = files
    np.save(tmp_path / "test.npy", np.concatenate([b["images"] for b in data]))
    (tmp_path / "metrics.py").write_text(
        "import numpy as np\n\ndef sqnr_ok(reference, engine):\n"
        "    return float(np.sum(reference[0] ** 2) / np.sum((reference[0] - engine[0]) ** 2) > 10)\n"
    )
    argv = ["verify", str(int8), "--reference", str(float_path), "--data", str(tmp_path / "test.npy"),
            "--batch-size", "4", "--min-agreement", "0", "--metric", f"{tmp_path / 'metrics.py'}:sqnr_ok"]  # fmt: skip
    assert main([*argv, "--min-metric", "1"]) == 0
    printed = capsys.readouterr().out
    assert "against FP32 net.onnx" in printed and "PASS" in printed and "sqnr_ok 1 >= 1" in printed
    assert main([*argv, "--min-metric", "2"]) == 1
    assert "agrees with its Q/DQ graph" in capsys.readouterr().out  # on FAIL: the engine is not to blame
    assert main(["verify", str(int8), "--data", str(tmp_path / "test.npy")]) != 0
    assert "needs --reference" in capsys.readouterr().err

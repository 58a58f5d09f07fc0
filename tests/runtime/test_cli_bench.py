"""``qdq bench``: the table and reports on success, one stderr line and exit code 2 on user mistakes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from backends import requires_openvino

from qdq.cli import main
from qdq.runtime.openvino import supported_precisions

FAST = ["--threads", "1", "--iters", "3", "--warmup", "1"]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| tiny_")]


def test_bench_onnxruntime_with_reference(u8_onnx: Path, fp32_onnx: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", str(u8_onnx), "--fp32", str(fp32_onnx), *FAST]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "| model " in out and "speed-up (median)" in out
    rows = _table_rows(out)
    assert [row.split("|")[1].strip() for row in rows] == ["tiny_fp32.onnx", "tiny_u8.onnx"]
    assert "1.00×" in rows[0]
    assert "| onnxruntime | int8 " in rows[1]
    assert "ONNX Runtime fusion report: tiny_u8.onnx" in out
    assert "5 weighted ops in int8 kernels, 0 in float kernels" in out  # 4 convs + 1 Gemm


def test_bench_token_model_with_a_sequence_length(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An exported transformer's ids and mask have a dynamic 'sequence' dimension: --seq-len sizes it."""
    import onnx
    from onnx import TensorProto, helper

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("output", TensorProto.INT64, ["batch", "sequence"])
    graph = helper.make_graph([helper.make_node("Mul", ["input_ids", "attention_mask"], ["output"])], "g",
                              [ids, mask], [out])  # fmt: skip
    path = tmp_path / "tiny_tokens.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert main(["bench", str(path), "--seq-len", "16", *FAST]) == 0
    assert "tiny_tokens.onnx" in capsys.readouterr().out


@requires_openvino
def test_bench_openvino(u8_onnx: Path, fp32_onnx: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", str(u8_onnx), "--fp32", str(fp32_onnx), "--runtime", "openvino", "--batch", "2", *FAST]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    precisions = [row.split("|")[3].strip() for row in rows]
    expected = ["fp32", "bf16", "int8"] if "bf16" in supported_precisions() else ["fp32", "int8"]
    assert precisions == expected
    assert all("| 2 " in row for row in rows)  # batch column
    assert "OpenVINO runtime precision: tiny_u8.onnx (inference precision f32)" in out
    assert "| Convolution " in out


def test_bench_single_model_has_no_speedup(fp32_onnx: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", str(fp32_onnx), *FAST]) == 0
    out = capsys.readouterr().out
    assert len(_table_rows(out)) == 1
    assert "speed-up" not in out


def test_console_entry_point(fp32_onnx: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "qdq.cli", "bench", str(fp32_onnx), *FAST], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "| tiny_fp32.onnx" in done.stdout


USER_ERRORS = {
    "missing-file": (["bench", "{tmp}/missing.onnx"], "missing.onnx: no such file"),
    "not-onnx": (["bench", "{tmp}/notes.onnx"], "notes.onnx: not an ONNX model"),
    "missing-reference": (["bench", "{model}", "--fp32", "{tmp}/ref.onnx"], "ref.onnx: no such file"),
    "unknown-runtime": (["bench", "{model}", "--runtime", "onnxrt"], "Did you mean 'onnxruntime'?"),
    "zero-threads": (["bench", "{model}", "--threads", "0"], "argument --threads: must be >= 1"),
    "bad-iters": (["bench", "{model}", "--iters", "many"], "argument --iters: not an integer"),
    "precision-not-openvino": (["bench", "{model}", "--precision", "bf16"], "applies to --runtime openvino only"),
    "bad-precision": (["bench", "{model}", "--runtime", "openvino", "--precision", "fp64"], "unknown OpenVINO"),
    "no-model": (["bench"], "the following arguments are required: MODEL.onnx"),
    "no-command": ([], "the following arguments are required: COMMAND"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_exit_2_with_one_line(
    case: str, tmp_path: Path, fp32_onnx: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "notes.onnx").write_text("this is not a model\n")
    template, message = USER_ERRORS[case]
    argv = [arg.format(tmp=tmp_path, model=fp32_onnx) for arg in template]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert err.startswith("qdq")


def test_missing_backend_exits_2(fp32_onnx: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert main(["bench", str(fp32_onnx), "--runtime", "tensorrt"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "pip install tensorrt" in err


def test_help_exits_0(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--help"]) == 0
    assert "--fp32 REF.onnx" in capsys.readouterr().out

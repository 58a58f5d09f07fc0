"""`qdq quantize --target tensorrt --float fp16`: the TensorRT 11 file (INT8 Q/DQ, the float part in FP16),
through the API: the model quantized with float16 steps, exported with target_options (ranges measured on the
calibration batches)."""

import json

import pytest

from qdq.app.pipeline import PipelineConfig
from qdq.cli import main
from qdq.errors import QdqConfigError
from qdq.targets.tensorrt.check import check_tensorrt


@pytest.mark.slow
def test_quantize_with_float16_writes_a_checked_tensorrt_11_file(tmp_path, capsys):
    out = tmp_path / "job"
    args = ["quantize", "--model", "digits_resnet", "--random-init", "--data", "digits", "--target", "tensorrt",
            "--float", "fp16", "--calib", "max", "--calib-batches", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = check_tensorrt(out / "model.onnx")
    assert report.ok, str(report)
    assert set(report.compute) == {"float16"} and report.int8_ops > 0
    record = json.loads((out / "summary.json").read_text())["pipeline"]
    assert record["config"]["float"] == "float16" and record["float"]["converted_nodes"] == report.compute["float16"]
    assert record["float"]["ranges_measured"] and record["float"]["largest_step_change"] == 0.0  # float16 steps
    assert record["engines"]["onnxruntime"]["top1_agreement"] > 90.0  # ONNX Runtime runs the FP16 file
    assert main(["check", str(out / "model.onnx")]) == 0
    capsys.readouterr()


def test_float_option_needs_the_tensorrt_target(capsys):
    with pytest.raises(QdqConfigError, match="target 'tensorrt'"):
        PipelineConfig(target="onnxruntime", float="fp16")
    assert PipelineConfig(target="tensorrt", float="bf16").float == "bfloat16"
    assert main(["quantize", "--target", "onnxruntime", "--float", "fp16", "--out", "unused"]) == 2
    assert "float" in capsys.readouterr().err
    with pytest.raises(QdqConfigError, match="unknown float type"):
        PipelineConfig(target="tensorrt", float="fp8")

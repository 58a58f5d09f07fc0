"""Runtimes read the target a file was exported for (``qdq.target``) and say what it means for them.

* TensorRT refuses an onnxruntime-target graph, with the reason, before it needs a GPU;
* ONNX Runtime on a tensorrt-target graph reports how many of its Convs stay float and names the target to
  export for instead (``Runtime.advice``, printed by ``qdq bench``); on its own target's graph it says nothing;
* a file qdq did not write, or one made for a target this process does not know, loads as it is.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import rt_models
import torch
from backends import requires_openvino

import qdq
from qdq.cli import main
from qdq.errors import QdqConfigError
from qdq.export import export_onnx
from qdq.graphs.onnx import set_metadata
from qdq.runtime import load_runtime
from qdq.workflow.calibration import calibrate

FAST = ["--threads", "1", "--iters", "2", "--warmup", "1"]


def qdq_export(target: str, path: Path) -> Path:
    model = qdq.quantize_model(rt_models.tiny_cnn(), qdq.QuantConfig(target=target))
    calibrate(model, [torch.randn(2, *rt_models.INPUT_SHAPE)], method="max", progress=False)
    # int8 weights: the same file on every CPU ("auto" stores uint8 where int8 kernels saturate)
    options = {"weights": "int8"} if target == "onnxruntime" else {}
    return export_onnx(model, torch.randn(1, *rt_models.INPUT_SHAPE), path, dynamo=False, target_options=options)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("targets")
    return {target: qdq_export(target, folder / f"tiny_{target}.onnx") for target in ("tensorrt", "onnxruntime")}


def test_tensorrt_refuses_an_onnxruntime_graph_before_looking_for_a_gpu(exported):
    message = r"tensorrt cannot run tiny_onnxruntime.onnx: it was exported for target 'onnxruntime': .*signed int8"
    with pytest.raises(QdqConfigError, match=message + r".*QuantConfig\(target='tensorrt'\)"):
        load_runtime(exported["onnxruntime"], "tensorrt")


def test_onnxruntime_counts_the_convs_a_tensorrt_graph_leaves_float(exported):
    with load_runtime(exported["tensorrt"], "onnxruntime", threads=1) as runtime:
        advice = runtime.advice
    n = rt_models.TinyCnn.n_convs
    assert advice is not None and advice.startswith(f"{n} of {n} Convs run in float on ONNX Runtime.")
    assert "exported for target 'tensorrt'" in advice and "QuantConfig(target='onnxruntime')" in advice
    with load_runtime(exported["onnxruntime"], "onnxruntime", threads=1) as runtime:
        assert runtime.advice is None


def test_qdq_bench_prints_the_advice(exported, capsys):
    assert main(["bench", str(exported["tensorrt"]), *FAST]) == 0
    assert "note: 4 of 4 Convs run in float on ONNX Runtime." in capsys.readouterr().out


def test_files_without_a_known_target_load_as_they_are(exported, fp32_onnx, tmp_path):
    with load_runtime(fp32_onnx, "onnxruntime", threads=1) as runtime:
        assert runtime.info.target is None and runtime.advice is None
    foreign = onnx.load(str(exported["onnxruntime"]))
    set_metadata(foreign, "qdq.target", "an_npu_registered_elsewhere")
    onnx.save(foreign, str(tmp_path / "npu.onnx"))
    with load_runtime(tmp_path / "npu.onnx", "onnxruntime", threads=1) as runtime:
        assert runtime.info.target == "an_npu_registered_elsewhere" and runtime.advice is None


@requires_openvino
@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
def test_openvino_runs_both_targets_graphs_with_int8_convolutions(exported, target):
    from qdq.runtime.openvino import precision_report

    with load_runtime(exported[target], "openvino", threads=1, uint8_weights=False) as runtime:
        assert runtime.advice is None
    # the weights as written (on a CPU whose int8 kernels saturate, qdq would run them in float by default, exactly)
    report = precision_report(exported[target], threads=1, uint8_weights=False)
    assert set(report.counts("Convolution")) <= {"u8", "i8"}

"""A runtime registered from outside qdq works end to end, as a user would add one, with nothing in qdq edited.

The stand-in runtime, ``ort_twin``, runs the ONNX file through ONNX Runtime under another name (its own
:class:`~qdq.runtime.Runtime` class on qdq's public session helpers) and declares its own int8 coverage: a weighted
op runs in int8 when every one of its inputs comes straight from a DequantizeLinear. A target made for it
(``twin_npu``: the tensorrt target's rules under another name) names it by its registered entry; a TinyCnn is
quantized for that target with its classifier kept float, exported, and then benchmarked (``qdq bench``), verified
(``qdq.verify``) and covered through the backend interface. TinyCnn has 4 convs and 1 Linear, each with an input
and a weight quantizer under the tensorrt rules: with the Linear's two turned off, 4 of 5 weighted ops run in int8.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import rt_models
import torch

import qdq
from qdq.cli import main
from qdq.errors import QdqConfigError
from qdq.export import export_onnx
from qdq.runtime import (
    Backend,
    Coverage,
    FloatLayer,
    Runtime,
    get_backend,
    load_runtime,
    read_model_info,
    register_runtime,
    unregister_runtime,
)
from qdq.runtime.ort import inference_session, session_options
from qdq.runtime.target_check import target_advice
from qdq.targets import RuntimeSupport, Target, get_target, register_target, unregister_target
from qdq.workflow.calibration import calibrate

FAST = ["--threads", "1", "--iters", "2", "--warmup", "1"]
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FLOAT_REASON = "an input is not dequantized: the twin runs it in float"


class TwinRuntime(Runtime):
    """ONNX Runtime's CPU session, under the name ``ort_twin``."""

    name = "ort_twin"

    @classmethod
    def load(cls, onnx_path: str | Path, *, threads: int | None = None, batch: int | None = None,
             **options: Any) -> TwinRuntime:  # fmt: skip
        info = read_model_info(onnx_path)
        runtime = cls(info, threads=threads, batch=batch)
        runtime.advice = target_advice(info, cls.name)  # what the file's target says about this runtime
        runtime.session = inference_session(info.path, session_options(threads=threads))
        return runtime

    @property
    def precision(self) -> str:
        return self.info.precision

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(self.session.run(None, feed))

    def _release(self) -> None:
        self.session = None


class TwinBackend(Backend):
    def __init__(self) -> None:
        super().__init__("ort_twin", TwinRuntime, package="onnxruntime", description="ONNX Runtime, renamed")

    def int8_coverage(self, onnx_path: str | Path, *, threads: int | None = None, **options: Any) -> Coverage:
        graph = onnx.load(str(onnx_path)).graph
        producer = {out: node.op_type for node in graph.node for out in node.output}
        ops = [node for node in graph.node if node.op_type in WEIGHTED]
        int8 = [n for n in ops if all(producer.get(name) == "DequantizeLinear" for name in n.input[:2])]
        floats = tuple(FloatLayer(n.name, n.op_type, FLOAT_REASON) for n in ops if n not in int8)
        return Coverage(self.name, Path(onnx_path).name, int8=len(int8), float_layers=floats)


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory):
    """The runtime, then a target naming it; a TinyCnn quantized for that target (classifier float) and its file."""
    entry = register_runtime(TwinBackend())
    target = dataclasses.replace(get_target("tensorrt"), name="twin_npu", description="a target made for ort_twin",
                                 runtimes=(RuntimeSupport(entry, "native"),))  # fmt: skip
    register_target(target)
    try:
        torch.manual_seed(0)
        model = qdq.quantize_model(rt_models.tiny_cnn(), qdq.QuantConfig(target="twin_npu"))
        for quantizer in model.fc.quantizers().values():
            quantizer.disable()
        batches = [torch.randn(4, *rt_models.INPUT_SHAPE) for _ in range(2)]
        calibrate(model, batches, method="max", progress=False)
        path = tmp_path_factory.mktemp("twin") / "tiny_twin.onnx"
        export_onnx(model, batches[0][:1], path, dynamo=False)
        yield model, path, batches
    finally:
        unregister_target("twin_npu")
        unregister_runtime("ort_twin")


def test_the_file_records_the_target_and_runs_natively_on_the_twin(twin):
    _, path, _ = twin
    with load_runtime(path, "ort_twin", threads=1) as runtime:
        assert runtime.info.target == "twin_npu" and runtime.advice is None  # "native": nothing to say
        assert runtime.run(np.zeros((2, *rt_models.INPUT_SHAPE), np.float32))[0].shape == (2, 10)


def test_coverage_through_the_backend_interface(twin):
    _, path, _ = twin
    found = get_backend("ort_twin").int8_coverage(path)
    assert (found.int8, found.n_float, found.total) == (rt_models.TinyCnn.n_convs, 1, rt_models.TinyCnn.n_convs + 1)
    assert [layer.op_type for layer in found.float_layers] == ["Gemm"] and found.reason == FLOAT_REASON


def test_qdq_bench_takes_the_twin(twin, capsys):
    _, path, _ = twin
    assert main(["bench", str(path), "--runtime", "ort_twin", *FAST]) == 0
    out = capsys.readouterr().out
    assert "| ort_twin |" in out  # the table's backend column
    assert "int8 coverage of tiny_twin.onnx on ort_twin: 4 of 5 weighted layers on int8 kernels; 1 float" in out


def test_qdq_verify_passes_on_the_twin(twin):
    model, path, batches = twin
    result = qdq.verify(model, path, batches, "ort_twin", threads=1)
    assert result.runtime == "ort_twin" and result.ok(), result


def test_the_twin_has_no_rules_for_qdq_check(twin, capsys):
    _, path, _ = twin
    assert main(["check", str(path), "--runtime", "ort_twin"]) == 2
    assert "knows the rules of the runtimes ['tensorrt'], not 'ort_twin'" in capsys.readouterr().err


def test_a_runtime_unregistered_since_cannot_be_named():
    entry = register_runtime("ort_triplet", "npu_sdk.runtime:NpuRuntime")  # a plain backend, never opened here
    support = RuntimeSupport(entry, "native")
    unregister_runtime("ort_triplet")
    with pytest.raises(QdqConfigError, match="'late' names runtime 'ort_triplet', which is no longer registered"):
        Target("late", runtimes=(support,))
    with pytest.raises(QdqConfigError, match="'ort_triplet', which is not registered"):
        RuntimeSupport("ort_triplet", "native")

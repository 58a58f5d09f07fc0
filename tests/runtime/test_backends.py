"""One backend per runtime: the registry, the int8 coverage each built-in backend reports, counted by hand on small
graphs, and what the CLI and the application ask a backend instead of comparing runtime names.

The graphs are written node by node here, so each count follows from the graph alone:

* ONNX Runtime (``ort_graph``): three Convs with uint8 activations and int8 weights. A has its input and weight
  dequantized and its output quantized: ``QLinearConv``. B's output is clamped to 16 levels before its Q (a 4-bit
  activation): float, no int4 kernel. C's output has no Q: float. 1 of 3 in int8.
* TensorRT (``trt_graph``): a Conv with both inputs dequantized (int8), a Conv whose weight alone is dequantized
  (float, TensorRT's ``weighted-op-inputs`` rule), and a MatMul with no Q/DQ at all (float). 1 of 3 in int8.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from backends import requires_openvino
from onnx import TensorProto, helper, numpy_helper

import qdq
from qdq.app.engines import coverage
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.runtime import Backend, Coverage, FloatLayer, backends, get_backend, runtime_names
from qdq.runtime.openvino import REENCODED_REASON
from qdq.runtime.tensorrt import UNQUANTIZED_REASON
from qdq.runtime_registry import OPENVINO_RUNTIME, ORT_RUNTIME, TENSORRT_RUNTIME, runtime_entry
from qdq.targets import RuntimeSupport, get_target

STEP = 0.1  # the activation step of every Q/DQ pair in the graphs below


def _const(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _weight(name: str, channels: int, seed: int) -> list[onnx.TensorProto]:
    """An int8 1x1 conv weight (integers in [-20, 20]: no CPU saturates on them) and its DQ's scale and zero point."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-20, 21, size=(channels, channels, 1, 1)).astype(np.int8)
    return [_const(name, values), _const(f"{name}_s", np.float32(0.01)), _const(f"{name}_z", np.int8(0))]


def ort_graph(path: Path) -> Path:
    """x -> Q/DQ -> Conv A -> Q/DQ -> Conv B -> Max/Min (4 bits) -> Q/DQ -> Conv C -> y; uint8 activations."""
    c = 4
    inits = [_const("s", np.float32(STEP)), _const("z", np.uint8(128)),
             _const("lo", np.float32(-8 * STEP)), _const("hi", np.float32(7 * STEP))]  # fmt: skip
    nodes = []
    for conv in "ABC":
        inits += _weight(f"w{conv}", c, seed=ord(conv))
        nodes.append(helper.make_node("DequantizeLinear", [f"w{conv}", f"w{conv}_s", f"w{conv}_z"], [f"w{conv}_f"]))
    nodes += [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"], name="Q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_dq"], name="DQ_in"),
        helper.make_node("Conv", ["x_dq", "wA_f"], ["a"], name="conv_A"),
        helper.make_node("QuantizeLinear", ["a", "s", "z"], ["a_q"], name="Q_a"),
        helper.make_node("DequantizeLinear", ["a_q", "s", "z"], ["a_dq"], name="DQ_a"),
        helper.make_node("Conv", ["a_dq", "wB_f"], ["b"], name="conv_B"),
        helper.make_node("Max", ["b", "lo"], ["b_lo"], name="clamp_low"),
        helper.make_node("Min", ["b_lo", "hi"], ["b_hi"], name="clamp_high"),
        helper.make_node("QuantizeLinear", ["b_hi", "s", "z"], ["b_q"], name="Q_b"),
        helper.make_node("DequantizeLinear", ["b_q", "s", "z"], ["b_dq"], name="DQ_b"),
        helper.make_node("Conv", ["b_dq", "wC_f"], ["y"], name="conv_C"),
    ]
    return _save(nodes, inits, c, path)


def trt_graph(path: Path) -> Path:
    """x -> Q/DQ -> Conv A (weight DQ) -> Conv B (weight DQ, input float) -> MatMul (float weight) -> y; int8."""
    c = 4
    inits = [_const("s", np.float32(STEP)), _const("z", np.int8(0)), _const("m", np.eye(8, dtype=np.float32))]
    inits += _weight("wA", c, seed=1) + _weight("wB", c, seed=2)
    nodes = [
        helper.make_node("DequantizeLinear", ["wA", "wA_s", "wA_z"], ["wA_f"], name="DQ_wA"),
        helper.make_node("DequantizeLinear", ["wB", "wB_s", "wB_z"], ["wB_f"], name="DQ_wB"),
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"], name="Q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_dq"], name="DQ_in"),
        helper.make_node("Conv", ["x_dq", "wA_f"], ["a"], name="conv_A"),
        helper.make_node("Conv", ["a", "wB_f"], ["b"], name="conv_B"),
        helper.make_node("MatMul", ["b", "m"], ["y"], name="matmul_C"),
    ]
    return _save(nodes, inits, c, path)


def _save(nodes: list, inits: list, channels: int, path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 8, 8])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_every_registered_runtime_has_its_backend():
    assert runtime_names() == ["onnxruntime", "openvino", "tensorrt"]
    assert [b.name for b in backends()] == runtime_names()
    assert get_backend("ov") is get_backend(OPENVINO_RUNTIME) is get_backend("openvino")
    assert get_backend("onnxruntime").available()  # a dependency of qdq
    assert "pip install tensorrt" in get_backend("trt").install
    with pytest.raises(QdqConfigError, match=r"Unknown runtime 'openvno'.*Did you mean 'openvino'\?"):
        get_backend("openvno")


def test_onnxruntime_coverage_counted_by_hand(tmp_path):
    found = get_backend(ORT_RUNTIME).int8_coverage(ort_graph(tmp_path / "ort.onnx"), threads=1)
    assert (found.runtime, found.int8, found.n_float, found.total) == ("onnxruntime", 1, 2, 3)
    reasons = {layer.name: layer.reason for layer in found.float_layers}
    assert reasons == {
        "conv_B": "ONNX Runtime has no int4 kernel (its output is clamped to 4 bits before its Q)",
        "conv_C": "no QuantizeLinear on its output",
    }
    assert found.summary().startswith("onnxruntime: 1 of 3 weighted layers on int8 kernels; 2 float: ")


def test_tensorrt_coverage_counted_by_hand_without_a_gpu(tmp_path):
    found = get_backend(TENSORRT_RUNTIME).int8_coverage(trt_graph(tmp_path / "trt.onnx"))
    assert (found.int8, found.n_float) == (1, 2)
    reasons = {layer.name: (layer.op_type, layer.reason) for layer in found.float_layers}
    assert reasons["matmul_C"] == ("MatMul", UNQUANTIZED_REASON)
    assert reasons["conv_B"][0] == "Conv" and "input 0 ('a') is float while the other is dequantized" in reasons[
        "conv_B"][1]  # fmt: skip


@requires_openvino
def test_openvino_coverage_of_a_tensorrt_style_graph(trt_onnx):
    """TinyCnn's 4 convs carry int8 Q/DQ, its Linear none: 4 of 5 compute layers in u8 when the int8 weights are
    kept, none when they are re-encoded as uint8 (what a CPU without VNNI needs), each then saying why."""
    backend = get_backend("openvino")
    kept = backend.int8_coverage(trt_onnx, threads=1, uint8_weights=False)
    assert (kept.int8, kept.n_float) == (4, 1)
    reencoded = backend.int8_coverage(trt_onnx, threads=1, uint8_weights=True)
    assert (reencoded.int8, reencoded.n_float) == (0, 5)
    assert reencoded.reasons() == {REENCODED_REASON: 5}


def test_coverage_record_of_the_application(tmp_path):
    """What the application keeps per engine (and the demo's footnote reads): the counts and the main reason (two
    reasons, one layer each: the first in graph order, conv_B's)."""
    record = coverage("onnxruntime", ort_graph(tmp_path / "ort.onnx"), 1)
    assert (record["int8_layers"], record["float_layers"]) == (1, 2)
    assert record["fallback"].startswith("ONNX Runtime has no int4 kernel")
    assert record["float_between_what"] == "QuantizeLinear/DequantizeLinear conversions left between the kernels"


def test_coverage_summary_and_table():
    floats = (FloatLayer("a", "Conv", "why 1"), FloatLayer("b", "Conv", "why 2"), FloatLayer("c", "Gemm", "why 2"))
    found = Coverage("r", "m.onnx", int8=7, float_layers=floats)
    assert found.total == 10 and found.reason == "why 2" and found.reasons() == {"why 2": 2, "why 1": 1}
    assert found.summary() == "r: 7 of 10 weighted layers on int8 kernels; 3 float: why 2 (and 1 other reason)"
    rows = [" ".join(line.split()) for line in found.to_markdown().splitlines()]
    assert "| why 2 | 2 | b, c |" in rows and "| why 1 | 1 | a |" in rows
    assert found.to_dict()["fallback"] == "why 2"
    assert Coverage("r", "m.onnx", int8=3).to_dict() == {"int8_layers": 3, "float_layers": 0, "float_between": None,
                                                          "float_between_what": None, "fallback": None}  # fmt: skip


def test_what_the_cli_and_the_application_ask_a_backend():
    ov, ort, trt = get_backend("openvino"), get_backend("onnxruntime"), get_backend("tensorrt")
    assert ov.divergence_cause("Add") is not None and ort.divergence_cause("Add") is None
    assert "f32" in ov.precisions and ort.precisions == ()
    with pytest.raises(QdqConfigError, match="takes no precision option"):
        ort.check_precision("bf16")
    assert ort.reference_variants() == ({},)
    assert ort.rule_check is None and ov.rule_check is None
    assert trt.rule_check is get_target("tensorrt").rule_check  # the rules of the target made for TensorRT


def test_a_plain_backend_needs_a_runtime_class():
    with pytest.raises(QdqTypeError, match="Runtime subclass"):
        Backend("npu", object)  # type: ignore[arg-type]
    assert Backend("npu", "some.module:NpuRuntime").int8_coverage("m.onnx") is None


def test_a_target_names_only_registered_runtimes():
    with pytest.raises(QdqConfigError) as info:
        RuntimeSupport("openvno", "native")
    message = str(info.value)
    assert "'openvno', which is not registered" in message and "Did you mean 'openvino'?" in message
    assert "register_runtime" in message
    assert RuntimeSupport("ort", "native").runtime == "onnxruntime"  # an alias names the registered runtime
    assert RuntimeSupport(OPENVINO_RUNTIME, "native").entry is runtime_entry("openvino")


def _compared_names(path: Path, names: set[str]) -> list[str]:
    """``file:line`` of each comparison (``==``, ``!=``, ``in``, ``not in``) with a string constant in ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            if any(isinstance(x, ast.Constant) and x.value in names for x in items):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_cli_and_the_application_compare_no_runtime_name():
    """They ask the backend (its coverage, options, known causes) instead (a name as a registry key is fine)."""
    names = {n for name in runtime_names() for n in (name, *runtime_entry(name).aliases)}
    package = Path(qdq.__file__).parent
    files = [package / "cli.py", *sorted((package / "app").rglob("*.py"))]
    assert [hit for path in files for hit in _compared_names(path, names)] == []

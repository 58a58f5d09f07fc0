"""The output-tail rule: what a model computes after its last weighted ops, on the way to its outputs, stays float.

The family: a detector head (two convs, a score sigmoid, a box decode against constant anchors, the concatenation
of boxes with scores), written once as a hand-built view (what any front end gives) and once as a PyTorch module
through both doors (``quantize_model`` + ``export_onnx`` and an FP32 export + ``quantize_onnx``).
"""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from torch import nn

import qdq
from onnx_models import batches, export
from qdq.graphs.view import GraphView
from qdq.targets import get_target

TARGETS = ["onnxruntime", "tensorrt"]


def _detector_view(target: str) -> GraphView:
    """x -> conv -> relu -> {box conv + offset conv -> decode (Mul anchors, Add grid), score conv -> sigmoid}
    -> concat -> out."""
    view = GraphView("test", get_target(target))
    for name, op_type, inputs in [
        ("conv", "Conv", ["x", "w:a"]), ("relu", "Relu", ["conv"]), ("box", "Conv", ["relu", "w:b"]),
        ("offset", "Conv", ["relu", "w:o"]), ("sum", "Add", ["box", "offset"]), ("scale", "Mul", ["sum", "c:anchors"]),
        ("shift", "Add", ["scale", "c:grid"]),
        ("cls", "Conv", ["relu", "w:c"]), ("sigmoid", "Sigmoid", ["cls"]), ("cat", "Concat", ["shift", "sigmoid"]),
    ]:  # fmt: skip
        values = [view.value(i[2:], constant=True) if i[:2] in ("w:", "c:") else view.value(i) for i in inputs]
        weights = [i for i, n in enumerate(inputs) if n.startswith("w:")]
        view.add_op(name, op_type, values, [view.value(name)], weights=weights)
    view.values["cat"].graph_output = True
    for op in view.ops_of("Conv"):  # what module replacement / select_weighted quantize (weights aside)
        view.quantize_input(op, 0, "test")
    return view


@pytest.mark.parametrize("target", TARGETS)
def test_the_tail_of_a_detector_head_is_what_follows_its_last_convs(target):
    view = _detector_view(target)
    assert [op.name for op in view.ops if view.in_output_tail(op)] == ["sum", "scale", "shift", "sigmoid", "cat"]
    view.whole_model = False  # a submodule traced alone: its outputs feed code the view cannot see
    assert not any(view.in_output_tail(op) for op in view.ops)


@pytest.mark.parametrize("target", TARGETS)
def test_every_rule_then_the_tail_leaves_the_head_arithmetic_float_and_the_convs_int8(target):
    view = _detector_view(target)
    for rule in get_target(target).placement_rules:
        rule.decide(view)
    for name in ("sum", "scale", "shift", "sigmoid", "cat"):
        op = view.op(name)
        assert not any(view.quantizer_at(op, i) for i in range(len(op.inputs))), name  # no quantizer of its own
        assert view.output_quantizer(op.outputs[0]) is None, name
    for name in ("conv", "box", "offset", "cls"):
        assert view.reads_quantized(view.op(name), 0), name


class Head(nn.Module):
    """The family as a PyTorch module: boxes (the sum of two convs, an add the residual rule would quantize)
    decoded against anchors, scores through a sigmoid, one concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.box, self.offset, self.cls = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1), nn.Conv2d(8, 2, 1)
        self.register_buffer("anchors", torch.linspace(4, 64, 4).view(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x)
        boxes = (self.box(features) + self.offset(features)) * self.anchors + 8.0
        return torch.cat([boxes, torch.sigmoid(self.cls(features))], 1)


def _quantized_producers(path) -> set[str]:
    """The op types whose outputs the file quantizes (``"input"``: a graph input)."""
    graph = onnx.load(str(path)).graph
    producer = {output: node.op_type for node in graph.node for output in node.output}
    return {producer.get(node.input[0], "input") for node in graph.node if node.op_type == "QuantizeLinear"}


@pytest.mark.parametrize("target", TARGETS)
def test_both_doors_leave_the_decode_sigmoid_and_concatenation_float(tmp_path, target):
    torch.manual_seed(0)
    head, example, data = Head().eval(), torch.randn(2, 3, 8, 8), batches((2, 3, 8, 8))
    float_path = export(copy.deepcopy(head), example, tmp_path / "head.onnx")
    result = qdq.quantize_onnx(float_path, data, tmp_path / "onnx_door.onnx", target=target, progress=False,
                               method="max")  # fmt: skip
    model = qdq.quantize_model(head, qdq.QuantConfig(target=target))
    qdq.calibrate(model, [torch.from_numpy(b["images"]) for b in data], method="max", progress=False)
    torch_path = qdq.export_onnx(model, example, tmp_path / "torch_door.onnx")
    for path in (result.path, torch_path):
        # the input, the stem's ReLU (read by the head convs) and, for ONNX Runtime, the head convs' own outputs
        # (what makes them QLinearConv); nothing the decode, the sigmoid or the concatenation computes
        expected = {"input", "Relu"} | ({"Conv"} if target == "onnxruntime" else set())
        assert _quantized_producers(path) == expected, path

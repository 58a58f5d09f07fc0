"""The PyTorch front end's edits (``qdq.graphs.fx_edit``) for decisions the built-in rules do not make."""

from __future__ import annotations

import torch
from torch import fx, nn

import qdq
from qdq.placement import register_placement_rule, unregister_placement_rule
from qdq.quantizer import TensorQuantizer


class TwoReaders(nn.Module):
    """The model input read by a ReLU and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + self.fc(x)


def test_a_rule_may_quantize_a_model_input_for_every_reader():
    """A value with no producer (the model input) quantized for every reader: one quantizer right after the
    placeholder, which both readers read (it raised AttributeError: the input has no producing op)."""

    def quantize_inputs(view):
        for value in [v for op in view.ops for v in op.inputs if v.producer is None and not v.constant]:
            view.quantize_output(value, "the model input in int8", stem="model_input_quantizer")

    register_placement_rule("test_model_input", quantize_inputs, targets=("tensorrt",))
    try:
        torch.manual_seed(0)
        placed = qdq.quantize_model(TwoReaders(), qdq.QuantConfig(target="tensorrt"))
    finally:
        unregister_placement_rule("test_model_input")
    assert isinstance(placed, fx.GraphModule)
    assert isinstance(placed.model_input_quantizer, TensorQuantizer)
    nodes = list(placed.graph.nodes)
    assert nodes[0].op == "placeholder"
    assert nodes[1].op == "call_module" and nodes[1].target == "model_input_quantizer"
    assert {user.name for user in nodes[1].users} >= {"relu", "fc"}
    placed(torch.randn(2, 4))

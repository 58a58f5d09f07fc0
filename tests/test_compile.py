"""torch.compile on quantized models: no graph breaks (dynamo), and a compiled QAT step equals eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import qdq


def _quantized(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    desc = {
        "static": None,
        "unsigned": qdq.QuantDescriptor(unsigned=True, amax=3.0),
        "learned": qdq.QuantDescriptor(learn_amax=True, amax=2.0),
        "4bit": qdq.QuantDescriptor(num_bits=4, amax=3.0),
    }[kind]
    model = qdq.quantize_model(torchvision.models.resnet18(num_classes=10), qdq.QuantConfig(quant_desc_input=desc))
    if kind == "static":
        for quantizer in model.modules():
            if isinstance(quantizer, qdq.TensorQuantizer):
                quantizer.amax = torch.tensor(3.0) if quantizer.axis is None else torch.rand(1) + 0.5
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["static", "unsigned", "learned", "4bit", "dynamic"])
@pytest.mark.parametrize("train", [True, False])
def test_dynamo_traces_without_graph_breaks(kind, train):
    model = qdq.quantize_model(torchvision.models.resnet18(num_classes=10)) if kind == "dynamic" else _quantized(kind)
    model.train(train)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_qat_step_equals_eager():
    eager = _quantized("static")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = []
    for model, run in ((eager, eager), (compiled_model, compiled)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for _ in range(2):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(run(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters()):
        assert torch.equal(a, b), name
    torch._dynamo.reset()

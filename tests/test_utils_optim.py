"""Seed utilities: reduce_amax against numpy, optimizer helpers on resnet18."""

import numpy as np
import pytest
import torch
import torchvision

import qdq
from qdq.errors import QdqConfigError
from qdq.optim import freeze_parameters, group_parameters, match_parameters, quant_weight_inplace
from qdq.utils import reduce_amax


@pytest.mark.parametrize("axis", [None, 1, (1, 2, 3), (0, 2, 3), (0, 3), (0, 1, 3, 4)])
def test_reduce_amax_matches_numpy(axis):
    x = torch.randn(3, 4, 5, 6, 2)
    expected = np.max(np.abs(x.numpy()), axis=axis, keepdims=True)
    np.testing.assert_array_equal(reduce_amax(x, axis).numpy(), expected)


def test_reduce_amax_too_many_axes():
    with pytest.raises(QdqConfigError):
        reduce_amax(torch.randn(2, 2), axis=(0, 1, 2))


def test_parameter_helpers_on_resnet18():
    model = torchvision.models.resnet18()
    assert len(list(match_parameters(model, ["downsample.0.weight"]))) == 3
    assert len(list(match_parameters(model, ["conv1", "downsample"]))) == 18
    assert len(list(match_parameters(model, ["downsample.*.weight$"]))) == 6
    groups = group_parameters(model, [["conv1"], ["fc"]], lrs=[0.1, 0.2], momentums=[0.9, 0.8])
    assert [len(g["params"]) for g in groups] == [9, 2] and groups[1]["lr"] == 0.2
    with pytest.raises(QdqConfigError):
        group_parameters(model, [["conv1"]], lrs=[0.1, 0.2])
    freeze_parameters(model, ["fc"])
    assert not model.fc.weight.requires_grad and model.conv1.weight.requires_grad


def test_quant_weight_inplace_puts_weights_on_grid():
    model = qdq.quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 4)))
    quant_weight_inplace(model)
    w = model[0].weight.detach()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.allclose(w / step, torch.round(w / step), atol=1e-4)

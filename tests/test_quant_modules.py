"""The seed's monkey patch: opt-in, idempotent, reversible, a context manager."""

import pytest
import torch
from torch import nn

from qdq import nn as quant_nn
from qdq import quant_modules
from qdq.errors import QdqConfigError, QdqTypeError

ORIGINAL_CONV, ORIGINAL_LINEAR = nn.Conv2d, nn.Linear


@pytest.fixture(autouse=True)
def _always_restore():
    yield
    quant_modules.deactivate()
    assert nn.Conv2d is ORIGINAL_CONV and nn.Linear is ORIGINAL_LINEAR


def test_import_patches_nothing():
    assert not quant_modules.is_active() and torch.nn.Conv2d is ORIGINAL_CONV


def test_initialize_and_deactivate():
    quant_modules.initialize()
    assert torch.nn.Conv2d is quant_nn.QuantConv2d and isinstance(nn.Conv2d(1, 1, 1), quant_nn.QuantConv2d)
    quant_modules.deactivate()
    assert torch.nn.Conv2d is ORIGINAL_CONV


def test_initialize_twice_is_idempotent():
    quant_modules.initialize()
    quant_modules.initialize()
    quant_modules.deactivate()
    assert torch.nn.Conv2d is ORIGINAL_CONV  # the seed recorded the patched class as "original" here
    quant_modules.deactivate()


def test_context_manager():
    with quant_modules.initialize():
        layer = nn.Linear(2, 2)
    assert isinstance(layer, quant_nn.QuantLinear) and torch.nn.Linear is ORIGINAL_LINEAR


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError), quant_modules.initialize():
        raise RuntimeError("boom")
    assert torch.nn.Conv2d is ORIGINAL_CONV


def test_float_module_list_and_custom_modules():
    class Namespace:
        Thing = nn.Identity

    with quant_modules.initialize(float_module_list=["Linear"], custom_quant_modules=[(Namespace, "Thing", nn.ReLU)]):
        assert torch.nn.Linear is ORIGINAL_LINEAR and Namespace.Thing is nn.ReLU
    assert Namespace.Thing is nn.Identity


def test_errors():
    with pytest.raises(QdqConfigError, match="not patched"):
        quant_modules.initialize(float_module_list=["Linaer"])
    with pytest.raises(QdqTypeError, match="tuples"):
        quant_modules.initialize(custom_quant_modules=[("x",)])

"""Front ends as registered objects (qdq.frontends): which one takes a model, what it feeds, and a new one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.frontends import FRONT_ENDS, FrontEnd, front_end_of, register_front_end
from qdq.targets import get_target


def test_the_built_in_front_ends_take_their_models_and_refuse_others():
    assert list(FRONT_ENDS)[:2] == ["torch", "keras"]
    assert front_end_of(nn.Linear(3, 2)).name == "torch"
    with pytest.raises(QdqConfigError, match="no front end takes a list"):
        front_end_of([1, 2])


def test_the_torch_front_end_exports_the_float_file_and_feeds_its_inputs_with_labels(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x, labels = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    torch_end = front_end_of(model)
    path = torch_end.export_float_onnx(model, x, tmp_path / "fp32.onnx", get_target("onnxruntime"))
    names = [i.name for i in onnx.load(str(path)).graph.input]
    feed = torch_end.feed((x, labels), model, names)
    assert list(feed) == [*names, "labels"] and np.array_equal(feed[names[0]], x.numpy())
    assert np.array_equal(feed["labels"], labels.numpy())


def test_a_registered_front_end_is_found_for_its_models(tmp_path):
    class Wrapped:  # a kind of model qdq does not know
        def __init__(self, module: nn.Module) -> None:
            self.module = module

    def export(model: Wrapped, batch, path: Path, target) -> Path:
        return front_end_of(model.module).export_float_onnx(model.module, batch, path, target)

    def feed(batch, model: Wrapped, names: list[str]) -> dict:
        return {names[0]: np.asarray(batch, np.float32)}

    register_front_end(FrontEnd("wrapped", lambda m: isinstance(m, Wrapped), export, feed))
    try:
        wrapped = Wrapped(nn.Linear(4, 2).eval())
        assert front_end_of(wrapped).name == "wrapped"
        with pytest.raises(QdqConfigError, match="already registered"):
            register_front_end(FrontEnd("wrapped", lambda m: False, export, feed))
    finally:
        FRONT_ENDS.unregister("wrapped")

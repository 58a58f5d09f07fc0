"""Marks sit on the parts a front end lists (``MARK_PARTS``), whatever the kind of model."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from qdq.errors import QdqConfigError
from qdq.targets.marks import (
    MARK_PARTS,
    check_not_superseded,
    mark_placed,
    mark_superseded,
    placed_options,
    placed_target,
)


class _Block:
    """A model of a kind no built-in front end knows: its parts are ``pieces``."""

    def __init__(self, pieces: list[Any]) -> None:
        self.pieces = pieces


class _Piece:
    pass


@pytest.fixture
def blocks():
    MARK_PARTS.register("blocks", lambda model: list(model.pieces) if isinstance(model, _Block) else None)
    yield
    MARK_PARTS.unregister("blocks")


def test_a_registered_kind_is_read_through_its_parts(blocks):
    piece = _Piece()
    model = _Block([_Piece(), piece])
    assert placed_target(model) is None
    mark_placed(piece, "onnxruntime", {"weights": "int8"})
    assert placed_target(model) == "onnxruntime"
    assert placed_options(model) == {"weights": "int8"}


def test_an_unknown_kind_has_no_parts():
    model = _Block([_Piece()])
    mark_placed(model.pieces[0], "tensorrt")
    assert placed_target(model) is None  # nothing lists its parts: only its own mark counts
    mark_placed(model, "tensorrt")
    assert placed_target(model) == "tensorrt"


def test_torch_submodules_carry_marks():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    mark_placed(model[0], "tensorrt")
    assert placed_target(model) == "tensorrt"
    mark_superseded(model, "tensorrt")
    with pytest.raises(QdqConfigError, match="placed for target 'tensorrt'"):
        check_not_superseded(model)

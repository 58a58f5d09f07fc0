"""A model in eval mode for a block, each submodule's own mode restored after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` (and every submodule) in eval mode inside the block; after it, each module's own ``training``
    flag as it was.

    ``model.train(was_training)`` would set every submodule to the root's flag: a model kept in eval under a wrapper
    left in training mode (a user's ``nn.Module`` holding a detector, a frozen backbone) would come back training,
    its BatchNorms then updating their running statistics and its detection heads asking for targets."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training

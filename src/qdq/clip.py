"""Learnable clipping (PACT-style), used by quantizers built with ``learn_amax=True`` (seed: ``quant_nn.Clip``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qdq.errors import QdqConfigError

__all__ = ["Clip", "ClipFunction", "clip"]


class ClipFunction(torch.autograd.Function):
    """``clamp(x, min, max)`` with gradients for the bounds.

    The input gradient passes where ``min < x < max``; the gradient of ``max`` is the sum of the upstream
    gradient where ``x >= max``, and of ``min`` where ``x <= min`` (PACT, Choi et al. 2018).
    """

    @staticmethod
    def forward(
        ctx: Any, inputs: torch.Tensor, clip_value_min: torch.Tensor, clip_value_max: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inputs, clip_value_min, clip_value_max)
        return torch.max(torch.min(inputs, clip_value_max), clip_value_min)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        inputs, lo, hi = ctx.saved_tensors
        below, above = inputs <= lo, inputs >= hi
        grad_input = grad_output.masked_fill(below | above, 0.0)
        grad_min = _reduce_to(grad_output.masked_fill(~below, 0.0), lo) if ctx.needs_input_grad[1] else None
        grad_max = _reduce_to(grad_output.masked_fill(~above, 0.0), hi) if ctx.needs_input_grad[2] else None
        return grad_input, grad_min, grad_max


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``grad`` down to the broadcast shape of ``like``."""
    if like.numel() == 1:
        return grad.sum().reshape(like.shape)
    lead = grad.dim() - like.dim()
    dims = list(range(lead)) + [lead + i for i, s in enumerate(like.shape) if s == 1]
    return grad.sum(dim=dims, keepdim=True).reshape(like.shape)


def clip(inputs: torch.Tensor, clip_value_min: torch.Tensor, clip_value_max: torch.Tensor) -> torch.Tensor:
    """Broadcastable clamp with PACT gradients for ``clip_value_min`` and ``clip_value_max``."""
    lo = torch.as_tensor(clip_value_min, dtype=inputs.dtype, device=inputs.device)
    hi = torch.as_tensor(clip_value_max, dtype=inputs.dtype, device=inputs.device)
    return ClipFunction.apply(inputs, lo, hi)


class Clip(nn.Module):
    """Clamp to ``[clip_value_min, clip_value_max]``; either bound can be a learned scalar parameter."""

    clip_value_min: torch.Tensor  # a Parameter or a buffer, set in __init__
    clip_value_max: torch.Tensor

    def __init__(
        self,
        clip_value_min: float | torch.Tensor,
        clip_value_max: float | torch.Tensor,
        learn_min: bool = False,
        learn_max: bool = False,
    ) -> None:
        super().__init__()
        lo = torch.as_tensor(clip_value_min, dtype=torch.float32)
        hi = torch.as_tensor(clip_value_max, dtype=torch.float32)
        for name, value, learn in (("clip_value_min", lo, learn_min), ("clip_value_max", hi, learn_max)):
            if learn and value.numel() != 1:
                raise QdqConfigError(f"a learnable {name} must be a scalar, got shape {tuple(value.shape)}.")
            if learn:
                setattr(self, name, nn.Parameter(value.clone().reshape(())))
            else:
                self.register_buffer(name, value.clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return clip(inputs, self.clip_value_min, self.clip_value_max)

    def extra_repr(self) -> str:
        lo, hi = self.clip_value_min, self.clip_value_max
        return f"min={lo.detach().flatten()[:4].tolist()}, max={hi.detach().flatten()[:4].tolist()}"

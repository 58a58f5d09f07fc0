"""Thin wrappers over ``torch.distributed`` used by :meth:`Calibrator.sync`.

Collectives run on the device the backend needs (CUDA for NCCL, CPU otherwise); tensors are moved
there and back, so calibrator state may live on any device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_object", "all_reduce", "is_initialized"]


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _comm_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Gather one picklable object from every rank of ``group`` (in rank order)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce(tensor: torch.Tensor, op: str, group: Any = None) -> torch.Tensor:
    """Return the all-reduction of ``tensor`` (``op`` is ``"sum"`` or ``"max"``) on ``tensor``'s device."""
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    buf = tensor.detach().to(_comm_device(group), copy=True).contiguous()
    dist.all_reduce(buf, op=reduce_op, group=group)
    return buf.to(tensor.device)

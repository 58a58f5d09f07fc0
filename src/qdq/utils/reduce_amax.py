"""``reduce_amax``: max of ``|x|`` over the given axes (note: axes **reduced**, unlike descriptor ``axis``)."""

from __future__ import annotations

import torch

from qdq.errors import QdqConfigError

__all__ = ["reduce_amax"]


def reduce_amax(input: torch.Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = True) -> torch.Tensor:
    """Max of ``|input|`` over ``axis`` (all axes when None), without materialising ``|input|``.

    Args:
        axis: the axes to reduce (an int or a tuple); None reduces everything to a 0-d tensor.
        keepdims: keep reduced axes with size 1.
    """
    with torch.no_grad():
        if axis is None:
            lo, hi = torch.aminmax(input)
            return torch.maximum(-lo, hi)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        if len(axes) > input.dim():
            raise QdqConfigError(f"cannot reduce {len(axes)} axes of a {input.dim()}-d tensor.")
        dims = sorted({a % input.dim() for a in axes})
        return torch.maximum(-input.amin(dim=dims, keepdim=keepdims), input.amax(dim=dims, keepdim=keepdims))

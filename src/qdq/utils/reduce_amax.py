"""The max-magnitude reduction behind every range in qdq (dynamic ranges, calibrators, the seed's helper)."""

from __future__ import annotations

import torch

from qdq.errors import QdqConfigError

__all__ = ["amax_over", "min_max_over", "reduce_amax"]


def amax_over(x: torch.Tensor, keep: tuple[int, ...] | None, unsigned: bool = False) -> torch.Tensor:
    """Largest magnitude of ``x`` over every axis **not** in ``keep`` (kept axes stay, others become 1).

    ``keep=None`` reduces everything to a 0-d tensor. The magnitude is ``|x|``, or ``max(x, 0)`` when
    ``unsigned``. NaN in ``x`` gives NaN in the result, and so do infinities except ``-inf`` unsigned
    (use :func:`min_max_over` to see every non-finite value). Computed from ``min`` and ``max`` without
    materialising ``|x|``, and without reading anything back to the host.
    """
    lo, hi = min_max_over(x, keep)
    return hi.clamp(min=0) if unsigned else torch.maximum(-lo, hi)


def min_max_over(x: torch.Tensor, keep: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``x`` over every axis not in ``keep`` (keepdims; 0-d for ``keep=None``), one pass."""
    if keep is None:
        lo, hi = torch.aminmax(x)
    else:
        kept = {a % x.dim() for a in keep} if x.dim() else set()
        dims = [d for d in range(x.dim()) if d not in kept]
        if not dims:
            lo = hi = x
        elif kept == {0} and x.is_contiguous():  # one row per channel: a single fused pass
            lo, hi = torch.aminmax(x.reshape(x.shape[0], -1), dim=1)
            shape = [-1] + [1] * (x.dim() - 1)
            lo, hi = lo.view(shape), hi.view(shape)
        else:
            lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    return lo, hi


def reduce_amax(input: torch.Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = True) -> torch.Tensor:
    """The seed's helper: max of ``|input|`` over ``axis`` (the axes **reduced**; all when None).

    Args:
        axis: the axes to reduce (an int or a tuple); None reduces everything to a 0-d tensor.
        keepdims: keep reduced axes with size 1.
    """
    with torch.no_grad():
        if axis is None:
            return amax_over(input, None)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        if len(axes) > input.dim():
            raise QdqConfigError(f"cannot reduce {len(axes)} axes of a {input.dim()}-d tensor.")
        reduced = {a % input.dim() for a in axes}
        amax = amax_over(input, tuple(d for d in range(input.dim()) if d not in reduced))
        return amax if keepdims else amax.squeeze(tuple(sorted(reduced)))

"""Argument checks shared by every layer: bit widths, axes and ranges, with one meaning each.

* ``num_bits`` is an int in ``[2, 16]`` (numpy integers accepted, bools and floats refused).
* ``axis`` names the axes to **keep** (per-channel): ``None``, an int, or a sequence of distinct ints;
  an empty sequence keeps no axis and means per tensor, like ``None``.
* a range (``amax``, ``pre_quant_scale``) is float32, non-empty, finite and non-negative.

Each check raises one :class:`~qdq.errors.QdqTypeError` (wrong type) or
:class:`~qdq.errors.QdqConfigError` (wrong value) that says what was wrong and what to do.
Range checks read the values, so on an accelerator they wait for the device: call them where a range
is set or loaded, never per forward call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from qdq.errors import QdqConfigError, QdqTypeError

__all__ = ["MAX_BITS", "MIN_BITS", "check_axis", "check_num_bits", "check_range"]

MIN_BITS, MAX_BITS = 2, 16


def check_num_bits(num_bits: Any) -> int:
    """Return ``num_bits`` as an int in ``[MIN_BITS, MAX_BITS]``."""
    if isinstance(num_bits, bool | np.bool_) or not isinstance(num_bits, int | np.integer):
        raise QdqTypeError(
            f"num_bits must be an int between {MIN_BITS} and {MAX_BITS}, got {num_bits!r} "
            f"({type(num_bits).__name__}). qdq quantizes to integers; FP8 (num_bits=(4, 3)) is not supported."
        )
    if not MIN_BITS <= num_bits <= MAX_BITS:
        raise QdqConfigError(f"num_bits={num_bits} is not supported: qdq quantizes to {MIN_BITS}..{MAX_BITS} bits.")
    return int(num_bits)


def check_axis(axis: Any) -> tuple[int, ...] | None:
    """Return the kept axes as a tuple, or ``None`` per tensor (``None`` or an empty sequence)."""
    if axis is None:
        return None
    if isinstance(axis, int | np.integer) and not isinstance(axis, bool | np.bool_):
        return (int(axis),)
    if isinstance(axis, Sequence) and not isinstance(axis, str):
        items = list(axis)
        if all(isinstance(a, int | np.integer) and not isinstance(a, bool | np.bool_) for a in items):
            if len(set(items)) != len(items):
                raise QdqConfigError(f"axis {tuple(items)} repeats an axis; list each kept axis once.")
            return tuple(int(a) for a in items) or None
    raise QdqTypeError(f"axis must be None, an int or a tuple of ints (the axes to keep), got {axis!r}.")


def check_range(
    what: str, value: Any, device: torch.device | str | None = None, *, allow_empty: bool = False
) -> torch.Tensor:
    """Return ``value`` as a detached float32 tensor on ``device`` after checking its values.

    Args:
        what: the name used in error messages (``"amax"``, ``"pre_quant_scale"``).
        value: a number, a sequence, a numpy array or a tensor.
        device: where the result lives (default: the tensor's own device, else the CPU).
        allow_empty: accept an empty value (an unset range) instead of raising.
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to(device=device or value.device, dtype=torch.float32).clone()
    else:
        try:
            tensor = torch.tensor(np.asarray(value, dtype=np.float32), device=device)
        except (TypeError, ValueError) as err:
            raise QdqTypeError(f"{what} must be a number, a list or an array of numbers, got {value!r}.") from err
    if tensor.numel() == 0:
        if allow_empty:
            return tensor
        raise QdqConfigError(f"{what} is empty; set a number or a per-channel tensor, or None for a dynamic range.")
    if not bool(torch.isfinite(tensor).all()):
        raise QdqConfigError(
            f"{what} contains NaN or Inf ({tensor.flatten()[:8].tolist()}...); the calibration data or the "
            "stored range is corrupt."
        )
    if bool((tensor < 0).any()):
        raise QdqConfigError(f"{what} must be non-negative, got a minimum of {tensor.min().item():g}.")
    return tensor

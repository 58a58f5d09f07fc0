"""Max calibration: amax is the largest magnitude seen, per tensor or per kept channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qdq.errors import QdqTypeError

from . import distributed
from .base import Axis, Calibrator, CalibState, ChannelLayout

__all__ = ["MaxCalibrator"]


class MaxCalibrator(Calibrator):
    """Running maximum of ``|x|`` (signed) or ``max(x, 0)`` (unsigned).

    Args:
        num_bits: bit width of the target format (recorded; it does not change the max).
        axis: axes to keep; ``None`` gives a 0-d amax, ``0`` on ``(C, ...)`` gives ``(C, 1, ...)``.
        unsigned: take the max of ``max(x, 0)`` instead of ``|x|``.
        track_amax: also keep every batch's amax in :attr:`amaxs` (in collection order).

    Example:
        >>> cal = MaxCalibrator(axis=0)
        >>> cal.collect(torch.tensor([[1.0, -3.0], [0.5, 0.25]]))
        >>> cal.compute_amax().flatten().tolist()
        [3.0, 0.5]
    """

    methods = ("max",)

    def __init__(self, num_bits: int = 8, axis: Axis = None, unsigned: bool = False, track_amax: bool = False) -> None:
        super().__init__(num_bits, axis, unsigned)
        self._track_amax = bool(track_amax)

    @property
    def amaxs(self) -> list[torch.Tensor]:
        """Per-batch amax tensors (only with ``track_amax=True``), in collection order; synced ones in rank order."""
        state = self._state
        return [] if state is None else [a.clone() for a in state.amaxs]

    def compute_amax(self, method: str | None = None, **kwargs: Any) -> torch.Tensor | None:
        """Return the running max (float32, keepdims shape), or ``None`` if nothing was collected.

        Args:
            method: ``None`` or ``"max"`` (the only method of this calibrator).

        Raises:
            QdqConfigError: another method was asked for.
            QdqTypeError: an option was given (this calibrator has none).
        """
        self._check_method(method, "max")
        if kwargs:
            raise QdqTypeError(f"MaxCalibrator.compute_amax takes no options, got {sorted(kwargs)}.")
        state = self._state
        if state is None:
            return None
        self._check_finite()
        return state.amax.clone()

    def _config(self) -> tuple[Any, ...]:
        return (*super()._config(), self._track_amax)

    def _batch_state(self, x: torch.Tensor, layout: ChannelLayout, batch_max: torch.Tensor) -> _MaxState:
        return _MaxState(batch_max, [batch_max.clone()] if self._track_amax else [])

    def _empty_state(self, layout: ChannelLayout) -> _MaxState:
        return _MaxState(torch.zeros(layout.shape, dtype=torch.float32), [])  # 0 is neutral: magnitudes >= 0

    def _all_reduce(self, state: CalibState, group: Any) -> _MaxState:
        assert isinstance(state, _MaxState)
        amax = distributed.all_reduce(state.amax, "max", group)
        amaxs: list[torch.Tensor] = []
        if self._track_amax:
            gathered = distributed.all_gather_object([a.cpu() for a in state.amaxs], group)
            amaxs = [a.to(amax.device) for rank_list in gathered for a in rank_list]
        return _MaxState(amax, amaxs)


@dataclass
class _MaxState:
    """Running max of magnitudes (keepdims shape) and, with track_amax, every batch's max."""

    amax: torch.Tensor
    amaxs: list[torch.Tensor]

    def clone(self) -> _MaxState:
        return _MaxState(self.amax.clone(), [a.clone() for a in self.amaxs])

    def add(self, other: _MaxState) -> None:
        self.amax = torch.maximum(self.amax, other.amax.to(self.amax.device))
        self.amaxs.extend(a.clone() for a in other.amaxs)

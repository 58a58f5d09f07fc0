"""Common base of the calibrators: axis handling, input checks and the mergeable-state contract.

Conventions shared by every calibrator in :mod:`qdq.calib`:

* ``axis`` names the axes to **keep** (the seed's meaning): ``None`` is per tensor and gives a 0-d
  amax; ``0`` on a conv weight ``(C, K, R, S)`` gives one amax per output channel with the keepdims
  shape ``(C, 1, 1, 1)``. Negative axes are normalised against the tensor's rank.
* Statistics are taken on the **magnitude** of the data: ``|x|`` for signed quantizers and
  ``max(x, 0)`` for unsigned ones (an unsigned quantizer maps every negative value to 0, so only the
  positive part can set the range).
* Data is read as float32 (half and bfloat16 exactly; integers and float64 rounded); amax values are
  float32 tensors on the device of the statistics, in the units of the data.
* Empty tensors are ignored. NaN or Inf raise :class:`~qdq.errors.QdqCalibrationError` when the
  statistics are used (``compute_amax``, ``sync``), naming the first bad batch.
* ``collect`` never reads a device value on the host: on a GPU it only queues kernels, so calibration
  runs at the speed of the forward pass. That is why non-finite data is reported when the statistics
  are used rather than by ``collect`` itself.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError, did_you_mean
from qdq.utils.reduce_amax import min_max_over
from qdq.validate import check_axis, check_num_bits

from . import distributed

__all__ = ["Axis", "CalibState", "Calibrator", "ChannelLayout"]

Axis = int | tuple[int, ...] | None


@dataclass(frozen=True)
class ChannelLayout:
    """Where the channels of a tensor are, for one calibrator.

    Attributes:
        rank: rank of the tensors (``None`` per tensor, where any rank is accepted).
        keep: the normalised kept axes, sorted (empty per tensor).
        shape: the keepdims amax shape, e.g. ``(C, 1, 1, 1)``; ``()`` per tensor.
    """

    rank: int | None
    keep: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def num_channels(self) -> int:
        """Number of independent statistics (1 per tensor)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def reduce_dims(self, rank: int) -> tuple[int, ...]:
        """Dimensions reduced away for a tensor of ``rank``."""
        return tuple(d for d in range(rank) if d not in self.keep)


def resolve_layout(axis: tuple[int, ...] | None, shape: torch.Size) -> ChannelLayout:
    """Normalise ``axis`` against a tensor ``shape`` and build its :class:`ChannelLayout`."""
    if axis is None:
        return ChannelLayout(rank=None, keep=(), shape=())
    rank = len(shape)
    bad = [a for a in axis if not -rank <= a < rank]
    if bad:
        raise QdqConfigError(
            f"axis {axis} is out of range for a tensor of shape {tuple(shape)} (rank {rank}); "
            f"valid axes are {-rank}..{rank - 1}."
        )
    keep = tuple(sorted(a % rank for a in axis))
    if len(set(keep)) != len(keep):
        raise QdqConfigError(f"axis {axis} names the same dimension twice for rank {rank}.")
    return ChannelLayout(rank=rank, keep=keep, shape=tuple(shape[d] if d in keep else 1 for d in range(rank)))


def as_float32(x: Any, who: str) -> torch.Tensor:
    """Return ``x`` detached as float32, rejecting non-tensors and complex data."""
    if not isinstance(x, torch.Tensor):
        raise QdqTypeError(f"{who}.collect expects a torch.Tensor, got {type(x).__name__}.")
    if x.is_complex():
        raise QdqTypeError(f"{who}.collect got a complex tensor ({x.dtype}); quantization ranges need real data.")
    return x.detach().float()


def magnitude_max(x: torch.Tensor, layout: ChannelLayout, unsigned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest magnitude per channel (keepdims, float32; 0 where not finite), and whether all of ``x`` is finite.

    Both stay on the device. Unsigned magnitudes are ``max(x, 0)``, but a ``-inf`` still counts as non-finite.
    """
    lo, hi = min_max_over(x, layout.keep if layout.rank is not None else None)
    finite = torch.isfinite(lo).all() & torch.isfinite(hi).all()
    amax = hi.clamp(min=0) if unsigned else torch.maximum(-lo, hi)
    return amax.nan_to_num(nan=0.0, posinf=0.0), finite


class CalibState(Protocol):
    """Statistics of one calibrator, combinable exactly: ``a.add(b)`` is the state of both data sets."""

    def clone(self) -> Any: ...

    def add(self, other: Any) -> None: ...


class Calibrator(abc.ABC):
    """Collects statistics of the tensors a quantizer sees and turns them into an amax.

    Subclasses keep a *mergeable* state: :meth:`merge` and :meth:`sync` combine the statistics of
    calibrators with the same configuration so that the result is identical (bit for bit) to one
    calibrator having collected every batch.

    Each calibrator keeps its own (local) statistics, from :meth:`collect` and :meth:`merge`. :meth:`sync`
    all-reduces the local statistics of every rank into a separate synced state, which
    :meth:`compute_amax` then uses; syncing again reduces the local statistics again, so repeated calls
    never count data twice, and collecting after a sync makes the calibrator local until the next one.

    Args:
        num_bits: bit width of the target integer format, in [2, 16].
        axis: axes to keep (see the module docstring); ``None`` is per tensor.
        unsigned: whether the target format is unsigned (statistics of ``max(x, 0)``).
    """

    #: method names accepted by :meth:`compute_amax` (``None`` means the calibrator's default)
    methods: tuple[str, ...] = ()

    def __init__(self, num_bits: int = 8, axis: Axis = None, unsigned: bool = False) -> None:
        self._num_bits = check_num_bits(num_bits)
        self._axis = check_axis(axis)
        self._unsigned = bool(unsigned)
        self._layout: ChannelLayout | None = None
        self._local: Any = None  # CalibState of the data collected or merged here
        self._synced: Any = None  # CalibState all-reduced by the last sync(), until new local data
        self._batches = 0  # batches collected here
        self._first_bad: torch.Tensor | None = None  # device int64: first batch with NaN/Inf (1-based), or 0

    @property
    def num_bits(self) -> int:
        """Bit width of the target integer format."""
        return self._num_bits

    @property
    def axis(self) -> tuple[int, ...] | None:
        """Kept axes as given (not yet normalised), or ``None`` per tensor."""
        return self._axis

    @property
    def unsigned(self) -> bool:
        """Whether statistics are taken on ``max(x, 0)`` rather than ``|x|``."""
        return self._unsigned

    @property
    def has_data(self) -> bool:
        """Whether there are statistics to compute an amax from."""
        return self._state is not None

    @property
    def _state(self) -> Any:
        """The statistics :meth:`compute_amax` uses: the synced ones if current, else the local ones."""
        return self._synced if self._synced is not None else self._local

    def collect(self, x: torch.Tensor) -> None:
        """Add the statistics of tensor ``x``; empty tensors are ignored.

        Raises:
            QdqTypeError: ``x`` is not a real tensor.
            QdqConfigError: ``axis`` is out of range for ``x``.
            QdqCalibrationError: ``x`` contains NaN/Inf, or its channel shape differs from earlier batches.
        """
        x = as_float32(x, type(self).__name__)
        if x.numel() == 0:
            return
        layout = resolve_layout(self._axis, x.shape)
        self._check_same_layout(layout, x.shape)
        with torch.no_grad():
            batch_max, finite = magnitude_max(x, layout, self._unsigned)
            self._batches += 1
            self._note_finite(finite)
            batch = self._batch_state(x, layout, batch_max)
        self._add_local(batch)
        self._layout = layout

    def reset(self) -> None:
        """Forget every statistic, local and synced (a new channel shape is then accepted)."""
        self._layout = self._local = self._synced = None
        self._batches, self._first_bad = 0, None

    def _note_finite(self, finite: torch.Tensor) -> None:
        """Remember (on the device, without waiting for it) the first batch that was not all finite."""
        bad = ~finite
        first = self._first_bad
        if first is None:
            first = torch.zeros((), dtype=torch.int64, device=bad.device)
        self._first_bad = torch.where((first == 0) & bad, torch.full_like(first, self._batches), first)

    def _bad_batch(self) -> int:
        """1-based index of the first collected batch with NaN/Inf, or 0. Reads one value from the device."""
        return 0 if self._first_bad is None else int(self._first_bad)

    def _check_finite(self) -> None:
        """Raise if any collected data was NaN or Inf (called where the statistics are used)."""
        bad = self._bad_batch()
        if bad:
            raise QdqCalibrationError(_nonfinite_message(type(self).__name__, f"batch {bad} of {self._batches}"))

    def merge(self, other: Calibrator) -> None:
        """Add the local statistics of ``other`` (same class and configuration) to this calibrator's.

        Raises:
            QdqConfigError: ``other`` has another class or configuration, or is this calibrator.
            QdqCalibrationError: the two calibrators saw different channel shapes.
        """
        self._check_compatible(other)
        if other._local is None:
            return
        other_bad = other._bad_batch()
        if other_bad:
            raise QdqCalibrationError(
                _nonfinite_message(type(self).__name__, f"batch {other_bad} of the calibrator being merged")
            )
        if self._layout is not None and self._layout != other._layout:
            raise QdqCalibrationError(
                f"cannot merge {type(self).__name__}s with different channel shapes: "
                f"{self._layout.shape} and {other._layout.shape if other._layout else None}."
            )
        self._add_local(other._local.clone())
        self._layout = other._layout

    def sync(self, group: Any = None) -> None:
        """All-reduce the local statistics over ``group``; every rank then computes the same amax.

        A no-op unless ``torch.distributed`` is initialized. Every rank of the group must call it (it is
        a collective). Ranks that saw no data receive the others' statistics. Calling it again reduces
        the same local statistics again: data is never counted twice.

        Raises:
            QdqCalibrationError: the ranks disagree on configuration or channel shape (on every rank).
        """
        if not distributed.is_initialized():
            return
        mine = self._layout if self._local is not None else None
        metas = distributed.all_gather_object((type(self).__name__, self._config(), mine, self._bad_batch()), group)
        bad_ranks = [rank for rank, m in enumerate(metas) if m[3]]
        if bad_ranks:  # raised on every rank, so none is left waiting in a collective
            where = ", ".join(f"rank {r} batch {metas[r][3]}" for r in bad_ranks)
            raise QdqCalibrationError(_nonfinite_message(type(self).__name__, where))
        if any(m[:2] != metas[0][:2] for m in metas):
            raise QdqCalibrationError(
                f"{type(self).__name__}.sync: ranks use different calibrator configurations: "
                f"{sorted({repr(m[:2]) for m in metas})}. Build the same calibrator on every rank."
            )
        layouts = {m[2] for m in metas if m[2] is not None}
        if not layouts:
            return
        if len(layouts) > 1:
            raise QdqCalibrationError(
                f"{type(self).__name__}.sync: ranks saw different channel shapes "
                f"{sorted(lay.shape for lay in layouts)}; every rank must feed the same layer."
            )
        layout = layouts.pop()
        local = self._local.clone() if self._local is not None else self._empty_state(layout)
        self._synced = self._all_reduce(local, group)
        self._layout = layout

    @abc.abstractmethod
    def compute_amax(self, method: str | None = None, **kwargs: Any) -> torch.Tensor | None:
        """Return the amax (float32; keepdims shape, 0-d per tensor), or ``None`` if nothing was collected."""

    # -- hooks for subclasses -------------------------------------------------------------------------

    @abc.abstractmethod
    def _batch_state(self, x: torch.Tensor, layout: ChannelLayout, batch_max: torch.Tensor) -> CalibState:
        """Statistics of one non-empty float32 tensor, given its finite per-channel maximum (keepdims).

        Must not read device values on the host. ``x`` may hold NaN/Inf (then ``batch_max`` is 0 where
        it was not finite, and the calibrator raises when its statistics are used): no crash, any result.
        """

    @abc.abstractmethod
    def _empty_state(self, layout: ChannelLayout) -> CalibState:
        """Neutral (all-zero) statistics for ``layout`` on the CPU, for a rank without data."""

    @abc.abstractmethod
    def _all_reduce(self, state: CalibState, group: Any) -> CalibState:
        """The all-reduction of ``state`` (which may be modified) over ``group``."""

    def _add_local(self, state: CalibState) -> None:
        if self._local is None:
            self._local = state
        else:
            self._local.add(state)
        self._synced = None

    def _config(self) -> tuple[Any, ...]:
        """Everything that must match for two calibrators' statistics to be combined."""
        return (self._num_bits, self._axis, self._unsigned)

    # -- helpers --------------------------------------------------------------------------------------

    def _check_same_layout(self, layout: ChannelLayout, shape: torch.Size) -> None:
        if self._layout is None or self._layout == layout:
            return
        raise QdqCalibrationError(
            f"{type(self).__name__}: the channel shape changed from {self._layout.shape} to {layout.shape} "
            f"(tensor shape {tuple(shape)}, axis={self._axis}); per-channel amax needs the kept "
            "dimensions to stay the same. Call reset() first to calibrate a different layer."
        )

    def _check_compatible(self, other: Any) -> None:
        if other is self:
            raise QdqConfigError(f"cannot merge a {type(self).__name__} into itself.")
        if type(other) is not type(self):
            raise QdqConfigError(
                f"cannot merge a {type(other).__name__} into a {type(self).__name__}; "
                "merge calibrators of the same class."
            )
        if other._config() != self._config():
            raise QdqConfigError(
                f"cannot merge {type(self).__name__}s with different configurations: "
                f"{self._config()} and {other._config()}."
            )

    def _check_method(self, method: str | None, default: str) -> str:
        if method is None:
            return default
        if method not in self.methods:
            raise QdqConfigError(
                f"{type(self).__name__} cannot compute amax with method {method!r}; "
                f"choose one of {list(self.methods)} or None.{did_you_mean(str(method), self.methods)}"
            )
        return method

    def _repr_fields(self) -> list[str]:
        channels = "none yet" if self._layout is None else str(self._layout.shape)
        return [
            f"num_bits={self._num_bits}",
            f"axis={self._axis}",
            f"unsigned={self._unsigned}",
            f"channels={channels}",
        ]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._repr_fields())})"


def _nonfinite_message(who: str, where: str) -> str:
    return (
        f"{who} collected data with NaN or Inf values ({where}); calibration needs finite data. Find where "
        "they come from (an overflow or a division by zero upstream, a bad input sample) or leave that batch out."
    )

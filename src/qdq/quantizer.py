"""``TensorQuantizer``: the module that quantizes one tensor in a model's forward.

A quantizer holds a descriptor's settings, its range (``amax``, a buffer), a calibrator, and mode flags.
It does no placement, export or calibration scheduling: those live in ``qdq.placement``, ``qdq.export``
and ``qdq.calib``.

Forward, in order:

1. multiply by ``pre_quant_scale`` when set (even when disabled: the scale belongs to the model's math,
   e.g. SmoothQuant weights were divided by it);
2. return the input unchanged when disabled;
3. feed the calibrator when calibrating;
4. clip to the learned range when ``learn_amax``;
5. fake-quantize (or quantize to integers when ``fake_quant=False``) when quantizing.

Without a stored range (no calibration, no ``amax``) the range is **dynamic**: the max of ``|x|`` over the
non-kept axes of each batch. Export needs a stored range.

Nothing in forward or backward reads a device value on the host (no ``.item()``, no ``if tensor``), so
training, calibration and evaluation never wait for the GPU, and ``torch.compile`` traces a quantizer
without graph breaks. Ranges are validated where they are set or loaded instead.

Read-only views for export and tooling: :meth:`effective_amax` (the range forward uses),
:meth:`step` (ONNX's scale), :attr:`quant_bounds`, :attr:`is_quantizing` and the descriptor fields.

Step type: a file whose float part computes in float16 (TensorRT 11, ``target_options={"float": "float16"}``)
has float16 steps. A quantizer whose :attr:`step_type` is ``"float16"`` (or ``"bfloat16"``; placement sets it
from the target's options) uses only ranges whose step is a number of that type
(:func:`qdq.tensor_quant.low_precision_amax`): a stored range is rounded once when it is set (calibration,
``amax = ...``, ``load_state_dict``, or setting the step type), a learned, scaled or dynamic range on every
use. So the model quantizes exactly as the low-precision file does, and ``amax`` reads back the rounded value
(within 2**-11 of what was set).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq import tensor_quant as tq
from qdq.calib.registry import make_calibrator
from qdq.clip import Clip
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.utils.reduce_amax import amax_over
from qdq.validate import check_range

__all__ = ["NO_CALIBRATION_DATA", "ROLES", "STEP_TYPES", "TensorQuantizer", "disabled_quantizers"]

#: What a quantizer can be for (:attr:`TensorQuantizer.role`).
ROLES = ("input", "weight", "output")
#: The types a quantizer's steps can be numbers of (:attr:`TensorQuantizer.step_type`).
STEP_TYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: The error when a calibrator gives no range (:meth:`TensorQuantizer.load_calib_amax`, :func:`qdq.load_amax`).
NO_CALIBRATION_DATA = (
    "Calibrator returned no range: this quantizer saw no data while calibrating. Likely causes: "
    "its module is not used in forward, or calibration ran on a different (wrapped/copied) model."
)

_log = logging.getLogger(__name__)
_BUFFERS = ("_amax", "_pre_quant_scale")


class TensorQuantizer(nn.Module):
    """Quantize a tensor as ``quant_desc`` says.

    Args:
        quant_desc: a :class:`~qdq.descriptor.QuantDescriptor` (default: 8-bit, per tensor, full range).
        disabled: start disabled (identity).
        if_quant: quantize in forward.
        if_clip: clip to the learned range in forward (only with ``learn_amax``).
        if_calib: feed the calibrator in forward.
        role: what the quantizer is for: ``"input"`` (an activation a module reads), ``"weight"`` (a
            parameter, calibrated from its values) or ``"output"`` (an activation a module or a placement rule
            quantizes where it is produced); set by the module or rule that creates it, None when unknown.
            Calibration, weight calibration and export read it (:data:`ROLES`).

    ``amax`` is a float32 buffer, always registered so ``state_dict`` keys never change; an empty buffer
    means "no stored range" (dynamic).
    """

    #: Set per instance by ``qdq.export.export_mode`` while exporting: forward returns ``export_fn(x)``
    #: (ONNX Q/DQ) instead of fake-quantizing.
    export_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: How the stored amax was obtained, for reports (``"entropy"``, ``"percentile 99.99"``, ``"auto: mse"``...):
    #: set per instance by :func:`qdq.load_amax`, :func:`qdq.calibrate` and :func:`qdq.ptq`; ``None`` when
    #: unknown. Not saved in ``state_dict``; setting ``amax`` resets it.
    amax_method: str | None = None
    _amax: torch.Tensor  # buffers, registered in __init__
    _pre_quant_scale: torch.Tensor

    def __init__(
        self,
        quant_desc: QuantDescriptor | None = None,
        disabled: bool = False,
        if_quant: bool = True,
        if_clip: bool = False,
        if_calib: bool = False,
        role: str | None = None,
    ) -> None:
        super().__init__()
        self.role = role
        desc = QuantDescriptor() if quant_desc is None else quant_desc
        if not isinstance(desc, QuantDescriptor):
            raise QdqConfigError(f"quant_desc must be a QuantDescriptor, got {type(desc).__name__}.")
        self._num_bits = desc.num_bits
        self._fake_quant = desc.fake_quant
        self._axis = desc.axis
        self._scale_amax = desc.scale_amax
        self._learn_amax = desc.learn_amax
        self._unsigned = desc.unsigned
        self._narrow_range = desc.narrow_range
        self._calib_method = desc.calib_method
        self._disabled = disabled
        self._if_quant = if_quant
        self._if_calib = if_calib
        self._if_clip = False
        self._scale: torch.Tensor | float | None = 1.0 if desc.fake_quant else None
        self._calibrator: Any = None
        self.register_buffer("_amax", torch.empty(0))
        self.register_buffer("_pre_quant_scale", torch.empty(0))
        if desc.amax is not None:
            self.amax = desc.amax
        if desc.learn_amax:
            init = float(np.max(desc.amax)) if desc.amax is not None else 1.0
            self.clip = Clip(-init, init, learn_min=True, learn_max=True)
            self.enable_clip()
        if if_clip:
            self.enable_clip()

    @property
    def role(self) -> str | None:
        """``"input"``, ``"weight"``, ``"output"`` (:data:`ROLES`), or None when its creator did not say."""
        return self.__dict__.get("_role")  # a quantizer pickled before roles existed has none

    @role.setter
    def role(self, value: str | None) -> None:
        if value is not None and value not in ROLES:
            raise QdqConfigError(f"a quantizer's role is one of {ROLES} or None, got {value!r}.")
        self._role = value

    @property
    def step_type(self) -> str:
        """The type its steps are numbers of: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``.

        Setting it rounds the stored range to that type's grid of steps (see the module doc); placement sets it
        for a target whose export writes low-precision steps (``QuantConfig(target="tensorrt",
        target_options={"float": "float16"})``).
        """
        dtype = self.__dict__.get("_step_dtype")  # a quantizer pickled before step types existed has none
        return next(name for name, value in STEP_TYPES.items() if value == dtype)

    @step_type.setter
    def step_type(self, value: str) -> None:
        if value not in STEP_TYPES:
            raise QdqConfigError(f"a quantizer's step_type is one of {list(STEP_TYPES)}, got {value!r}.")
        self._step_dtype = STEP_TYPES[value]
        self._amax = self._low_precision(self._amax)

    def _low_precision(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax`` rounded to a range whose step is a number of the step type (unchanged for float32)."""
        dtype = self.__dict__.get("_step_dtype")
        if dtype is None or amax.numel() == 0:
            return amax
        return tq.low_precision_amax(amax, dtype, self._num_bits, self._unsigned)

    @property
    def is_weight(self) -> bool:
        """It quantizes a weight (``role == "weight"``)."""
        return self.role == "weight"

    # ---------------------------------------------------------------------------------------- modes
    def enable(self) -> None:
        self._disabled = False

    def disable(self) -> None:
        self._disabled = True

    def enable_quant(self) -> None:
        self._if_quant = True

    def disable_quant(self) -> None:
        self._if_quant = False

    def enable_calib(self) -> None:
        _ = self.calibrator  # builds it, raising early on an unknown calib_method
        self._if_calib = True

    def disable_calib(self) -> None:
        self._if_calib = False

    def enable_clip(self) -> None:
        if not self._learn_amax:
            raise QdqConfigError("enable_clip needs a quantizer built with learn_amax=True.")
        self.clip.clip_value_min.requires_grad = True
        self.clip.clip_value_max.requires_grad = True
        self._if_clip = True

    def disable_clip(self) -> None:
        if self._learn_amax:
            self.clip.clip_value_min.requires_grad = False
            self.clip.clip_value_max.requires_grad = False
        self._if_clip = False

    @property
    def is_enabled(self) -> bool:
        """False when disabled (forward is the identity, after ``pre_quant_scale``)."""
        return not self._disabled

    @property
    def quant_enabled(self) -> bool:
        """Whether forward quantizes (when enabled)."""
        return self._if_quant

    @property
    def calib_enabled(self) -> bool:
        """Whether forward feeds the calibrator (when enabled)."""
        return self._if_calib

    @property
    def clip_enabled(self) -> bool:
        """Whether forward clips to the learned range (when enabled)."""
        return self._if_clip

    @property
    def is_quantizing(self) -> bool:
        """Enabled and quantizing: the quantizer appears as Q/DQ in an exported graph."""
        return not self._disabled and self._if_quant

    # ------------------------------------------------------------------------------ calibration
    @property
    def calibrator(self) -> Any:
        """The calibrator named by the descriptor's ``calib_method`` (built on first use)."""
        if self._calibrator is None:
            self._calibrator = make_calibrator(
                self._calib_method, num_bits=self._num_bits, axis=self._axis, unsigned=self._unsigned
            )
        return self._calibrator

    @calibrator.setter
    def calibrator(self, value: Any) -> None:
        self._calibrator = value

    def load_calib_amax(self, *args: Any, strict: bool = True, **kwargs: Any) -> None:
        """Set ``amax`` from the calibrator; same call for every calibrator.

        Extra arguments go to ``calibrator.compute_amax`` (e.g. ``method="percentile", percentile=99.99``
        for a histogram calibrator); none are required.

        Raises:
            QdqCalibrationError: when the calibrator saw no data (with ``strict=False``: warn and stay dynamic).
        """
        amax = self.calibrator.compute_amax(*args, **kwargs)
        if amax is None:
            if strict:
                raise QdqCalibrationError(NO_CALIBRATION_DATA)
            _log.warning(NO_CALIBRATION_DATA)
            return
        self.amax = amax

    def init_learn_amax(self) -> None:
        """Copy the stored amax into the learnable clip range ``[-amax, amax]``."""
        if not self._learn_amax:
            raise QdqConfigError("init_learn_amax needs a quantizer built with learn_amax=True.")
        if self._amax.numel() == 0:
            raise QdqCalibrationError("init_learn_amax needs a stored amax; calibrate first.")
        value = float(self._amax.max())  # once, at initialisation: reading the value is fine here
        if self._amax.numel() > 1:
            _log.warning("Per-channel amax cannot initialise a scalar learned range; using its max %g.", value)
        with torch.no_grad():
            self.clip.clip_value_min.fill_(-value)
            self.clip.clip_value_max.fill_(value)

    # -------------------------------------------------------------------------------- properties
    @property
    def amax(self) -> torch.Tensor | None:
        """The stored range (float32 tensor), or None when the range is dynamic."""
        return None if self._amax.numel() == 0 else self._amax

    @amax.setter
    def amax(self, value: Any) -> None:
        self.amax_method = None
        if value is None:
            self._amax = torch.empty(0, device=self._amax.device)
            return
        self._amax = self._low_precision(check_range("amax", value, self._amax.device))

    @property
    def pre_quant_scale(self) -> torch.Tensor | None:
        """Per-channel multiplier applied to the input before quantization, or None."""
        return None if self._pre_quant_scale.numel() == 0 else self._pre_quant_scale

    @pre_quant_scale.setter
    def pre_quant_scale(self, value: Any) -> None:
        if value is None:
            self._pre_quant_scale = torch.empty(0, device=self._pre_quant_scale.device)
            return
        self._pre_quant_scale = check_range("pre_quant_scale", value, self._pre_quant_scale.device)

    @property
    def num_bits(self) -> int:
        return self._num_bits

    @num_bits.setter
    def num_bits(self, value: int) -> None:
        tq.max_bound(value)  # validates
        self._num_bits = value
        self._amax = self._low_precision(self._amax)  # a new grid: a new step

    @property
    def unsigned(self) -> bool:
        return self._unsigned

    @unsigned.setter
    def unsigned(self, value: bool) -> None:
        self._unsigned = bool(value)
        self._amax = self._low_precision(self._amax)

    @property
    def narrow_range(self) -> bool:
        return self._narrow_range

    @narrow_range.setter
    def narrow_range(self, value: bool) -> None:
        self._narrow_range = bool(value)

    @property
    def axis(self) -> tuple[int, ...] | None:
        """Axes kept by per-channel quantization, or None."""
        return self._axis

    @property
    def fake_quant(self) -> bool:
        return self._fake_quant

    @property
    def learn_amax(self) -> bool:
        return self._learn_amax

    @property
    def scale_amax(self) -> float | None:
        return self._scale_amax

    @property
    def calib_method(self) -> str:
        return self._calib_method

    @property
    def maxbound(self) -> int:
        """Largest integer on the grid (127 for int8)."""
        return tq.max_bound(self._num_bits, self._unsigned)

    @property
    def quant_bounds(self) -> tuple[int, int]:
        """``(qmin, qmax)`` of the integer grid, e.g. ``(-128, 127)``."""
        return tq.quant_bounds(self._num_bits, self._unsigned, self._narrow_range)

    def effective_amax(self) -> torch.Tensor | None:
        """The range forward quantizes with, detached float32, or None when the range is dynamic.

        The learned clip range ``max(-clip_min, clip_max)`` (0-d) with ``learn_amax``; else the stored
        amax (as stored: keepdims or 1-D per channel) times ``scale_amax``.
        """
        if self._learn_amax:
            learned = torch.maximum(-self.clip.clip_value_min, self.clip.clip_value_max).detach().float().reshape(())
            return self._low_precision(learned)
        if self._amax.numel() == 0:
            return None
        amax = self._amax.detach()
        return self._low_precision(amax * self._scale_amax) if self._scale_amax is not None else amax

    def step(self) -> torch.Tensor:
        """Quantization step of :meth:`effective_amax`: ONNX's ``y_scale`` (1 for channels of amax <= 2**-24).

        Raises:
            QdqCalibrationError: the range is dynamic (calibrate or set ``amax`` first).
        """
        amax = self.effective_amax()
        if amax is None:
            raise QdqCalibrationError("this quantizer's range is dynamic: calibrate it or set amax to get a step.")
        return tq.quant_step(amax, self._num_bits, self._unsigned)

    @property
    def step_size(self) -> torch.Tensor:
        """The seed's name of :meth:`step`."""
        return self.step()

    @property
    def scale(self) -> torch.Tensor | float | None:
        """The seed's multiplier ``maxbound / amax`` from the last real (fake_quant=False) quantization."""
        return self._scale

    # ----------------------------------------------------------------------------------- forward
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self._pre_quant_scale.numel():
            x = x * self._pre_quant_scale.to(x.dtype)
        if self._disabled:
            return x
        if self._if_calib:
            self.calibrator.collect(x)
        out = x
        if self._if_clip:
            out = self.clip(x)
        if self._if_quant:
            out = self._quant_forward(x)
        return out

    def requantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as read again through this quantizer, for values it already put on its grid and that an op kept
        there (a pad with zeros, which are on every grid, or with copies of its values): ``x`` itself in PyTorch,
        where quantizing again changes nothing, and a second Q/DQ pair of the same range while exporting, so that
        the file shows the op between two conversions of one scale (which the ``onnxruntime`` rewrite runs on the
        integers). No ``pre_quant_scale``, no calibration."""
        if self.export_fn is not None and self.is_quantizing:
            return self.export_fn(x)
        return x

    def _quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export_fn is not None:
            return self.export_fn(x)
        if self._learn_amax:
            x = self.clip(x)
            amax = self._low_precision(torch.maximum(-self.clip.clip_value_min, self.clip.clip_value_max).detach())
        else:
            amax = self._get_amax(x)
        if self._fake_quant:
            return tq.fake_quant_unchecked(x, amax, self._num_bits, self._unsigned, self._narrow_range)
        q, self._scale = tq.tensor_quant_unchecked(x, amax, self._num_bits, self._unsigned, self._narrow_range)
        return q

    def _get_amax(self, x: torch.Tensor) -> torch.Tensor:
        """Stored amax shaped to broadcast against ``x``, else the dynamic range of ``x``."""
        stored = self._amax.numel() > 0  # rounded to the step type when it was set
        if stored:
            amax = self._broadcastable(self._amax, x.dim())
        else:  # dynamic range: this batch's max
            amax = amax_over(x.detach(), self._axis)
        if self._scale_amax is not None:
            amax = amax * self._scale_amax
            stored = False
        return amax.float() if stored else self._low_precision(amax.float())

    def _broadcastable(self, amax: torch.Tensor, rank: int) -> torch.Tensor:
        """Reshape a 1-D per-channel amax of size C to size C on the kept axis, 1 elsewhere."""
        if amax.dim() == 1 and amax.numel() > 1 and self._axis is not None and len(self._axis) == 1:
            shape = [1] * rank
            shape[self._axis[0] % rank] = amax.numel()
            return amax.view(shape)
        return amax

    # ------------------------------------------------------------------------------- state_dict
    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Stored ranges may have another shape than ours (e.g. empty before calibration): adopt theirs,
        # on our device, so a checkpoint saved on GPU loads on a CPU-only host.
        for name in _BUFFERS:
            key = prefix + name
            if key in state_dict:
                value = state_dict[key]
                target = getattr(self, name)
                setattr(self, name, check_range(name.lstrip("_"), value, target.device, allow_empty=True))
        before = set(missing_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._amax = self._low_precision(self._amax)  # the step type's grid (the stored values are copied in)
        for name in _BUFFERS:  # checkpoints of the seed toolkit omit ranges that were never set
            key = prefix + name
            if key in missing_keys and key not in before and getattr(self, name).numel() == 0:
                missing_keys.remove(key)

    # ----------------------------------------------------------------------------------- printing
    def extra_repr(self) -> str:
        if self._disabled:
            return "disabled"
        parts = [f"{self._num_bits}bit", "fake" if self._fake_quant else "real"]
        parts.append("per-tensor" if self._axis is None else f"axis={_axis_str(self._axis)}")
        parts += [flag for flag in ("unsigned", "narrow_range") if getattr(self, f"_{flag}")]
        parts.append(f"amax={_amax_str(self.amax)}")
        if self._scale_amax is not None:
            parts.append(f"scale_amax={self._scale_amax}")
        if self.pre_quant_scale is not None:
            parts.append(f"pre_quant_scale={_amax_str(self.pre_quant_scale)}")
        if self._learn_amax:
            parts.append("learned")
        if self.step_type != "float32":
            parts.append(f"{self.step_type}_steps")
        parts.append(f"calib={self._calib_method}")
        modes = [m for m, on in (("quant", self._if_quant), ("calib", self._if_calib), ("clip", self._if_clip)) if on]
        parts.append("+".join(modes) if modes else "idle")
        return " ".join(parts)


def _axis_str(axis: tuple[int, ...]) -> str:
    return str(axis[0]) if len(axis) == 1 else str(axis)


def _amax_str(amax: torch.Tensor | None) -> str:
    if amax is None:
        return "dynamic"
    if amax.numel() == 1:
        return f"{amax.item():.4f}"
    return f"[{amax.min().item():.4f}, {amax.max().item():.4f}]({amax.numel()})"


@contextlib.contextmanager
def disabled_quantizers(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily run ``model`` in float (every quantizer disabled); the ones that were enabled are enabled again."""
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    enabled = [q.is_enabled for q in quantizers]
    try:
        for quantizer in quantizers:
            quantizer.disable()
        yield model
    finally:
        for quantizer, was_enabled in zip(quantizers, enabled):
            if was_enabled:
                quantizer.enable()

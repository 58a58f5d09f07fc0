"""``QuantDescriptor``: the immutable description of how one tensor is quantized.

It carries every field of the seed toolkit's descriptor with the same defaults, and round-trips
losslessly through ``dict()`` / ``from_dict()`` and ``to_yaml()`` / ``from_yaml()`` (the seed dropped
``calib_method`` and ``narrow_range``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean

__all__ = [
    "QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW",
    "QUANT_DESC_8BIT_PER_TENSOR",
    "QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR",
    "QuantDescriptor",
    "ScaledQuantDescriptor",
]

_DEFAULTS: dict[str, Any] = {
    "num_bits": 8,
    "name": None,
    "fake_quant": True,
    "axis": None,
    "amax": None,
    "learn_amax": False,
    "scale_amax": None,
    "calib_method": "max",
    "unsigned": False,
    "narrow_range": False,
}


def _normalize_axis(axis: Any) -> tuple[int, ...] | None:
    if axis is None:
        return None
    if isinstance(axis, bool):
        raise QdqTypeError(f"axis must be None, an int or a tuple of ints, got {axis!r}.")
    if isinstance(axis, int | np.integer):
        return (int(axis),)
    if isinstance(axis, Sequence) and all(isinstance(a, int | np.integer) and not isinstance(a, bool) for a in axis):
        if len(set(axis)) != len(axis):
            raise QdqConfigError(f"axis {tuple(axis)} repeats an axis.")
        return tuple(int(a) for a in axis) or None
    raise QdqTypeError(f"axis must be None, an int or a tuple of ints, got {axis!r}.")


def _normalize_amax(amax: Any) -> np.ndarray | None:
    if amax is None:
        return None
    try:
        arr = np.array(amax, dtype=np.float32)
        arr.setflags(write=False)  # descriptors are immutable, their amax too
    except (TypeError, ValueError) as err:
        raise QdqTypeError(f"amax must be a number, a list or an array of numbers, got {amax!r}.") from err
    if np.isnan(arr).any() or (arr < 0).any():
        raise QdqConfigError(f"amax must be non-negative and not NaN, got {amax!r}.")
    return arr


def _check_num_bits(num_bits: Any) -> int:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int | np.integer):
        raise QdqTypeError(
            f"num_bits must be an int between 2 and 16, got {num_bits!r}. FP8 (4, 3) is not supported by qdq."
        )
    if not 2 <= num_bits <= 16:
        raise QdqConfigError(f"num_bits={num_bits} is not supported: qdq quantizes to 2..16 bits.")
    return int(num_bits)


class QuantDescriptor:
    """How to quantize one tensor. Immutable; compare with ``==``.

    Args:
        num_bits: bits of the integer grid, 2 to 16.
        name: optional label, kept for printing.

    Keyword Args:
        fake_quant (bool): True returns dequantized values (training/simulation); False returns integers.
        axis (int | tuple[int, ...] | None): None for one amax per tensor, or the axes to **keep**
            (per-channel), e.g. 0 for the output channels of a conv weight. Stored as a tuple.
        amax (float | list | np.ndarray | None): a fixed clipping range (float, list or array), stored as a
            float32 array.
        learn_amax (bool): learn the clipping range (PACT-style :class:`qdq.nn.Clip`); needs ``axis=None``.
        scale_amax (float | None): multiply the (static or dynamic) amax by this factor at each use.
        calib_method (str): name of the calibrator, ``"max"`` or ``"histogram"`` (or a registered name).
        unsigned (bool): quantize to ``[0, 2**num_bits - 1]``.
        narrow_range (bool): signed range ``[-2**(b-1) + 1, 2**(b-1) - 1]`` instead of full two's
            complement. Default False: full range, which is what ONNX and TensorRT compute.

    Raises:
        QdqTypeError: for an unknown keyword (with a suggestion) or a value of the wrong type.
        QdqConfigError: for out-of-range values (num_bits, negative amax, learn_amax with an axis).
    """

    __slots__ = tuple(f"_{k}" for k in _DEFAULTS)
    _num_bits: int
    _name: str | None
    _fake_quant: bool
    _axis: tuple[int, ...] | None
    _amax: np.ndarray | None
    _learn_amax: bool
    _scale_amax: float | None
    _calib_method: str
    _unsigned: bool
    _narrow_range: bool

    def __init__(self, num_bits: int = 8, name: str | None = None, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in _DEFAULTS]
        if unknown:
            hint = did_you_mean(unknown[0], _DEFAULTS)
            raise QdqTypeError(f"Unused keys: {unknown}. Valid keys: {sorted(_DEFAULTS)}.{hint}")
        values = {**_DEFAULTS, **kwargs, "num_bits": num_bits, "name": name}
        object.__setattr__(self, "_num_bits", _check_num_bits(values["num_bits"]))
        if values["name"] is not None and not isinstance(values["name"], str):
            raise QdqTypeError(f"name must be a str or None, got {values['name']!r}.")
        object.__setattr__(self, "_name", values["name"])
        object.__setattr__(self, "_axis", _normalize_axis(values["axis"]))
        object.__setattr__(self, "_amax", _normalize_amax(values["amax"]))
        self._set_flags(values)
        self._check_consistency()

    def _set_flags(self, values: Mapping[str, Any]) -> None:
        for key in ("fake_quant", "learn_amax", "unsigned", "narrow_range"):
            if not isinstance(values[key], bool | np.bool_):
                raise QdqTypeError(f"{key} must be a bool, got {values[key]!r}.")
            object.__setattr__(self, f"_{key}", bool(values[key]))
        scale_amax = values["scale_amax"]
        if scale_amax is not None:
            if isinstance(scale_amax, bool) or not isinstance(scale_amax, int | float):
                raise QdqTypeError(f"scale_amax must be a number or None, got {scale_amax!r}.")
            if not scale_amax > 0:
                raise QdqConfigError(f"scale_amax must be positive, got {scale_amax}.")
            scale_amax = float(scale_amax)
        object.__setattr__(self, "_scale_amax", scale_amax)
        if not isinstance(values["calib_method"], str):
            raise QdqTypeError(
                f"calib_method must be a str such as 'max' or 'histogram', got {values['calib_method']!r}."
            )
        object.__setattr__(self, "_calib_method", values["calib_method"])

    def _check_consistency(self) -> None:
        if self._learn_amax and self._axis is not None:
            raise QdqConfigError("axis is ignored and must be None when learn_amax is true.")
        if self._unsigned and self._narrow_range:
            raise QdqConfigError("narrow_range applies to signed quantization only; unset it for unsigned.")

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"QuantDescriptor is immutable; build a new one with replace({key}=...).")

    # read-only properties -------------------------------------------------------------------------
    @property
    def num_bits(self) -> int:
        return self._num_bits

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def fake_quant(self) -> bool:
        return self._fake_quant

    @property
    def axis(self) -> tuple[int, ...] | None:
        """Axes kept by per-channel quantization (tuple) or None."""
        return self._axis

    @property
    def amax(self) -> np.ndarray | None:
        return self._amax

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
    def unsigned(self) -> bool:
        return self._unsigned

    @property
    def narrow_range(self) -> bool:
        return self._narrow_range

    def __reduce__(self) -> tuple[Any, ...]:
        # Immutable with __slots__: copy, deepcopy and pickle go through the lossless dict form.
        return (_from_full_dict, (self.dict(full=True),))

    def replace(self, **changes: Any) -> QuantDescriptor:
        """A copy with some fields changed: ``desc.replace(num_bits=4)``."""
        return QuantDescriptor(**{**self.dict(full=True), **changes})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantDescriptor):
            return NotImplemented
        return self.dict(full=True) == other.dict(full=True)

    def __hash__(self) -> int:
        return hash(repr(sorted(self.dict(full=True).items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.dict().items())
        return f"QuantDescriptor({fields})"

    def __str__(self) -> str:
        axis = "per-tensor" if self._axis is None else f"axis={self._axis}"
        parts = [f"{self._num_bits}bit", "fake" if self._fake_quant else "real", axis]
        parts += [flag for flag in ("unsigned", "narrow_range", "learn_amax") if getattr(self, flag)]
        if self._amax is not None:
            parts.append(f"amax={self._amax.tolist()}")
        return f"QuantDescriptor({' '.join(parts)})"

    # serialization ---------------------------------------------------------------------------------
    def dict(self, full: bool = False) -> dict[str, Any]:
        """Plain-Python dict (YAML/JSON safe) of ``num_bits``, ``name`` and every non-default field.

        With ``full=True`` every field is present. ``QuantDescriptor(**d)`` rebuilds an equal descriptor.
        """
        out: dict[str, Any] = {}
        for key, default in _DEFAULTS.items():
            value = self._plain(key)
            if full or key in ("num_bits", "name") or value != default:
                out[key] = value
        return out

    def _plain(self, key: str) -> Any:
        value = getattr(self, f"_{key}")
        if key == "axis" and value is not None:
            return value[0] if len(value) == 1 else list(value)
        if key == "amax" and value is not None:
            return value.tolist()
        return value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantDescriptor:
        """Inverse of :meth:`dict`."""
        if not isinstance(data, Mapping):
            raise QdqTypeError(f"QuantDescriptor.from_dict needs a mapping, got {type(data).__name__}.")
        return cls(**dict(data))

    def to_yaml(self) -> str:
        """YAML text of :meth:`dict` (needs PyYAML)."""
        import yaml

        return yaml.safe_dump(self.dict(), sort_keys=True)

    @classmethod
    def from_yaml(cls, yaml_str: str) -> QuantDescriptor:
        """Inverse of :meth:`to_yaml`."""
        import yaml

        return cls.from_dict(yaml.safe_load(yaml_str))


def _from_full_dict(data: dict[str, Any]) -> QuantDescriptor:
    return QuantDescriptor(**data)


#: The seed's class name; qdq has one descriptor class.
ScaledQuantDescriptor = QuantDescriptor

QUANT_DESC_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8)
QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8, unsigned=True)
QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW = QuantDescriptor(num_bits=8, axis=0)
# ConvTranspose weights are (in_channels, out_channels / groups, *kernel). TensorRT's deconvolution
# kernels need one scale per *input* channel, i.e. axis 0 (TensorRT#1694, #2380); the seed's 2.2.1
# default of axis 1 builds engines that compute wrong results.
QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)

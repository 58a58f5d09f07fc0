"""The one map from float module classes to their quantized classes, filled next to the classes.

Each quantized class registers itself where it is defined::

    @quantizes(nn.Conv2d)
    class QuantConv2d(_QuantConvNd, nn.Conv2d): ...

:func:`qdq.replace.replace_modules` (and so :func:`qdq.quantize_model`) swaps the registered classes, and the
seed's monkey patch :func:`qdq.quant_modules.initialize` patches the ``torch.nn`` ones. A class registered with
``by_default=False`` (MaxPool, InstanceNorm: the seed leaves them float) is swapped only when a
``ModuleFilter``'s ``include_types`` names it, and is not patched.
"""

from __future__ import annotations

from collections.abc import Callable

from qdq.registry import Registry

__all__ = ["QUANT_MODULES", "default_float_types", "quantizes"]

#: float module type -> quantized module class.
QUANT_MODULES: Registry[type, type] = Registry("quantized module for")
_NOT_BY_DEFAULT: set[type] = set()


def quantizes(float_cls: type, *, by_default: bool = True) -> Callable[[type], type]:
    """Class decorator: the decorated class is the quantized version of ``float_cls``."""

    def register(quant_cls: type) -> type:
        QUANT_MODULES.register(float_cls, quant_cls)
        if not by_default:
            _NOT_BY_DEFAULT.add(float_cls)
        return quant_cls

    return register


def default_float_types() -> tuple[type, ...]:
    """The registered float classes quantized unless a filter says otherwise (all but MaxPool, InstanceNorm)."""
    return tuple(cls for cls in QUANT_MODULES if cls not in _NOT_BY_DEFAULT)

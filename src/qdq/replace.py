"""Module replacement: turn an already-built float model into a quantized one, in place.

:func:`replace_modules` walks the model and replaces every module whose type is registered
(``nn.Conv2d`` → ``QuantConv2d``, ...) and that a :class:`ModuleFilter` selects by its quantized version,
sharing the parameters, so an optimizer or a loaded checkpoint keeps working. A subclass of a registered
convolution (timm's ``Conv2dSame``, whose forward pads first) gets a quantized class that keeps its own forward
(:mod:`qdq.nn.subclass`); a subclass qdq cannot quantize so stays float, and one warning per call names those
modules and why. A user adds their own module with ``register_quant_module(MyBlock, QuantMyBlock)``. The user
entry point, which also places Q/DQ for a target, is :func:`qdq.quantize_model` (:mod:`qdq.quantize`).
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast, overload

from torch import nn

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.base import QuantInputMixin, QuantMixin, float_class_of
from qdq.nn.registry import QUANT_MODULES, default_float_types
from qdq.nn.subclass import registered_family, resolve

__all__ = [
    "QUANT_MODULES",
    "ModuleFilter",
    "quant_module_for",
    "quantized_module_names",
    "register_quant_module",
    "replace_modules",
    "unregister_quant_module",
]

# The map itself lives next to the quantized classes (``@quantizes(nn.Conv2d)`` in ``qdq/nn``); MaxPool (it
# commutes with Q/DQ) and InstanceNorm are registered but swapped only when a filter names them, as in the seed.


@overload
def register_quant_module(
    float_cls: type, quant_cls: None = None, *, override: bool = False
) -> Callable[[type], type]: ...
@overload
def register_quant_module(float_cls: type, quant_cls: type, *, override: bool = False) -> type: ...
def register_quant_module(
    float_cls: type, quant_cls: type | None = None, *, override: bool = False
) -> Callable[[type], type] | type:
    """Register ``quant_cls`` as the quantized version of ``float_cls``; usable as a decorator.

    ``quant_cls`` must subclass :class:`qdq.nn.QuantInputMixin` (or ``QuantMixin``) and ``float_cls``,
    implement ``forward`` with its quantizers, and build them in ``init_quantizer`` (see ``qdq/nn/conv.py``).
    """

    def _register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, QuantInputMixin)):
            raise QdqTypeError(f"{cls!r} must subclass qdq.nn.QuantInputMixin or QuantMixin.")
        if float_class_of(cls) is not float_cls and not issubclass(cls, float_cls):
            raise QdqTypeError(f"{cls.__name__} must subclass {float_cls.__name__} to replace it.")
        return QUANT_MODULES.register(float_cls, cls, override=override)

    return _register if quant_cls is None else _register(quant_cls)


def unregister_quant_module(float_cls: type) -> type:
    """Remove a registration; returns the quantized class that was registered."""
    return QUANT_MODULES.unregister(float_cls)


def quant_module_for(float_cls: type) -> type | None:
    """The registered quantized class for exactly ``float_cls``, or None."""
    return QUANT_MODULES.find(float_cls)


Pattern = str


def _compile(pattern: Pattern) -> Callable[[str], bool]:
    if not isinstance(pattern, str):
        raise QdqTypeError(f"module-name patterns are strings (glob, or 're:<regex>'), got {pattern!r}.")
    if pattern.startswith("re:"):
        try:
            regex = re.compile(pattern[3:])
        except re.error as err:
            raise QdqConfigError(f"invalid regular expression {pattern[3:]!r}: {err}.") from err
        return lambda name: regex.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


@dataclass(frozen=True)
class ModuleFilter:
    """Which modules of a model are replaced, by name and by type.

    Attributes:
        include: module-name patterns (``fnmatch`` globs such as ``"layer1.*"``, or ``"re:<regex>"``);
            empty means every module.
        exclude: module-name patterns left in float (wins over ``include``).
        include_types: float module types to replace; empty means every registered type except MaxPool and
            InstanceNorm (the seed's default set).
        exclude_types: float module types left in float.

    A subclass of a registered type is selected by the types as that type is, or by its own name.
    """

    include: tuple[Pattern, ...] = ()
    exclude: tuple[Pattern, ...] = ()
    include_types: tuple[type, ...] = ()
    exclude_types: tuple[type, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("include", "exclude", "include_types", "exclude_types"):
            value = getattr(self, name)
            if isinstance(value, str | type):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        for pattern in self.include + self.exclude:
            _compile(pattern)

    @property
    def narrowed(self) -> bool:
        """True when ``include`` or ``include_types`` restricts the selection (then it must match something)."""
        return bool(self.include or self.include_types)

    def selects(self, name: str, module: nn.Module) -> bool:
        """True when ``module`` (called ``name`` in the model) should be quantized."""
        family = registered_family(type(module))
        kinds = {type(module), family}
        if self.include_types:
            if kinds.isdisjoint(self.include_types):
                return False
        elif family is not None and family not in default_float_types():
            return False
        if not kinds.isdisjoint(self.exclude_types):
            return False
        if self.include and not any(_compile(p)(name) for p in self.include):
            return False
        return not any(_compile(p)(name) for p in self.exclude)


def replace_modules(
    model: nn.Module,
    module_filter: ModuleFilter | None = None,
    quant_desc_input: QuantDescriptor | None = None,
    quant_desc_weight: QuantDescriptor | None = None,
) -> nn.Module:
    """Replace the registered modules of ``model`` that ``module_filter`` selects, in place.

    The quantized modules share the float modules' parameters. Descriptors None use each class's default.
    Selected subclasses of registered classes that stay float (:func:`qdq.nn.subclass.resolve`) are named in one
    warning.

    Returns:
        ``model``, or the quantized module when ``model`` itself is a selected registered module (a new
        object: ``model`` is then left as it was).

    Raises:
        QdqConfigError: when a narrowing filter (``include``, ``include_types``) selects nothing.
    """
    module_filter = ModuleFilter() if module_filter is None else module_filter
    descs = (quant_desc_input, quant_desc_weight)
    left_float: dict[str, tuple[nn.Module, str]] = {}
    quant_cls = _selected_class(model, "", module_filter, left_float)
    if quant_cls is not None:
        return _convert(model, quant_cls, descs)
    replaced = _replace_children(model, "", module_filter, descs, left_float)
    if left_float:
        warnings.warn(_left_float_message(left_float), stacklevel=3)
    if not replaced and module_filter.narrowed:
        types = [t.__name__ for t in module_filter.include_types]
        raise QdqConfigError(
            f"quantize_model: include={module_filter.include} include_types={types} matched no quantizable "
            "module. Check the names with [n for n, _ in model.named_modules()]."
        )
    return model


_Descs = tuple[QuantDescriptor | None, QuantDescriptor | None]
_LeftFloat = dict[str, tuple[nn.Module, str]]


def _selected_class(module: nn.Module, name: str, module_filter: ModuleFilter, left_float: _LeftFloat) -> type | None:
    """The quantized class ``module`` becomes, or None (then a selected subclass qdq cannot quantize is recorded
    in ``left_float`` with the reason)."""
    if isinstance(module, QuantInputMixin) or registered_family(type(module)) is None:
        return None
    if not module_filter.selects(name, module):
        return None
    quant_cls, why = resolve(module)
    if why is not None:
        left_float[name] = (module, why)
    return quant_cls


def _convert(module: nn.Module, quant_cls: type, descs: _Descs) -> nn.Module:
    # every registered class subclasses QuantInputMixin and the torch module it replaces (register_quant_module)
    if issubclass(quant_cls, QuantMixin):
        return cast(nn.Module, quant_cls.from_float(module, *descs))
    return cast(nn.Module, cast("type[QuantInputMixin]", quant_cls).from_float(module, descs[0]))


def _replace_children(
    parent: nn.Module, prefix: str, module_filter: ModuleFilter, descs: _Descs, left_float: _LeftFloat
) -> list[str]:
    replaced: list[str] = []
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}.{child_name}" if prefix else child_name
        quant_cls = _selected_class(child, name, module_filter, left_float)
        if quant_cls is not None:
            setattr(parent, child_name, _convert(child, quant_cls, descs))
            replaced.append(name)
        elif not isinstance(child, QuantInputMixin):
            replaced += _replace_children(child, name, module_filter, descs, left_float)
    return replaced


def _left_float_message(left_float: _LeftFloat) -> str:
    """One warning for the selected modules left float, grouped by class: which, and why."""
    by_class: dict[tuple[type, str], list[str]] = {}
    for name, (module, why) in left_float.items():
        by_class.setdefault((type(module), why), []).append(name or "the model itself")
    parts = []
    for (kind, why), names in by_class.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{len(names)} {kind.__name__} ({shown}): {why}")
    return (
        f"quantize_model left {len(left_float)} module(s) float, of subclasses of quantizable classes: "
        f"{'; '.join(parts)}. A subclass qdq cannot quantize is quantized once a quantized class is registered for "
        "it (qdq.replace.register_quant_module(MyConv, QuantMyConv))."
    )


def quantized_module_names(model: nn.Module) -> Iterable[str]:
    """Names of the quantized modules in ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, QuantInputMixin)]

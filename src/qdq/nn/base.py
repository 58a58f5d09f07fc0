"""The bases of every quantized module: what it declares about its quantizers, its ``__init__``, ``from_float``.

:class:`QuantModule` is what every quantized module says about itself, so that no caller assumes an attribute
name (an LSTM has one input quantizer per layer and direction, an add one per operand):

* :meth:`QuantModule.quantizers`: each of its quantizers by name, each with its
  :attr:`~qdq.quantizer.TensorQuantizer.role` (``"input"``, ``"weight"`` or ``"output"``);
* :meth:`QuantModule.argument_quantizers`: the quantizer each argument of ``forward`` is read through (what
  placement rules ask: "does this module quantize the tensor it reads?");
* :meth:`QuantModule.start_calibration` / :meth:`QuantModule.finish_calibration`: what a module does before and
  after a calibration pass (:func:`qdq.collect_stats` calls them through :func:`calibration_started` and
  :func:`calibration_finished`): attention checks the shapes it saw against its target's facts. Calibration
  knows the protocol, not the modules.

A quantized layer subclasses the torch module it replaces (``QuantConv2d(QuantMixin, nn.Conv2d)``), so
``isinstance(m, nn.Conv2d)`` holds, every torch constructor argument is accepted (plus ``quant_desc_input=``
and, with a weight, ``quant_desc_weight=``: the one ``__init__`` of :class:`QuantInputMixin`), and
``state_dict`` keys are the float module's plus the quantizers' ``_amax`` buffers.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from qdq.descriptor import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.quantizer import TensorQuantizer

__all__ = [
    "InputQuantized",
    "QuantInputMixin",
    "QuantMixin",
    "QuantModule",
    "calibration_finished",
    "calibration_started",
    "float_class_of",
    "pop_quant_desc_in_kwargs",
]

Q = TypeVar("Q", bound="QuantInputMixin")
QW = TypeVar("QW", bound="QuantMixin")


def _check_desc(desc: Any, what: str) -> QuantDescriptor:
    if not isinstance(desc, QuantDescriptor):
        raise QdqTypeError(f"{what} must be a QuantDescriptor, got {type(desc).__name__}.")
    if not desc.fake_quant:
        raise QdqConfigError(f"Only fake quantization is supported in quantized modules ({what} has fake_quant=False).")
    return desc


class QuantModule:
    """What every quantized module declares: its quantizers and the quantizer each ``forward`` argument is
    read through."""

    def quantizers(self) -> dict[str, TensorQuantizer]:
        """Each quantizer of this module by its name in the module (``"_input_quantizer"``,
        ``"_weight_quantizers.1"``...); :attr:`~qdq.quantizer.TensorQuantizer.role` says what each is for."""
        return {name: m for name, m in self.named_modules() if isinstance(m, TensorQuantizer)}  # type: ignore[attr-defined]  # a mixin: on torch modules

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        """The quantizer applied to each positional argument of ``forward`` as it is read, None where the
        argument is read as it is (or only through something derived from it); positions past the end are
        read as they are. A sequence argument (``QuantConcat``'s tensors) has each element quantized."""
        return ()

    @classmethod
    def start_calibration(cls, modules: Sequence[tuple[str, QuantModule]]) -> None:
        """Before a calibration pass over ``modules``: every module of the model whose class shares this
        implementation, with its name, at once (forget what an earlier calibration recorded). Default: nothing."""

    @classmethod
    def finish_calibration(cls, modules: Sequence[tuple[str, QuantModule]]) -> str | None:
        """After a calibration pass, likewise: act on what the data showed (disable quantizers the target cannot
        run at the shapes seen); returns what to warn the user of, once for all of them, or None. Default: None."""
        return None


class QuantInputMixin(QuantModule):
    """Adds one input quantizer, ``_input_quantizer``, configured by a per-class default descriptor.

    Its ``__init__`` is the one of every quantized layer: the torch module's own, then
    :meth:`init_quantizer` with the descriptors named in ``_descriptor_arguments`` (``quant_desc_input``,
    and ``quant_desc_weight`` for :class:`QuantMixin`; None: the class defaults).
    """

    default_quant_desc_input: ClassVar[QuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    _descriptor_arguments: ClassVar[tuple[str, ...]] = ("quant_desc_input",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        descriptors = [kwargs.pop(name, None) for name in self._descriptor_arguments]
        super().__init__(*args, **kwargs)
        self.init_quantizer(*descriptors)

    @classmethod
    def set_default_quant_desc_input(cls, value: QuantDescriptor) -> None:
        """Set the default input descriptor of this class only (subclasses and siblings are unaffected)."""
        cls.default_quant_desc_input = copy.deepcopy(_check_desc(value, "quant_desc_input"))

    def init_quantizer(self, quant_desc_input: QuantDescriptor | None = None) -> None:
        desc = self.default_quant_desc_input if quant_desc_input is None else quant_desc_input
        self._input_quantizer = TensorQuantizer(_check_desc(desc, "quant_desc_input"), role="input")

    @property
    def input_quantizer(self) -> TensorQuantizer:
        return self._input_quantizer

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        return (self._input_quantizer,)

    @classmethod
    def from_float(cls: type[Q], module: nn.Module, quant_desc_input: QuantDescriptor | None = None, **_: Any) -> Q:
        """A quantized copy of ``module`` that shares its parameters, buffers and hooks."""
        new = _adopt(cls, module)
        new.init_quantizer(quant_desc_input)
        return _quantizers_on_device_of(new, module)

    def to_float(self) -> nn.Module:
        """The float module this one replaces (``float_class_of``), sharing its parameters, buffers and hooks,
        without the quantizers: what :meth:`from_float` was given."""
        float_cls = float_class_of(type(self))
        new = float_cls.__new__(float_cls)
        new.__dict__.update(self.__dict__)
        for name, value in self.__dict__.items():
            if isinstance(value, dict | set | list):
                new.__dict__[name] = value.copy()
        for name in {path.split(".", 1)[0] for path in self.quantizers()}:
            new._modules.pop(name, None)
        return new


class InputQuantized(QuantInputMixin):
    """Base of modules that quantize their input and then run the float module (pooling, norms)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(self._input_quantizer(input))  # type: ignore[misc]  # the torch module's, next in the MRO


class QuantMixin(QuantInputMixin):
    """Adds an input quantizer and a weight quantizer, ``_weight_quantizer``."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    _descriptor_arguments: ClassVar[tuple[str, ...]] = ("quant_desc_input", "quant_desc_weight")
    #: The torch function this class's weighted op is, called as ``function(input, weight, ...)`` (``torch.conv2d``
    #: for ``QuantConv2d``), or None. Where it is set, a subclass of the float class whose own ``forward`` pads its
    #: input before that call is quantized at the call, through its own forward (:mod:`qdq.nn.subclass`).
    weighted_function: ClassVar[Callable[..., torch.Tensor] | None] = None

    @classmethod
    def sample_input(cls, module: nn.Module) -> torch.Tensor | None:
        """A small input that ``module`` (of this class's float class or a subclass) accepts, or None: what
        :mod:`qdq.nn.subclass` runs a subclass's own ``forward`` on, to see what it computes around the call."""
        return None

    @classmethod
    def set_default_quant_desc_weight(cls, value: QuantDescriptor) -> None:
        """Set the default weight descriptor of this class only."""
        cls.default_quant_desc_weight = copy.deepcopy(_check_desc(value, "quant_desc_weight"))

    def init_quantizer(
        self, quant_desc_input: QuantDescriptor | None = None, quant_desc_weight: QuantDescriptor | None = None
    ) -> None:
        super().init_quantizer(quant_desc_input)
        desc = self.default_quant_desc_weight if quant_desc_weight is None else quant_desc_weight
        self._weight_quantizer = TensorQuantizer(_check_desc(desc, "quant_desc_weight"), role="weight")

    @property
    def weight_quantizer(self) -> TensorQuantizer:
        return self._weight_quantizer

    def quantized_weights(self) -> Iterator[tuple[str, torch.Tensor, TensorQuantizer]]:
        """``(name suffix, weight, its quantizer)`` for each weight this module quantizes: ``("", weight,
        weight quantizer)``; what :func:`qdq.calib.calibrate_weights` calibrates."""
        yield "", self.weight.detach(), self._weight_quantizer  # type: ignore[attr-defined]  # the torch layer's weight

    @classmethod
    def from_float(  # type: ignore[override]  # a weight descriptor where the input-only base takes **_ (ignored)
        cls: type[QW],
        module: nn.Module,
        quant_desc_input: QuantDescriptor | None = None,
        quant_desc_weight: QuantDescriptor | None = None,
    ) -> QW:
        new = _adopt(cls, module)
        new.init_quantizer(quant_desc_input, quant_desc_weight)
        return _quantizers_on_device_of(new, module)


def _hook_groups(model: nn.Module, hook: str) -> list[tuple[type[QuantModule], list[tuple[str, QuantModule]]]]:
    """The quantized modules of ``model`` that override ``hook``, grouped by the implementation they share (in
    model order), each group with the class to call it on."""
    default = getattr(QuantModule, hook).__func__
    groups: dict[Any, tuple[type[QuantModule], list[tuple[str, QuantModule]]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantModule):
            implementation = getattr(type(module), hook).__func__
            if implementation is not default:
                groups.setdefault(implementation, (type(module), []))[1].append((name, module))
    return list(groups.values())


def calibration_started(model: nn.Module) -> None:
    """Run every quantized module's :meth:`QuantModule.start_calibration` (once per implementation)."""
    for cls, modules in _hook_groups(model, "start_calibration"):
        cls.start_calibration(modules)


def calibration_finished(model: nn.Module) -> list[str]:
    """Run every quantized module's :meth:`QuantModule.finish_calibration` (once per implementation); the
    messages to warn the user of, one per implementation that had something to say."""
    messages = [cls.finish_calibration(modules) for cls, modules in _hook_groups(model, "finish_calibration")]
    return [message for message in messages if message is not None]


def _quantizers_on_device_of(new: Q, module: nn.Module) -> Q:
    """``new`` with its quantizers' buffers on the device of ``module``'s first parameter or buffer (a model
    quantized on a GPU keeps its ranges there: the kernels read them on the device)."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    if tensor is not None and tensor.device.type != "cpu":
        for quantizer in new.quantizers().values():
            quantizer.to(tensor.device)
    return new


def _adopt(cls: type[Q], module: nn.Module) -> Q:
    """Instance of ``cls`` carrying ``module``'s state without re-running ``__init__`` (no re-init of weights).

    Parameters and buffers are the same objects (an optimizer built on the float model keeps working);
    the containers are copied so adding quantizers does not alter ``module``.
    """
    if not isinstance(module, nn.Module):
        raise QdqTypeError(f"from_float needs an nn.Module, got {type(module).__name__}.")
    float_cls = float_class_of(cls)
    if not isinstance(module, float_cls):
        raise QdqTypeError(f"{cls.__name__}.from_float converts a {float_cls.__name__}, got a {type(module).__name__}.")
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if isinstance(value, dict | set):
            new.__dict__[name] = value.copy()
    return new


def float_class_of(quant_cls: type) -> type[nn.Module]:
    """The float module class a quantized class replaces: its first non-quant ``nn.Module`` base."""
    for base in quant_cls.__mro__[1:]:
        if issubclass(base, nn.Module) and not issubclass(base, QuantInputMixin):
            return base
    raise QdqTypeError(f"{quant_cls.__name__} does not subclass a torch module.")


_WEIGHT_DEFAULT = "default_quant_desc_weight"  # a QuantMixin's; not read for an input-only class


def pop_quant_desc_in_kwargs(
    quant_cls: type[QuantInputMixin], input_only: bool = False, **kwargs: Any
) -> QuantDescriptor | tuple[QuantDescriptor, QuantDescriptor]:
    """Seed helper: pop ``quant_desc_input`` (and ``quant_desc_weight``) from kwargs, with class defaults.

    Raises:
        QdqTypeError: for any other keyword.
    """
    desc_input: QuantDescriptor = kwargs.pop("quant_desc_input", quant_cls.default_quant_desc_input)
    desc_weight: Any = None if input_only else kwargs.pop("quant_desc_weight", getattr(quant_cls, _WEIGHT_DEFAULT))
    if kwargs:
        raise QdqTypeError(f"Unused keys: {sorted(kwargs)}; only quant_desc_input/quant_desc_weight are accepted.")
    if input_only:
        return desc_input
    return desc_input, desc_weight

"""Quantized classes for subclasses of registered float classes: a convolution whose own ``forward`` pads first.

A subclass is not its base. timm's ``Conv2dSame(nn.Conv2d)`` and efficientnet_pytorch's ``Conv2dDynamicSamePadding``
and ``Conv2dStaticSamePadding`` pad their input (TensorFlow's asymmetric "SAME": amounts computed from the input's
shape, or a ``ZeroPad2d`` made for one image size), then call ``F.conv2d`` with their own weight. Swapping such a
module for ``QuantConv2d`` would drop the padding; leaving it float drops the layer. :func:`resolve` gives, for a
float module, the quantized class that computes what the module's own class computes, or why it stays float:

* its exact class registered (``nn.Conv2d``): the registered quantized class;
* a subclass of a registered class whose quantized class names its
  :attr:`~qdq.nn.base.QuantMixin.weighted_function` (the convolutions), in a class deriving from both (so
  ``isinstance(m, Conv2dSame)`` holds and ``to_float`` gives the subclass back):

  * when it keeps its base's ``forward``: the quantized base's forward;
  * when its own ``forward`` calls the weighted function once, with the module's own weight, on its input as it
    came or padded (with zeros, or copies of its values: ``reflect``, ``replicate``, ``circular``), and returns
    what the call returns: that forward, quantized at the call. The input is quantized as it enters; the forward
    runs under a :class:`torch.overrides.TorchFunctionMode` that reads the call's weight through the weight
    quantizer and the call's padded input again through the input quantizer
    (:meth:`~qdq.quantizer.TensorQuantizer.requantize`: the same values in PyTorch, where the pad's values are on
    the grid already; a second Q/DQ of the same scale in an export, ``Q -> DQ -> Pad -> Q -> DQ -> Conv``, which
    the ``onnxruntime`` rewrite makes an int8 Pad before a ``QLinearConv``). What the forward does is read once,
    when the module is replaced: it runs on a small input (:meth:`~qdq.nn.base.QuantMixin.sample_input`, by its
    shape alone where the forward allows) while its torch calls are recorded;
  * any other ``forward`` (a weight computed from the parameter, as weight standardization does; an activation
    after the call; an input changed otherwise than by padding): float, and why;

* a subclass of another registered class whose ``forward`` is its own, or a lazy module not run yet (its class
  changes on its first forward): float, and why.

A module none of whose classes is registered, or a subclass of another registered class that keeps its base's
``forward``, gets no class and no remark.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.overrides import TorchFunctionMode

from qdq.errors import QdqTypeError
from qdq.nn.base import float_class_of
from qdq.nn.registry import QUANT_MODULES
from qdq.quantizer import TensorQuantizer

__all__ = ["derived_class", "registered_family", "resolve"]

_PADS = (F.pad, torch.constant_pad_nd)
#: pad modes that copy the input's values (on its quantization grid, as the zeros of a constant pad are)
_COPYING_MODES = frozenset({"reflect", "replicate", "circular"})


def registered_family(kind: type) -> type | None:
    """The registered float class ``kind`` is or derives from (the nearest in its MRO), or None."""
    return next((cls for cls in kind.__mro__ if cls in QUANT_MODULES), None)


def resolve(module: nn.Module) -> tuple[type | None, str | None]:
    """``(the quantized class for module, None)``, ``(None, why it stays float)``, or ``(None, None)`` when no class
    of ``module`` is registered (or it keeps the forward of a registered base that quantizes no subclass)."""
    kind = type(module)
    family = registered_family(kind)
    if family is None:
        return None, None
    quant_base = QUANT_MODULES.get(family)
    if family is kind:
        return quant_base, None
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return None, "a lazy module, whose class changes on its first forward: run the model once before quantizing"
    own_forward = cast(Any, kind).forward is not cast(Any, family).forward
    if cast(Any, quant_base).weighted_function is None:
        unknown = f"its forward is not {family.__name__}'s, and qdq knows no quantized version of it"
        return None, unknown if own_forward else None
    if not own_forward:
        return derived_class(kind, through_forward=False), None
    why = _probe(module, quant_base)
    return (None, why) if why else (derived_class(kind, through_forward=True), None)


_DERIVED: dict[tuple[type, type, bool], type] = {}


def derived_class(float_cls: type, *, through_forward: bool) -> type:
    """The quantized class of ``float_cls``, a subclass of a registered class: it derives from the registered
    quantized class and ``float_cls``; with ``through_forward``, its forward is ``float_cls``'s own, quantized at
    the weighted call. One class per float class (made on first use)."""
    family = registered_family(float_cls)
    if family is None or family is float_cls:
        raise QdqTypeError(f"{float_cls.__name__} does not subclass a registered float class.")
    quant_base = QUANT_MODULES.get(family)
    key = (float_cls, quant_base, through_forward)
    if key not in _DERIVED:
        name = f"Quant{float_cls.__name__}"
        mixin = _ThroughForward if through_forward else _Derived
        doc = f"``{float_cls.__module__}.{float_cls.__qualname__}`` quantized as {quant_base.__name__} is."
        namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
        _DERIVED[key] = type(name, (mixin, quant_base, float_cls), namespace)
    return _DERIVED[key]


def _rebuild(float_cls: type, through_forward: bool) -> Any:
    """An empty instance of the derived class of ``float_cls`` (unpickling: the state follows)."""
    cls: Any = derived_class(float_cls, through_forward=through_forward)
    return cls.__new__(cls)


class _Derived:
    """Base of the derived classes: pickled (and deep-copied) by naming their float class, the derived class made
    again on loading."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        through = isinstance(self, _ThroughForward)
        return _rebuild, (float_class_of(type(self)), through), dict(self.__dict__)


class _ThroughForward(_Derived):
    """``forward``: the float subclass's own, its weighted call quantized (input as it enters, weight at the
    call, the padded input read again through the input quantizer at the call)."""

    _input_quantizer: TensorQuantizer
    _weight_quantizer: TensorQuantizer
    weight: torch.Tensor
    weighted_function: ClassVar[Callable[..., torch.Tensor]]

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        quantized = self._input_quantizer(input)
        own_forward = float_class_of(type(self)).forward
        with _QuantizedCall(self, quantized):
            return cast(torch.Tensor, own_forward(self, quantized, *args, **kwargs))


def _operands(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """The input and the weight of a call ``function(input, weight, ...)``."""
    data = args[0] if args else kwargs.get("input")
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return data, weight


def _with_operands(args: Sequence[Any], kwargs: Mapping[str, Any], data: Any, weight: Any) -> tuple[list, dict]:
    """``args`` and ``kwargs`` of such a call with its input and weight replaced."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for position, name, value in ((0, "input", data), (1, "weight", weight)):
        if len(new_args) > position:
            new_args[position] = value
        else:
            new_kwargs[name] = value
    return new_args, new_kwargs


class _QuantizedCall(TorchFunctionMode):
    """Within a forward of ``module``: its weighted call on its own weight reads the weight through the weight
    quantizer, and its input, when it is not ``quantized`` itself (a pad of it), again through the input
    quantizer. Every other call runs as it is."""

    def __init__(self, module: _ThroughForward, quantized: torch.Tensor) -> None:
        super().__init__()
        self.module, self.quantized = module, quantized

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        module = self.module
        if func is module.weighted_function:
            data, weight = _operands(args, kwargs)
            if weight is module.weight:
                if data is not self.quantized:
                    data = module._input_quantizer.requantize(data)
                args, kwargs = _with_operands(args, kwargs, data, module._weight_quantizer(weight))
        return func(*args, **kwargs)


class _Recorder(TorchFunctionMode):
    """Records a forward's calls of ``function`` and which tensors are its input padded (with zeros, or copies of
    its values)."""

    def __init__(self, function: Callable[..., torch.Tensor], weight: torch.Tensor, sample: torch.Tensor) -> None:
        super().__init__()
        self.function, self.weight = function, weight
        self.padded: list[torch.Tensor] = [sample]  # the input and its pads
        #: each call of ``function``: (its input is the forward's or a pad of it, its weight is the parameter, output)
        self.calls: list[tuple[bool, bool, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _PADS and _pads_on_grid(func, args, kwargs) and _among(args[0], self.padded):
            self.padded.append(out)
        elif func is self.function:
            data, weight = _operands(args, kwargs)
            self.calls.append((_among(data, self.padded), weight is self.weight, out))
        return out

    def refusal(self, output: Any) -> str | None:
        """Why the recorded forward cannot be quantized at its call, or None."""
        name = getattr(self.function, "__name__", str(self.function))
        if not any(own for _, own, _ in self.calls):
            if self.calls:
                return f"its forward calls {name} with a weight computed from its parameter, not the parameter"
            return f"its forward calls no {name} on its weight"
        if len(self.calls) > 1:
            return f"its forward calls {name} {len(self.calls)} times"
        from_input, _, out = self.calls[0]
        if not from_input:
            return f"its forward changes its input before {name} otherwise than by padding it (with zeros or copies)"
        if out is not output:
            return f"its forward changes what {name} returns"
        return None


def _among(tensor: Any, tensors: list[torch.Tensor]) -> bool:
    return any(tensor is t for t in tensors)


def _pads_on_grid(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Does the call ``F.pad(x, pads, mode, value)`` / ``torch.constant_pad_nd(x, pads, value)`` write only values on
    the grid of a quantized ``x``: zeros, or copies of its own values?"""
    if func is F.pad:
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
        value = args[3] if len(args) > 3 else kwargs.get("value")
    else:
        mode, value = "constant", args[2] if len(args) > 2 else kwargs.get("value", 0)
    return mode in _COPYING_MODES or (mode == "constant" and (value is None or value == 0))


def _probe(module: nn.Module, quant_base: type) -> str | None:
    """Why ``module``'s own forward cannot be quantized at its weighted call, or None: the forward runs once on
    ``quant_base.sample_input(module)``, without gradients, on a shallow copy (state it sets stays there); on the
    sample's shape alone (the ``meta`` device) first, then, if that fails, on the sample itself."""
    family = cast(Any, quant_base)
    sample = family.sample_input(module)
    if sample is None:
        return f"qdq has no sample input for {quant_base.__name__} to read its forward with"
    try:
        return _recorded_refusal(module, family.weighted_function, sample.to("meta"))
    except Exception:  # a forward that reads its input's values
        pass
    try:
        return _recorded_refusal(module, family.weighted_function, sample)
    except Exception as err:  # a forward that needs more than one tensor, or another shape
        return f"its forward failed on a sample input {tuple(sample.shape)} ({type(err).__name__}: {err})"


def _recorded_refusal(module: nn.Module, function: Callable[..., torch.Tensor], sample: torch.Tensor) -> str | None:
    """Run ``module``'s forward on ``sample`` while recording its calls; why it cannot be quantized, or None."""
    recorder = _Recorder(function, cast(torch.Tensor, module.weight), sample)
    with torch.no_grad(), recorder:
        output = type(module).forward(_shallow_copy(module), sample)
    return recorder.refusal(output)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """``module``'s class and state, parameters shared, its own containers (so a forward that sets a submodule or
    a buffer leaves ``module`` as it was)."""
    clone = copy.copy(module)
    for name, value in module.__dict__.items():
        if isinstance(value, dict | set | list):
            clone.__dict__[name] = copy.copy(value)
    return clone

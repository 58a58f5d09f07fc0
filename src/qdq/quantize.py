"""``quantize_model``: the entry point that makes a float model a quantized one for a target runtime.

Two steps, one call::

    model = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))

1. module replacement (:func:`qdq.replace.replace_modules`): registered float modules become quantized ones,
   in place, sharing their parameters;
2. with ``config.target``, Q/DQ placement for that runtime (:func:`qdq.placement.apply_placement`), which may
   build a new ``torch.fx.GraphModule``.

The contract: **always use the returned model**. Without a target it is the model passed in (or the
quantized module when that model is itself a single registered module); with a target it may be a new
object, and then the model passed in is marked stale: running or exporting it raises an error that says to
use the returned model (it lacks the quantizers placement added). The returned model remembers its target;
:func:`qdq.export.export_onnx` defaults to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantModule
from qdq.placement import apply_placement
from qdq.quantizer import TensorQuantizer
from qdq.replace import ModuleFilter, Pattern, replace_modules
from qdq.targets import Target, resolve_target
from qdq.targets.marks import check_not_superseded, placed_target

__all__ = ["QuantConfig", "quantize_model"]


@dataclass(frozen=True)
class QuantConfig:
    """What ``quantize_model`` quantizes, and how.

    Attributes:
        quant_desc_input: descriptor of every input quantizer; None uses each class's default
            (8-bit per tensor).
        quant_desc_weight: descriptor of every weight quantizer; None uses each class's default
            (8-bit per output channel).
        include: module-name patterns (``fnmatch`` globs such as ``"layer1.*"``, or ``"re:<regex>"``);
            empty means every module.
        exclude: module-name patterns left in float (wins over ``include``).
        include_types: float module types to quantize; empty means every registered type except
            MaxPool and InstanceNorm (the seed's default set).
        exclude_types: float module types left in float.
        target: a registered target's name (:mod:`qdq.targets`: ``"tensorrt"``, ``"onnxruntime"``) or a
            :class:`~qdq.targets.Target` also places Q/DQ
            for that runtime after the module swap (residual adds, concats, and for ONNX Runtime conv
            outputs; see :mod:`qdq.placement`). None (default) swaps modules only.
        target_options: the target's export options the model is made for, remembered by the model
            (:func:`qdq.export.export_onnx` uses them unless its call overrides them). ``"tensorrt"``:
            ``{"float": "float16"}`` for TensorRT 11 files whose float part computes in FP16; the quantizers
            then use float16 steps (:attr:`~qdq.quantizer.TensorQuantizer.step_type`), so the model quantizes
            exactly like the file. ``"onnxruntime"``: ``{"weights": "uint8"}``. Needs ``target``.
    """

    quant_desc_input: QuantDescriptor | None = None
    quant_desc_weight: QuantDescriptor | None = None
    include: tuple[Pattern, ...] = ()
    exclude: tuple[Pattern, ...] = ()
    include_types: tuple[type, ...] = ()
    exclude_types: tuple[type, ...] = field(default=())
    target: str | Target | None = None
    target_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        selection = self.module_filter  # normalizes and checks the patterns
        for name in ("include", "exclude", "include_types", "exclude_types"):
            object.__setattr__(self, name, getattr(selection, name))
        for desc_name in ("quant_desc_input", "quant_desc_weight"):
            desc = getattr(self, desc_name)
            if desc is not None and not isinstance(desc, QuantDescriptor):
                raise QdqTypeError(f"{desc_name} must be a QuantDescriptor or None, got {type(desc).__name__}.")
        if self.target is not None:
            resolve_target(self.target)  # unknown names raise, listing the registered targets
        if self.target_options:
            if self.target is None:
                raise QdqConfigError("target_options need a target: QuantConfig(target=..., target_options=...).")
            target = resolve_target(self.target)
            target.check_options(self.target_options)
            target.step_float_type(self.target_options)  # an unknown float type raises here, not at placement
            object.__setattr__(self, "target_options", MappingProxyType(dict(self.target_options)))

    @property
    def module_filter(self) -> ModuleFilter:
        """The module selection part of the config."""
        return ModuleFilter(self.include, self.exclude, self.include_types, self.exclude_types)

    def selects(self, name: str, module: nn.Module) -> bool:
        """True when ``module`` (called ``name`` in the model) should be quantized."""
        return self.module_filter.selects(name, module)


def quantize_model(model: nn.Module, config: QuantConfig | None = None) -> nn.Module:
    """Quantize ``model``'s registered modules and, with ``config.target``, place Q/DQ for that runtime.

    Always use the returned model: ``model = qdq.quantize_model(model, config)``.

    Args:
        model: a float model, already built (weights loaded or not).
        config: what to quantize; default: every conv, transposed conv, linear, avg-pool and LSTM with the
            classes' default descriptors, no placement.

    Returns:
        The model to use: ``model`` itself with its modules replaced in place (or the quantized module when
        ``model`` is itself a single registered module); with a target, the placed model, which remembers
        its target. When placement built a new model, ``model`` is marked stale: running or exporting it
        raises :class:`~qdq.errors.QdqConfigError` / :class:`~qdq.errors.QdqExportError`.

    Raises:
        QdqConfigError: the config's patterns or types select nothing in the model, ``model`` is stale, or it
            already holds quantized modules (quantized before, or parts of it: quantize the float model once).
    """
    config = QuantConfig() if config is None else config
    if not isinstance(config, QuantConfig):
        raise QdqTypeError(f"config must be a qdq.QuantConfig or None, got {type(config).__name__}.")
    if not isinstance(model, nn.Module):
        raise QdqTypeError(f"quantize_model needs an nn.Module, got {type(model).__name__}.")
    check_not_superseded(model)
    _check_float(model)
    quantized = replace_modules(model, config.module_filter, config.quant_desc_input, config.quant_desc_weight)
    if config.target is not None:
        quantized = apply_placement(
            quantized,
            target=resolve_target(config.target),
            quant_desc=config.quant_desc_input,
            target_options=config.target_options,
        )
    return _quantizers_beside_parameters(_quantizers_in_their_modules_mode(quantized))


def _quantizers_in_their_modules_mode(model: nn.Module) -> nn.Module:
    """``model`` with every quantizer in the train/eval mode of the module holding it (a new module starts in
    training mode; the model keeps the modes it came with, module by module)."""
    for module in model.modules():
        for child in module.children():
            if isinstance(child, TensorQuantizer):
                child.training = module.training
    return model


def _check_float(model: nn.Module) -> None:
    """Refuse a model that already holds quantized modules: quantizing it again would mix two placements. Attention
    captured before (``capture_hf_attention``, ``replace_sdpa_calls``: placement's own first step) is welcome."""
    found = [name for name, module in model.named_modules()
             if isinstance(module, QuantModule) and not isinstance(module, QuantScaledDotProductAttention)]  # fmt: skip
    if not found:
        return
    target = placed_target(model)
    held = f"placed for target {target!r}" if target is not None else "quantized"
    raise QdqConfigError(
        f"quantize_model takes a float model, but this one is already {held}: it holds {len(found)} quantized "
        f"module(s) (first: {found[0] or type(model).__name__!r}). Quantize the float model once, with everything in "
        "one QuantConfig; to place an already quantized model for a target, call "
        "qdq.placement.apply_placement(model, target) instead."
    )


def _quantizers_beside_parameters(model: nn.Module) -> nn.Module:
    """``model`` with every quantizer on the device of its first parameter: a model quantized on a GPU keeps
    its ranges there (placement adds quantizers built on the CPU; the kernels read ranges on the device)."""
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type not in ("cpu", "meta"):
        for module in model.modules():
            if isinstance(module, TensorQuantizer):
                module.to(parameter.device)
    return model

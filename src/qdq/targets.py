"""Export targets: one registration per runtime a model is quantized for.

A :class:`Target` holds everything qdq knows about one runtime's int8 execution:

* ``name``: what users pass as ``QuantConfig(target=...)``, ``apply_placement(target=...)`` and
  ``export_onnx(target=...)``;
* ``placement_rules``: the :mod:`qdq.placement` rules applied, in order, and ``residual_add``: which inputs
  of an add that follows a weighted op get quantized (``"skip"``: the other input only, ``"both"``);
* ``onnx_rewrite``: the rewrite of the exported Q/DQ graph for that runtime (``"module:function"``, imported
  when first used, or a callable ``rewrite(model: onnx.ModelProto) -> dict[str, int]``), or None;
* ``fusion``: which ONNX op groups the runtime turns into int8 kernels (:class:`FusionFacts`), read by the
  placement rules, the ONNX rewrite and :mod:`qdq.runtime.fusion`; None when qdq has no such facts.

Adding a target is one call, ``register_target(Target(...))``. Registered here:

* ``"tensorrt"``: TensorRT's explicit-quantization rules (Q/DQ on the inputs of weighted ops, the skip input
  of residual adds, one scale per concat); the same graph runs in u8 on OpenVINO.
* ``"onnxruntime"``: ONNX Runtime's CPU int8 kernels (quantized conv outputs, both add inputs, unsigned
  post-ReLU ranges, the graph rewritten by :mod:`qdq.export.ort_target`).

A model placed for a target remembers it (:func:`placed_target`); :func:`qdq.export.export_onnx` defaults to
it. A model that placement replaced by a new one is marked stale (:func:`mark_superseded`): running or
exporting it raises, since it lacks the quantizers the returned model carries.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.registry import Registry

__all__ = [
    "DEFAULT_TARGET",
    "ONNXRUNTIME_FUSION",
    "TARGET_REGISTRY",
    "FusionFacts",
    "Target",
    "add_placement_rule",
    "check_not_superseded",
    "get_target",
    "mark_placed",
    "mark_superseded",
    "placed_target",
    "register_target",
    "remove_placement_rule",
    "superseded_by",
    "target_names",
    "unregister_target",
]

_RESIDUAL_MODES = ("skip", "both")
_TARGET_ATTR = "_qdq_target"  # set on a placed model: the target's name
_SUPERSEDED_ATTR = "_qdq_superseded"  # set on a model placement replaced: the target's name


@dataclass(frozen=True)
class FusionFacts:
    """How a runtime turns ``DequantizeLinear -> op -> QuantizeLinear`` groups into int8 kernels (ONNX op types).

    Attributes:
        int8_forms: float op -> ``(int8 kernel, indices of the inputs that must be dequantized)``; None
            means every input. The op's output must be read by a QuantizeLinear.
        int8_kernels: kernels that compute a Conv/Gemm/MatMul on integer data.
        float_kernels: kernels a weighted op runs in when it is not fused (fused variants included).
        folded_activations: activations dropped between an int8 op and its QuantizeLinear when that Q's zero
            point is its type's minimum (asymmetric, e.g. uint8 with zero point 0).
        int8_data_movers: ops run on int8 data directly when the DQ before and the Q after share parameters.
        layout_ops: ops that only move data (the runtime adds them around its kernels); graph walks look
            through them.
    """

    int8_forms: Mapping[str, tuple[str, tuple[int, ...] | None]]
    int8_kernels: frozenset[str]
    float_kernels: frozenset[str]
    folded_activations: frozenset[str]
    int8_data_movers: frozenset[str] = frozenset()
    layout_ops: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "int8_forms", MappingProxyType(dict(self.int8_forms)))

    def fuses(self, op_type: str) -> bool:
        """Does the runtime have an int8 kernel for ``op_type`` between DQ and Q?"""
        return op_type in self.int8_forms

    def dequantized_inputs(self, op_type: str, n_inputs: int) -> tuple[int, ...]:
        """Indices of the inputs of an ``op_type`` node (with ``n_inputs`` inputs) that must be dequantized."""
        _, indices = self.int8_forms[op_type]
        return tuple(range(n_inputs)) if indices is None else tuple(i for i in indices if i < n_inputs)


@dataclass(frozen=True)
class Target:
    """One runtime a model can be quantized and exported for (see the module docstring)."""

    name: str
    description: str = ""
    placement_rules: tuple[str, ...] = ()
    residual_add: str = "skip"
    onnx_rewrite: str | Callable[[Any], dict[str, int]] | None = None
    fusion: FusionFacts | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a target name is a non-empty string, got {self.name!r}.")
        object.__setattr__(self, "placement_rules", tuple(self.placement_rules))
        if not all(isinstance(rule, str) for rule in self.placement_rules):
            raise QdqTypeError(f"target {self.name!r}: placement_rules are rule names (strings).")
        if self.residual_add not in _RESIDUAL_MODES:
            raise QdqConfigError(f"target {self.name!r}: residual_add must be one of {_RESIDUAL_MODES}.")
        rewrite = self.onnx_rewrite
        if isinstance(rewrite, str) and ":" not in rewrite:
            raise QdqConfigError(f"target {self.name!r}: onnx_rewrite {rewrite!r} must read 'module:function'.")
        if rewrite is not None and not isinstance(rewrite, str) and not callable(rewrite):
            raise QdqTypeError(f"target {self.name!r}: onnx_rewrite must be 'module:function' or a callable.")
        if self.fusion is not None and not isinstance(self.fusion, FusionFacts):
            raise QdqTypeError(f"target {self.name!r}: fusion must be a FusionFacts or None.")

    def rewrite_onnx(self, model: Any, **options: Any) -> dict[str, int]:
        """Apply the target's ONNX rewrite to ``model`` (an ``onnx.ModelProto``) in place; counts of edits.

        ``options`` are the rewrite's keyword options (``"onnxruntime"``: ``weights``); one it does not take
        raises ``QdqConfigError`` naming those it does.
        """
        if self.onnx_rewrite is None:
            if options:
                raise QdqConfigError(f"target {self.name!r} has no ONNX rewrite, so no options: {sorted(options)}.")
            return {}
        rewrite = self.onnx_rewrite
        if isinstance(rewrite, str):
            module, _, function = rewrite.partition(":")
            rewrite = getattr(importlib.import_module(module), function)
        _check_options(self.name, rewrite, options)
        return rewrite(model, **options)

    def require_fusion(self) -> FusionFacts:
        """The target's fusion facts; raises when it has none."""
        if self.fusion is None:
            raise QdqConfigError(f"target {self.name!r} records no fusion facts.")
        return self.fusion


def _check_options(target: str, rewrite: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Refuse options the rewrite function has no keyword-only parameter for."""
    if not options:
        return
    accepted = [p.name for p in inspect.signature(rewrite).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise QdqConfigError(
            f"target {target!r} takes the export options {accepted or 'none'}; got unknown {unknown}."
            f"{did_you_mean(unknown[0], accepted)}"
        )


_ORT_INT8_KERNELS = {"QLinearConv", "ConvInteger", "QGemm", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat",
                     "DynamicQuantizeMatMul", "MatMulInteger16", "QAttention"}  # fmt: skip
_ORT_FLOAT_KERNELS = {"Conv", "FusedConv", "NhwcFusedConv", "ConvTranspose", "ConvTransposeWithDynamicPads", "Gemm",
                      "FusedGemm", "MatMul", "FusedMatMul", "TransposeMatMul"}  # fmt: skip
_ORT_LAYOUT_OPS = {"Transpose", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "ReorderInput",
                   "ReorderOutput"}  # fmt: skip

#: ONNX Runtime's CPU provider (read from onnxruntime 1.31's optimized graphs): its int8 kernels.
ONNXRUNTIME_FUSION = FusionFacts(
    int8_forms={
        "Conv": ("QLinearConv", (0, 1)),
        "FusedConv": ("QLinearConv", (0, 1)),
        "Gemm": ("QGemm", (0, 1)),
        "FusedGemm": ("QGemm", (0, 1)),
        "MatMul": ("QLinearMatMul", (0, 1)),
        "FusedMatMul": ("QLinearMatMul", (0, 1)),
        "Add": ("QLinearAdd", (0, 1)),
        "Mul": ("QLinearMul", (0, 1)),
        "Concat": ("QLinearConcat", None),
        "Sigmoid": ("QLinearSigmoid", (0,)),
        "LeakyRelu": ("QLinearLeakyRelu", (0,)),
        "Softmax": ("QLinearSoftmax", (0,)),
        "GlobalAveragePool": ("QLinearGlobalAveragePool", (0,)),
        "AveragePool": ("QLinearAveragePool", (0,)),
        "Where": ("QLinearWhere", (1, 2)),
    },
    int8_kernels=frozenset(_ORT_INT8_KERNELS),
    float_kernels=frozenset(_ORT_FLOAT_KERNELS),
    folded_activations=frozenset({"Relu", "Clip"}),
    int8_data_movers=frozenset({"MaxPool", "Resize", "Slice", "Gather", "Split", "Pad", "DepthToSpace"}),
    layout_ops=frozenset(_ORT_LAYOUT_OPS),
)

#: name -> Target.
TARGET_REGISTRY: Registry[str, Target] = Registry("target")
#: The target of ``apply_placement`` and of ``export_onnx`` for a model never placed.
DEFAULT_TARGET = "tensorrt"


def register_target(target: Target, *, override: bool = False) -> Target:
    """Register ``target`` under its name (``override=True`` replaces a registered one)."""
    if not isinstance(target, Target):
        raise QdqTypeError(f"register_target needs a qdq.targets.Target, got {type(target).__name__}.")
    return TARGET_REGISTRY.register(target.name, target, override=override)


def unregister_target(name: str) -> Target:
    """Remove a target; returns it."""
    return TARGET_REGISTRY.unregister(name)


def get_target(name: str) -> Target:
    """The registered target ``name``; an unknown name raises ``QdqConfigError`` listing the registered ones."""
    if not isinstance(name, str):
        raise QdqTypeError(f"a target is named by a string, got {type(name).__name__} {name!r}.")
    return TARGET_REGISTRY.get(name)


def target_names() -> tuple[str, ...]:
    """Names of the registered targets, in registration order."""
    return tuple(TARGET_REGISTRY)


def add_placement_rule(rule: str, targets: Iterable[str] | None = None) -> None:
    """Append the placement rule ``rule`` to ``targets`` (default: every registered target)."""
    names = target_names() if targets is None else tuple(targets)
    chosen = [get_target(name) for name in names]  # unknown names raise before anything changes
    for target in chosen:
        if rule not in target.placement_rules:
            rules = (*target.placement_rules, rule)
            TARGET_REGISTRY.register(target.name, dataclasses.replace(target, placement_rules=rules), override=True)


def remove_placement_rule(rule: str) -> None:
    """Remove the placement rule ``rule`` from every target that applies it."""
    for name, target in TARGET_REGISTRY.items():
        if rule in target.placement_rules:
            rules = tuple(r for r in target.placement_rules if r != rule)
            TARGET_REGISTRY.register(name, dataclasses.replace(target, placement_rules=rules), override=True)


_ORT_RULES = ("residual_add", "concat", "conv_output", "silu", "sigmoid_output", "mul_inputs", "unsigned_activations")

register_target(
    Target(
        name="tensorrt",
        description="TensorRT explicit quantization (the same graph runs in u8 on OpenVINO)",
        placement_rules=("residual_add", "concat"),
        residual_add="skip",
    )
)
register_target(
    Target(
        name="onnxruntime",
        description="ONNX Runtime CPU int8 kernels (QLinearConv, QGemm, QLinearAdd, ...)",
        placement_rules=_ORT_RULES,
        residual_add="both",
        onnx_rewrite="qdq.export.ort_target:rewrite_for_onnxruntime",
        fusion=ONNXRUNTIME_FUSION,
    )
)


# ------------------------------------------------------------------------------ remembered target
def mark_placed(model: Any, target: str) -> None:
    """Record on ``model`` (an ``nn.Module``) that it was placed for ``target`` (kept by ``copy.deepcopy`` and
    pickling, ``torch.fx.GraphModule`` included)."""
    get_target(target)
    _set_mark(model, _TARGET_ATTR, target)


def placed_target(model: Any) -> str | None:
    """The target ``model`` was placed for: its own mark, else the one mark found on its submodules (a placed
    model inside a wrapper); None when it was never placed.

    Raises:
        QdqConfigError: submodules placed for different targets.
    """
    own = _mark(model, _TARGET_ATTR)
    if own is not None:
        return own
    found = {mark for m in _modules(model) if (mark := _mark(m, _TARGET_ATTR)) is not None}
    if len(found) > 1:
        raise QdqConfigError(f"parts of this model were placed for different targets: {sorted(found)}.")
    return found.pop() if found else None


def mark_superseded(model: Any, target: str) -> None:
    """Mark ``model`` as replaced by the new model placement returned for ``target``: running it raises
    ``QdqConfigError`` (it lacks the added quantizers), and :func:`check_not_superseded` fails on it."""
    _set_mark(model, _SUPERSEDED_ATTR, target)
    if hasattr(model, "register_forward_pre_hook"):
        model.register_forward_pre_hook(_refuse_forward)


def superseded_by(model: Any) -> str | None:
    """The target of the placement that replaced ``model`` (or one of its submodules) by a new model, else None."""
    for module in (model, *_modules(model)):
        target = _mark(module, _SUPERSEDED_ATTR)
        if target is not None:
            return target
    return None


def check_not_superseded(model: Any, error: type[Exception] = QdqConfigError) -> None:
    """Raise ``error`` when ``model`` was replaced by the model placement returned (see :func:`mark_superseded`)."""
    target = superseded_by(model)
    if target is not None:
        raise error(_stale_message(target))


def _stale_message(target: str) -> str:
    return (
        f"This model was placed for target {target!r} into a new model, which carries the quantizers "
        f"{target} needs; this one lacks them. Use the model returned by quantize_model "
        f"(model = qdq.quantize_model(model, qdq.QuantConfig(target={target!r}))) or by apply_placement."
    )


def _refuse_forward(module: Any, args: Any) -> None:
    raise QdqConfigError(_stale_message(_mark(module, _SUPERSEDED_ATTR) or "?"))


def _modules(model: Any) -> list[Any]:
    return list(model.modules()) if hasattr(model, "modules") else []


def _set_mark(model: Any, key: str, value: str) -> None:
    """An attribute; on a ``torch.fx.GraphModule`` also its ``meta`` dict, which its ``__deepcopy__`` keeps."""
    setattr(model, key, value)
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict) and "_graph" in vars(model):  # a GraphModule
        meta[key] = value


def _mark(model: Any, key: str) -> str | None:
    value = getattr(model, key, None)
    meta = getattr(model, "meta", None)
    if value is None and isinstance(meta, dict) and "_graph" in vars(model):
        value = meta.get(key)
    return value

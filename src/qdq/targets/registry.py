"""The registered targets, by name: what ``QuantConfig(target="onnxruntime")`` and the ``qdq.target`` entry of
an exported file resolve to.

The entry points (:func:`qdq.quantize_model`, :func:`qdq.placement.apply_placement`,
:func:`qdq.export.export_onnx`, :func:`qdq.keras.quantize_model`, the runtimes) turn a name into a
:class:`~qdq.targets.target.Target` here, once, and pass the object on. Adding a target is one call,
``register_target(Target(...))``, from anywhere: nothing in qdq needs editing.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TypeVar

from qdq.errors import QdqTypeError
from qdq.registry import Registry
from qdq.runtime_registry import RuntimeEntry
from qdq.targets.rules import PLACEMENT_RULES, PlacementRule
from qdq.targets.target import Target

__all__ = [
    "CPU_DEFAULT_TARGET",
    "DEFAULT_TARGET",
    "TARGET_REGISTRY",
    "add_placement_rule",
    "get_target",
    "native_fact",
    "native_targets",
    "register_target",
    "remove_placement_rule",
    "resolve_target",
    "target_names",
    "unregister_target",
]

T = TypeVar("T")

#: name -> Target.
TARGET_REGISTRY: Registry[str, Target] = Registry("target")
#: The Python API's default target (``apply_placement``, ``quantize_onnx``, ``export_onnx`` of a model never
#: placed): TensorRT, the seed toolkit's, so a ported pytorch-quantization script exports the graph it exported.
DEFAULT_TARGET = "tensorrt"
#: The default target of the ``qdq`` command and of ``tune``, which calibrate, run and time on this machine:
#: ONNX Runtime's, whose int8 kernels run on any CPU with the runtime qdq installs (TensorRT needs an NVIDIA GPU).
CPU_DEFAULT_TARGET = "onnxruntime"


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


def resolve_target(target: str | Target) -> Target:
    """``target`` itself when it is a :class:`Target`, else the registered target of that name."""
    return target if isinstance(target, Target) else get_target(target)


def target_names() -> tuple[str, ...]:
    """Names of the registered targets, in registration order."""
    return tuple(TARGET_REGISTRY)


def native_targets(runtime: str | RuntimeEntry) -> tuple[Target, ...]:
    """The registered targets made for ``runtime`` (their :class:`~qdq.targets.RuntimeSupport` verdict for it is
    ``"native"``), in registration order: whose facts (fusion, rule check, weight encoding) describe that runtime."""
    found = []
    for _, target in TARGET_REGISTRY.items():
        support = target.support(runtime)
        if support is not None and support.verdict == "native":
            found.append(target)
    return tuple(found)


def native_fact(runtime: str | RuntimeEntry, fact: Callable[[Target], T | None]) -> T | None:
    """``fact(target)`` of the first registered target made for ``runtime`` (:func:`native_targets`) that records
    one, e.g. ``native_fact("onnxruntime", lambda t: t.fusion)``; None when none does."""
    return next((found for target in native_targets(runtime) if (found := fact(target)) is not None), None)


def add_placement_rule(rule: str | PlacementRule, targets: Iterable[str] | None = None) -> None:
    """Append the rule (or the registered rule of that name) to ``targets`` (default: every registered target)."""
    found = PLACEMENT_RULES.get(rule) if isinstance(rule, str) else rule
    names = target_names() if targets is None else tuple(targets)
    chosen = [get_target(name) for name in names]  # unknown names raise before anything changes
    for target in chosen:
        if found.name not in target.rule_names:
            rules = (*target.placement_rules, found)
            TARGET_REGISTRY.register(target.name, dataclasses.replace(target, placement_rules=rules), override=True)


def remove_placement_rule(rule: str) -> None:
    """Remove the rule named ``rule`` from every target that applies it."""
    for name, target in TARGET_REGISTRY.items():
        if rule in target.rule_names:
            rules = tuple(r for r in target.placement_rules if r.name != rule)
            TARGET_REGISTRY.register(name, dataclasses.replace(target, placement_rules=rules), override=True)

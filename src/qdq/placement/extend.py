"""Extending placement from outside qdq: register a PyTorch rule on targets, or build the common one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from qdq.errors import QdqTypeError
from qdq.graphs.fx import PlacementContext
from qdq.targets import (
    PLACEMENT_RULES,
    PlacementRule,
    add_placement_rule,
    get_target,
    register_rule,
    remove_placement_rule,
    target_names,
)

__all__ = ["function_inputs_rule", "placement_rules", "register_placement_rule", "unregister_placement_rule"]

Rule = Callable[[PlacementContext], None]


def register_placement_rule(
    name: str, rule: Rule | None = None, *, targets: Sequence[str] | None = None, override: bool = False
) -> Any:
    """Register a PyTorch placement rule ``rule(ctx: PlacementContext) -> None`` and append it to the rules of
    ``targets`` (default: every registered target); usable as a decorator.

    The rule is PyTorch-only (:class:`qdq.targets.PlacementRule` with ``torch=rule``): a Keras model quantized
    for those targets is left as it was. To give a rule a Keras form too, build the ``PlacementRule`` yourself
    and list it in a target (``register_target(Target(..., placement_rules=(...)))``).

    Example:
        >>> @register_placement_rule("my_mul", targets=("tensorrt",))  # doctest: +SKIP
        ... def quantize_mul(ctx):
        ...     for node in list(ctx.graph_module.graph.nodes):
        ...         if node.target is operator.mul:
        ...             ctx.quantize_input(node, 0)
    """
    chosen = target_names() if targets is None else tuple(targets)
    for target in chosen:
        get_target(target)  # unknown names raise before anything is registered

    def _register(fn: Rule) -> Rule:
        if not callable(fn):
            raise QdqTypeError(f"a placement rule must be callable, got {fn!r}.")
        register_rule(PlacementRule(name, torch=fn, description=(fn.__doc__ or "").strip()), override=override)
        add_placement_rule(name, chosen)
        return fn

    return _register if rule is None else _register(rule)


def unregister_placement_rule(name: str) -> Rule | None:
    """Remove a rule, and remove it from every target's rules; returns its PyTorch function."""
    rule = PLACEMENT_RULES.unregister(name)
    remove_placement_rule(name)
    return rule.torch


def placement_rules(target: str) -> list[str]:
    """Names of the rules applied for ``target``, in order."""
    return list(get_target(target).rule_names)


def function_inputs_rule(functions: Iterable[Any], indices: Sequence[int] | None = None) -> Rule:
    """A rule quantizing the tensor inputs ``indices`` (default: all) of every call to ``functions``.

    ``functions`` may hold callables (``operator.mul``, ``torch.matmul``) or method names (``"mul"``). The
    seed TF toolkit's EfficientNet case, for example, quantizes both inputs of the squeeze-excitation
    multiply: ``register_placement_rule("se_mul", function_inputs_rule([operator.mul]))``.
    """
    wanted = list(functions)

    def rule(ctx: PlacementContext) -> None:
        for node in list(ctx.graph_module.graph.nodes):
            if node.op not in ("call_function", "call_method") or node.target not in wanted:
                continue
            for index in indices if indices is not None else range(len(node.args)):
                if index < len(node.args) and ctx.is_tensor(node.args[index]):
                    ctx.quantize_input(node, index)

    return rule

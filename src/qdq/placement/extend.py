"""Extending placement from outside qdq: register a rule on targets, or build the common one."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.graphs import fx_ops
from qdq.graphs.view import GraphView
from qdq.targets import PlacementRule, get_target, target_names
from qdq.targets.registry import add_placement_rule, remove_placement_rule
from qdq.targets.rules import PLACEMENT_RULES, register_rule

__all__ = [
    "function_inputs_rule",
    "op_inputs_rule",
    "placement_rules",
    "register_placement_rule",
    "unregister_placement_rule",
]

Rule = Callable[[GraphView], None]


def register_placement_rule(
    name: str, rule: Rule | None = None, *, targets: Sequence[str] | None = None, override: bool = False
) -> Any:
    """Register a placement rule ``rule(view: GraphView) -> None`` and append it to the rules of ``targets``
    (default: every registered target); usable as a decorator.

    The rule decides on the front-end-neutral view (:mod:`qdq.graphs.view`), so it runs for PyTorch, Keras and
    ONNX models quantized for those targets alike.

    Example:
        >>> @register_placement_rule("my_mul", targets=("tensorrt",))  # doctest: +SKIP
        ... def quantize_products(view):
        ...     for mul in view.ops_of("Mul"):
        ...         view.quantize_input(mul, 0, "my accelerator's product reads int8")
    """
    chosen = target_names() if targets is None else tuple(targets)
    for target in chosen:
        get_target(target)  # unknown names raise before anything is registered

    def _register(fn: Rule) -> Rule:
        if not callable(fn):
            raise QdqTypeError(f"a placement rule must be callable, got {fn!r}.")
        register_rule(PlacementRule(name, fn, (fn.__doc__ or "").strip()), override=override)
        add_placement_rule(name, chosen)
        return fn

    return _register if rule is None else _register(rule)


def unregister_placement_rule(name: str) -> Rule:
    """Remove a rule, and remove it from every target's rules; returns its function."""
    rule = PLACEMENT_RULES.unregister(name)
    remove_placement_rule(name)
    return rule.decide


def placement_rules(target: str) -> list[str]:
    """Names of the rules applied for ``target``, in order."""
    return list(get_target(target).rule_names)


def op_inputs_rule(op_types: Iterable[str], indices: Sequence[int] | None = None) -> Rule:
    """A rule quantizing the data inputs ``indices`` (default: all) of every op of ``op_types`` (ONNX names:
    ``"Mul"``, ``"MatMul"``). The seed TF toolkit's EfficientNet case, for example, quantizes both inputs of the
    squeeze-excitation product: ``register_placement_rule("se_mul", op_inputs_rule(["Mul"]))``."""
    wanted = tuple(op_types)

    def rule(view: GraphView) -> None:
        for op in view.ops_of(*wanted):
            for position, (index, _) in enumerate(op.data_inputs):
                if indices is None or position in indices:
                    view.quantize_input(op, index, f"inputs of every {op.type}")

    return rule


def function_inputs_rule(functions: Iterable[Any], indices: Sequence[int] | None = None) -> Rule:
    """:func:`op_inputs_rule` for the ops that these torch callables (``operator.mul``, ``torch.matmul``) or
    tensor method names (``"mul"``) export to.

    Raises:
        QdqConfigError: a function whose ONNX op qdq does not know.
    """
    types = []
    for function in functions:
        found = fx_ops.function_type(function)
        if found is None:
            raise QdqConfigError(
                f"function_inputs_rule: qdq does not know which ONNX op {function!r} exports to; name the op type "
                "with op_inputs_rule(['Mul', ...]) instead."
            )
        types.append(found)
    return op_inputs_rule(types, indices)

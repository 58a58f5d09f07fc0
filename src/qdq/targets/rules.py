"""A placement rule: one decision about where Q/DQ go, implemented for each front end that supports it.

A target lists its rules (:attr:`qdq.targets.Target.placement_rules`); each is a :class:`PlacementRule`:

* ``torch``: ``rule(ctx: qdq.graphs.fx.PlacementContext) -> None``, run by :func:`qdq.placement.apply_placement`
  on the ``torch.fx`` graph of a quantized model;
* ``keras``: ``rule(ctx: qdq.graphs.keras.KerasPlacement) -> None``, run by :func:`qdq.keras.quantize_model` on
  the Keras layer graph's per-layer plans.

A front end runs the rules that have an implementation for it and skips the others (a rule that is
PyTorch-only, like every rule :func:`qdq.placement.register_placement_rule` registers, leaves a Keras model
as it is). Both implementations of one rule have one meaning, stated in the rule's ``description``.

Rules have names, in :data:`PLACEMENT_RULES`, so that a target can be written with rule names and
``apply_placement(rules=[...])`` can name a subset.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qdq.errors import QdqTypeError
from qdq.registry import Registry

__all__ = ["FRONTENDS", "PLACEMENT_RULES", "PlacementRule", "register_rule"]

#: The front ends a rule can be implemented for.
FRONTENDS = ("torch", "keras")


@dataclass(frozen=True)
class PlacementRule:
    """One placement rule.

    Attributes:
        name: its name (unique in :data:`PLACEMENT_RULES`).
        torch: its PyTorch implementation, ``rule(ctx: PlacementContext) -> None``, or None.
        keras: its Keras implementation, ``rule(ctx: KerasPlacement) -> None``, or None.
        description: what it decides and why, one or two sentences.
        keras_stage: when Keras runs it: 0 before the rules that read which inputs are already quantized
            (conv outputs), 1 those (merging rules), 2 after them (rules that adjust quantizers: unsigned).
            PyTorch runs a target's rules in the target's order.
        separates_activations: on Keras, a conv's own activation the target cannot fold into its int8 conv
            (not in ``fusion.folded_activations``) is first moved into an ``Activation`` layer after the conv,
            so that this rule can quantize between the two.
    """

    name: str
    torch: Callable[[Any], None] | None = None
    keras: Callable[[Any], None] | None = None
    description: str = ""
    keras_stage: int = 1
    separates_activations: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a placement rule's name is a non-empty string, got {self.name!r}.")
        for frontend in FRONTENDS:
            fn = getattr(self, frontend)
            if fn is not None and not callable(fn):
                raise QdqTypeError(f"placement rule {self.name!r}: its {frontend} implementation must be callable.")

    @property
    def frontends(self) -> tuple[str, ...]:
        """The front ends this rule is implemented for."""
        return tuple(f for f in FRONTENDS if getattr(self, f) is not None)

    def supports(self, frontend: str) -> bool:
        return getattr(self, frontend, None) is not None


#: name -> rule: the built-in rules (registered by the target packages) and the ones users register.
PLACEMENT_RULES: Registry[str, PlacementRule] = Registry("placement rule")


def register_rule(rule: PlacementRule, *, override: bool = False) -> PlacementRule:
    """Register ``rule`` under its name; returns it."""
    if not isinstance(rule, PlacementRule):
        raise QdqTypeError(f"register_rule needs a PlacementRule, got {type(rule).__name__}.")
    return PLACEMENT_RULES.register(rule.name, rule, override=override)

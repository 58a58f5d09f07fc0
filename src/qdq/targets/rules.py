"""A placement rule: one decision about where Q/DQ go, written once for every front end.

A rule is a function of a :class:`qdq.graphs.view.GraphView`, the front-end-neutral view of a model's graph
(ops in the ONNX vocabulary, the quantizers decided so far), that makes decisions on it (quantize an input or
an output, give quantizers one range, keep an op float). PyTorch (:func:`qdq.placement.apply_placement`), Keras
(:func:`qdq.keras.quantize_model`) and ONNX files each build the view of their model, run the target's rules in
the target's order (:func:`apply_rules`, the one loop), and materialize the decisions in their own form.

Rules have names, in :data:`PLACEMENT_RULES`, so that a target can be written with rule names and
``apply_placement(rules=[...])`` can name a subset.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from qdq.errors import QdqTypeError
from qdq.registry import Registry

__all__ = ["PLACEMENT_RULES", "PlacementRule", "apply_rules", "register_rule"]


@dataclass(frozen=True)
class PlacementRule:
    """One placement rule.

    Attributes:
        name: its name (unique in :data:`PLACEMENT_RULES`).
        decide: ``decide(view: GraphView) -> None``: reads the view (and ``view.target``'s facts) and makes its
            decisions on it.
        description: what it decides and why, one or two sentences.
    """

    name: str
    decide: Callable[[Any], None]
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a placement rule's name is a non-empty string, got {self.name!r}.")
        if not callable(self.decide):
            raise QdqTypeError(f"placement rule {self.name!r}: decide must be a function of the graph view.")


#: name -> rule: the built-in rules (registered by the target packages) and the ones users register.
PLACEMENT_RULES: Registry[str, PlacementRule] = Registry("placement rule")


def register_rule(rule: PlacementRule, *, override: bool = False) -> PlacementRule:
    """Register ``rule`` under its name; returns it."""
    if not isinstance(rule, PlacementRule):
        raise QdqTypeError(f"register_rule needs a PlacementRule, got {type(rule).__name__}.")
    return PLACEMENT_RULES.register(rule.name, rule, override=override)


def apply_rules(view: Any, rules: Iterable[PlacementRule]) -> None:
    """The placement loop every front end runs: each of ``rules`` decides on ``view`` (a
    :class:`~qdq.graphs.view.GraphView`), in order; a later rule sees the earlier ones' decisions."""
    for rule in rules:
        rule.decide(view)

"""TensorRT's rules for an ONNX graph it builds with explicit quantization and strong typing.

Each rule is a :class:`~.facts.Rule`: an id, a one-line summary, its source, and a function of the graph's
:class:`~.facts.GraphFacts` yielding :class:`~.facts.Violation` s. The rules come in families, one module each,
with their sources (TensorRT 10.x/11.x documentation unless said otherwise) in the module's docstring:

* :mod:`.qdq_nodes`: ``qdq-pair``, ``pair-params``, ``int8-type``, ``zero-point``, ``scale``;
* :mod:`.schemes`: ``activation-per-tensor``, ``weight-axis``;
* :mod:`.fusion`: ``weighted-op-inputs``, ``residual-add``, ``fused-scales``, ``integer-ops``;
* :mod:`.strong_typing`: ``type-consistent``, ``q-input-type``, ``dq-output-type``, ``fp32-island``.

:func:`qdq.targets.tensorrt.check.check_tensorrt` runs them all. Adding a rule: a function of ``GraphFacts``
in the module of its family (or a new family module), listed in that module's ``RULES``; a new family is
added to :data:`RULES` below.
"""

from __future__ import annotations

from qdq.targets.tensorrt.engine_rules import fusion, qdq_nodes, schemes, strong_typing
from qdq.targets.tensorrt.engine_rules.facts import FP32_NODES_KEY, GraphFacts, Rule, Violation

__all__ = ["FP32_NODES_KEY", "RULES", "GraphFacts", "Rule", "Violation", "run_rules"]

#: rule id -> Rule, in the order they run and print.
RULES: dict[str, Rule] = {rule.id: rule for family in (qdq_nodes, schemes, fusion, strong_typing)
                          for rule in family.RULES}  # fmt: skip


def run_rules(facts: GraphFacts) -> list[Violation]:
    """Every rule's violations, in rule order."""
    return [v for rule in RULES.values() for v in rule.check(facts)]

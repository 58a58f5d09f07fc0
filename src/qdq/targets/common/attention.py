"""``attention``: which of a quantized attention's four quantizers a target keeps, and at which shapes.

Every ``Attention`` op of the view (qdq's :class:`~qdq.nn.attention.QuantScaledDotProductAttention`, however it
was captured) is given the target's :class:`~qdq.targets.AttentionFacts`: its front end disables the
quantizers the facts do not list, puts the softmax scale where they say, and checks the shapes calibration
sees against their limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView

__all__ = ["ATTENTION"]


def _decide(view: GraphView) -> None:
    for op in view.ops_of(ops.ATTENTION):
        view.annotate(op, "attention", view.target.attention)


ATTENTION = PlacementRule(
    "attention",
    _decide,
    "Each quantized attention gets the target's attention facts: the quantizers they keep, where the softmax "
    "scale goes, the shapes its int8 kernels take.",
)

"""``one_range_per_tensor``: every quantizer of one tensor shares one range.

ONNX Runtime fuses a tensor with one ``QuantizeLinear``: a ReLU is folded into the int8 op before it, and two
identical Q/DQ pairs are merged, only when the Qs reading that tensor have the same scale. A tensor read by two
quantized ops (a block's output read by the next conv and by the next residual add) with ranges calibrated apart
(every method but max, which sees the same tensor twice, gives them different ranges) would leave a float op and
a standalone Q/DQ pair. So the quantizers of one tensor (per tensor; per-channel weights are apart) get one range,
calibrated on everything each of them reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Quantizer

__all__ = ["ONE_RANGE_PER_TENSOR"]


def _decide(view: GraphView) -> None:
    by_value: dict[str, dict[int, Quantizer]] = {}
    for quantizer in view.quantizers():
        if quantizer.per_channel:
            continue
        for site in quantizer.sites:
            by_value.setdefault(site.value.name, {})[id(quantizer)] = quantizer
    for name, found in by_value.items():
        quantizers = [q for q in found.values() if q.sites]  # a quantizer merged by an earlier share has none
        if len(quantizers) > 1:
            view.share_range(quantizers, f"{name} is read by several quantized ops")


ONE_RANGE_PER_TENSOR = PlacementRule(
    "one_range_per_tensor",
    _decide,
    "The quantizers of one tensor share one range: ONNX Runtime fuses a tensor with one QuantizeLinear only.",
)

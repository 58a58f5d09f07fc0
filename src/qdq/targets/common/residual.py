"""``residual_add``: the adds that follow a weighted op, and which of their inputs get quantized.

TensorRT fuses an elementwise add into the weighted op (Conv, Gemm) that produces one of its inputs; the
*other* input, the residual, is added in the fused kernel's epilogue, and its precision decides the kernel's
output precision (anchors §4.3, rule 4). So for a target with ``residual_add="skip"`` the input TensorRT fuses
stays float and every other input is quantized: the fused conv then runs int8 in and int8 out. A target with
``residual_add="both"`` (ONNX Runtime's ``QLinearAdd``) quantizes every input.

**Which input is fused** (:func:`fused_input`): among the inputs that come from a weighted op (through
BatchNorm, an activation, dropout or stochastic depth, each read once), the one with the most weighted ops on
its longest path from the model's input; on a tie, the first in argument order. In a ResNet projection block
both inputs come from a conv: the main branch (three convs in a bottleneck, two in a basic block) is fused and
the projection shortcut (one conv) is quantized. Every block of the network then has the same int8 form: its
last main-branch conv fused with the add, the shortcut arriving in int8 (in an identity block the shortcut is
the block's input, already int8). Argument order cannot decide it: torchvision writes ``out += identity``
(main branch first) where keras.applications writes ``Add([shortcut, x])`` (shortcut first).

Adds with no weighted input are left alone (a Q/DQ the runtime cannot fuse only costs time).

**Adds read by a layer normalization** (a transformer's residual adds: ``LayerNorm(x + sublayer(x))`` in BERT,
``x + attn(norm1(x))`` read by ``norm2`` in a pre-LN ViT) stay float with ``residual_add="both"``: ONNX Runtime
has no int8 LayerNorm, so the add's output is float and no ``QLinearAdd`` can form; quantized inputs would
only leave a standalone ``DequantizeLinear`` per input before a float ``Add`` (measured on BERT). TensorRT's
``"skip"`` keeps quantizing the shortcut there (its fused kernels read it in int8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qdq.graphs import ops
from qdq.targets.rules import PlacementRule

if TYPE_CHECKING:
    from qdq.graphs.view import GraphView, Value

__all__ = ["RESIDUAL_ADD", "fused_input", "residual_adds"]


def fused_input(follows_weighted: Sequence[bool], weighted_depth: Callable[[int], int]) -> int | None:
    """The index of the add input TensorRT fuses into its weighted op (see the module doc), or None when no
    input comes from a weighted op. ``weighted_depth(i)`` is asked only when several inputs do."""
    candidates = [i for i, follows in enumerate(follows_weighted) if follows]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    depths = {i: weighted_depth(i) for i in candidates}
    return max(candidates, key=lambda i: (depths[i], -i))


def residual_adds(view: GraphView, mode: str, *, lone: bool = False) -> None:
    """Quantize the inputs of every add fed by a weighted op: all but the fused one (``"skip"``) or all
    (``"both"``, except an add a layer normalization reads); with ``lone``, every input of an add no weighted op
    feeds too (the TF toolkit's residual case)."""
    for add in view.ops_of("Add"):
        inputs = add.data_inputs
        if len(inputs) < 2:
            continue
        if mode == "both" and any(r.type in ops.FEATURE_NORMS for r, _ in add.outputs[0].readers):
            continue
        values = [v for _, v in inputs]

        def depth(i: int, values: list[Value] = values) -> int:
            return view.weighted_depth(values[i])

        fused = fused_input([view.follows_weighted(v) for v in values], depth)
        if fused is None and not lone:
            continue
        for position, (index, _) in enumerate(inputs):
            if mode == "both" or position != fused:
                view.quantize_input(add, index, f"residual add ({mode})", stem="residual_add")


def _decide(view: GraphView) -> None:
    residual_adds(view, view.target.residual_add)


RESIDUAL_ADD = PlacementRule(
    "residual_add",
    _decide,
    "An add fed by a weighted op: with residual_add='skip' every input but the one TensorRT fuses (the deepest "
    "weighted branch) is quantized; with 'both' every input (QLinearAdd), unless a LayerNorm reads the sum.",
)

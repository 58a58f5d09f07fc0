"""Quantized scaled-dot-product attention: ``softmax(Q Kᵀ · scale + mask) V`` with a quantizer on each matmul input.

:class:`QuantScaledDotProductAttention` is a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(same arguments) that computes attention as two matmuls and a softmax, with four quantizers:

* ``query_quantizer`` and ``key_quantizer``: the inputs of ``Q·Kᵀ``;
* ``probs_quantizer``: the softmax output (the attention probabilities), before dropout;
* ``value_quantizer``: ``V``, the other input of ``probs·V``.

Each is a :class:`~qdq.quantizer.TensorQuantizer` that can be enabled or disabled on its own: a target's
placement rule decides which run (TensorRT fuses int8 multi-head attention when all four are there, for head
sizes 16/32/64 and sequences up to 512). All disabled, the module computes what
``F.scaled_dot_product_attention`` computes (to float rounding: the scale multiplies ``Q·Kᵀ`` instead of
``Q`` and ``K``). Exported, it is ``MatMul -> Mul -> (Add | Where) -> Softmax -> MatMul`` with Q/DQ on the
matmul inputs, never a fused attention op, so each runtime sees the pattern it fuses. With :attr:`scale_query`
(set by placement for a target whose :class:`~qdq.targets.AttentionFacts` say so: ONNX Runtime) the scale
multiplies the query before its quantizer instead, ``Mul -> Q/DQ -> MatMul``: for a power-of-two scale the same
numbers, with the ``Mul`` where an ONNX rewrite can fold it into the QuantizeLinear.

:func:`replace_sdpa_calls` routes the ``F.scaled_dot_product_attention`` calls of a ``torch.fx`` graph through
new modules of this class (the capture for code that calls the function: user code, and timm's attention
modules once :func:`use_fused_attention` has set their ``fused_attn``); ``qdq.nn.multihead_attention`` and
``qdq.nn.huggingface`` capture ``nn.MultiheadAttention`` and Hugging Face models. Placement runs these captures
(:mod:`qdq.placement.capture`); ARCHITECTURE.md ("Attention") describes the design.

Shapes are not known at placement: the module records the head size and the longest sequence while it calibrates
(:attr:`~QuantScaledDotProductAttention.calibrated_shape`), and settles its target's shape conditions after the
pass through the calibration hooks of :class:`~qdq.nn.base.QuantModule` (:func:`forget_attention_shapes` before,
:func:`settle_attention` after: one message for every attention module of the model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qdq.descriptor import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor
from qdq.errors import QdqConfigError
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer

__all__ = [
    "ATTENTION_QUANTIZERS",
    "QuantScaledDotProductAttention",
    "forget_attention_shapes",
    "replace_sdpa_calls",
    "settle_attention",
    "use_fused_attention",
]

#: The quantizer attributes of :class:`QuantScaledDotProductAttention`, in the order the data meets them: the order
#: of :data:`qdq.graphs.ops.ATTENTION_SITES`, the neutral names a target's attention facts use.
ATTENTION_QUANTIZERS = ("query_quantizer", "key_quantizer", "probs_quantizer", "value_quantizer")


class QuantScaledDotProductAttention(QuantModule, nn.Module):
    """``F.scaled_dot_product_attention`` with quantized matmul inputs (see the module doc).

    Args:
        quant_desc_input: descriptor of the query, key and value quantizers (default 8-bit per tensor).
        quant_desc_probs: descriptor of the softmax-output quantizer (default: ``quant_desc_input``).
            The probabilities lie in ``[0, 1]``; a target may make this quantizer unsigned.
        quantize: which quantizers start enabled, by attribute name (default: all four).
    """

    def __init__(
        self,
        quant_desc_input: QuantDescriptor | None = None,
        quant_desc_probs: QuantDescriptor | None = None,
        quantize: tuple[str, ...] = ATTENTION_QUANTIZERS,
    ) -> None:
        super().__init__()
        unknown = sorted(set(quantize) - set(ATTENTION_QUANTIZERS))
        if unknown:
            raise QdqConfigError(f"quantize names {unknown}; the quantizers are {list(ATTENTION_QUANTIZERS)}.")
        desc = QUANT_DESC_8BIT_PER_TENSOR if quant_desc_input is None else quant_desc_input
        self.query_quantizer = TensorQuantizer(desc, role="input")
        self.key_quantizer = TensorQuantizer(desc, role="input")
        self.probs_quantizer = TensorQuantizer(desc if quant_desc_probs is None else quant_desc_probs, role="input")
        self.value_quantizer = TensorQuantizer(desc, role="input")
        for name in ATTENTION_QUANTIZERS:
            if name not in quantize:
                getattr(self, name).disable()
        #: ``(head size, longest query or key sequence)`` seen while calibrating (eager calls only), or None.
        self.calibrated_shape: tuple[int, int] | None = None
        #: the placement target's :class:`~qdq.targets.AttentionFacts` (set by placement), or None.
        self.target_facts: Any = None
        #: True: the softmax scale multiplies the query before its quantizer, not ``Q·Kᵀ`` (set by placement from
        #: the target's facts; see :attr:`qdq.targets.AttentionFacts.scale_query`).
        self.scale_query = False

    def quantizers(self) -> dict[str, TensorQuantizer]:
        """The four quantizers by attribute name, in the order the data meets them."""
        return {name: getattr(self, name) for name in ATTENTION_QUANTIZERS}

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        return (self.query_quantizer, self.key_quantizer, self.value_quantizer)

    @classmethod
    def start_calibration(cls, modules: Sequence[tuple[str, Any]]) -> None:
        """Before calibration: forget the shapes earlier calibrations recorded (the new data decides)."""
        for _, module in modules:
            module.calibrated_shape = None

    @classmethod
    def finish_calibration(cls, modules: Sequence[tuple[str, Any]]) -> str | None:
        """After calibration: disable the four quantizers of every module whose calibration shapes fall outside
        its target's facts (head size, sequence length); one message saying which and why, or None."""
        outside: dict[str, list[str]] = {}
        total, reason = 0, ""
        for name, module in modules:
            if module.target_facts is None:
                continue
            total += 1
            shape = module.calibrated_shape
            why = None if shape is None else module.target_facts.outside(*shape)
            if why is not None and any(q.is_enabled for q in module.quantizers().values()):
                for quantizer in module.quantizers().values():
                    quantizer.disable()
                outside.setdefault(why, []).append(name)
                reason = module.target_facts.reason
        if not outside:
            return None
        count = sum(len(names) for names in outside.values())
        shapes = "; ".join(f"{why}: {_listed(names)}" for why, names in outside.items())
        return (
            f"{count} of {total} attention modules keep their matmuls in float, for the shapes calibration saw "
            f"({shapes}): {reason}. Calibrate on the deployed sequence length; the Linear layers stay quantized."
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        *,
        return_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` ``(..., L, E)`` over ``key`` ``(..., S, E)`` and ``value`` ``(..., S, Ev)``.

        The arguments are ``F.scaled_dot_product_attention``'s: ``attn_mask`` boolean (True takes part) or
        float (added to the scores), broadcastable to ``(..., L, S)``; ``is_causal`` masks the upper
        triangle (no ``attn_mask`` then); ``scale`` defaults to ``1 / sqrt(E)``; ``dropout_p`` is applied
        whenever it is positive, as the function does (pass 0 in eval mode); ``enable_gqa`` repeats the
        key/value heads (dimension -3) to the number of query heads.

        Returns:
            ``(..., L, Ev)``; with ``return_probs`` also the probabilities ``(..., L, S)`` as ``V`` met them
            (quantized, after dropout), for callers that report attention weights.
        """
        if is_causal and attn_mask is not None:
            raise QdqConfigError("is_causal=True takes no attn_mask (the function's rule); pass one or the other.")
        self._record_shape(query, key)
        if enable_gqa:
            key, value = _repeat_heads(key, query.size(-3)), _repeat_heads(value, query.size(-3))
        factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        scores = self._scores(query, key, factor)
        if is_causal:
            attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        if attn_mask is not None:
            scores = _masked(scores, attn_mask)
        probs = self.probs_quantizer(torch.softmax(scores, dim=-1))
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p, training=True)
        out = torch.matmul(probs, self.value_quantizer(value))
        return (out, probs) if return_probs else out

    def _scores(self, query: torch.Tensor, key: torch.Tensor, factor: float) -> torch.Tensor:
        """``Q·Kᵀ · factor``, the factor on ``Q·Kᵀ`` or, with :attr:`scale_query`, on Q before its quantizer."""
        keys = self.key_quantizer(key).transpose(-2, -1)
        if self.scale_query:
            return torch.matmul(self.query_quantizer(query * factor), keys)
        return torch.matmul(self.query_quantizer(query), keys) * factor

    def _record_shape(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """Remember the head size and the longest sequence while any quantizer calibrates (plain ints only:
        nothing while tracing, exporting or compiling)."""
        if not any(q.calib_enabled for q in self.quantizers().values()):
            return
        head, length = query.shape[-1], max(query.shape[-2], key.shape[-2])
        if type(head) is not int or type(length) is not int or torch.compiler.is_compiling():
            return
        seen = self.calibrated_shape or (head, 0)
        self.calibrated_shape = (head, max(seen[1], length))


def _attention_modules(model: nn.Module) -> list[tuple[str, QuantScaledDotProductAttention]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, QuantScaledDotProductAttention)]


def forget_attention_shapes(model: nn.Module) -> None:
    """Forget the shapes that earlier calibrations recorded in every attention module of ``model``."""
    QuantScaledDotProductAttention.start_calibration(_attention_modules(model))


def settle_attention(model: nn.Module) -> str | None:
    """Disable the quantizers of every attention module of ``model`` whose calibration shapes fall outside its
    target's facts; one message saying which and why, or None (what :func:`qdq.collect_stats` runs after its pass,
    through :meth:`QuantScaledDotProductAttention.finish_calibration`)."""
    return QuantScaledDotProductAttention.finish_calibration(_attention_modules(model))


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def _masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask.logical_not(), float("-inf"))
    return scores + mask


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = x.size(-3)
    if heads % groups:
        raise QdqConfigError(f"enable_gqa needs the query heads ({heads}) to be a multiple of the key heads ({groups})")
    return x.repeat_interleave(heads // groups, dim=-3)


def replace_sdpa_calls(
    graph_module: fx.GraphModule,
    make: Callable[[], QuantScaledDotProductAttention] = QuantScaledDotProductAttention,
    stem: str = "quant_attention",
) -> list[str]:
    """Replace every ``F.scaled_dot_product_attention`` call of ``graph_module`` by a call of a new ``make()``
    module, with the same arguments; recompile.

    Each module is added under the submodule that owned the call (``blocks.0.attn.quant_attention``; from
    the node's ``nn_module_stack``), so its quantizers have stable names in ``state_dict``.

    Returns:
        The names of the added modules, in graph order.
    """
    added: list[str] = []
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        name = _free_name(graph_module, _owner(node), stem)
        graph_module.add_submodule(name, make())
        with graph_module.graph.inserting_after(node):
            call = graph_module.graph.call_module(name, args=node.args, kwargs=node.kwargs)
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph_module.graph.erase_node(node)
        added.append(name)
    if added:
        graph_module.graph.lint()
        graph_module.recompile()
    return added


def use_fused_attention(model: nn.Module) -> list[str]:
    """Set ``fused_attn = True`` on every module of ``model`` that has that flag (timm's attention modules:
    ViT/DeiT ``Attention``, Swin ``WindowAttention``...), so that each computes its attention in one
    ``F.scaled_dot_product_attention`` call, which :func:`replace_sdpa_calls` reaches once the model is traced.
    Their unfused branch computes the same function (timm keeps both); returns the names of the modules set.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fused_attn", None), bool):
            module.fused_attn = True
            names.append(name)
    return names


def _owner(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack") or {})
    return stack[-1] if stack else ""


def _free_name(root: nn.Module, owner: str, stem: str) -> str:
    base = f"{owner}.{stem}" if owner else stem
    name, i = base, 1
    while _has_attr(root, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _has_attr(root: nn.Module, path: str) -> bool:
    obj: object = root
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True

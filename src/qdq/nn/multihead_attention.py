"""Quantized ``nn.MultiheadAttention``: quantized projections and quantized attention matmuls.

``nn.MultiheadAttention`` computes its projections with ``F.linear`` on its own parameters and its attention
in one fused call, so neither module replacement of its ``out_proj`` nor placement can reach them.
:class:`QuantMultiheadAttention` replaces the whole module (registered in :mod:`qdq.replace`) and computes
the same function, written out:

* the query, key and value projections: each input quantized (``_input_quantizer``,
  ``key_input_quantizer``, ``value_input_quantizer``; in self-attention the three see the same tensor and
  calibrate to the same range, and the exporter keeps one Q/DQ), the packed ``in_proj_weight`` quantized per
  output row (``_weight_quantizer``; with separate ``kdim``/``vdim`` weights, one quantizer each);
* the attention: a :class:`~qdq.nn.attention.QuantScaledDotProductAttention` (``attention``: quantizers on Q,
  K, the probabilities and V);
* the output projection: ``out_proj`` becomes a :class:`~qdq.nn.QuantLinear`.

Masks keep ``nn.MultiheadAttention``'s meaning (a boolean ``True`` masks a position, a float is added);
``need_weights`` returns the probabilities as the value matmul met them (quantized, after dropout), averaged
over heads unless ``average_attn_weights=False``. ``add_bias_kv`` and ``add_zero_attn`` are not supported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from qdq import descriptor as d
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantMixin
from qdq.nn.linear import QuantLinear
from qdq.nn.registry import quantizes
from qdq.quantizer import TensorQuantizer

__all__ = ["QuantMultiheadAttention"]


@quantizes(nn.MultiheadAttention)
class QuantMultiheadAttention(QuantMixin, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with quantized projections and attention (see the module doc)."""

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def init_quantizer(
        self, quant_desc_input: QuantDescriptor | None = None, quant_desc_weight: QuantDescriptor | None = None
    ) -> None:
        if self.bias_k is not None or self.add_zero_attn:
            raise QdqConfigError(
                "QuantMultiheadAttention does not support add_bias_kv or add_zero_attn; leave this module float "
                "(QuantConfig(exclude_types=(nn.MultiheadAttention,)))."
            )
        super().init_quantizer(quant_desc_input, quant_desc_weight)
        self.key_input_quantizer = TensorQuantizer(self._input_quantizer_desc(quant_desc_input), role="input")
        self.value_input_quantizer = TensorQuantizer(self._input_quantizer_desc(quant_desc_input), role="input")
        weight_desc = self.default_quant_desc_weight if quant_desc_weight is None else quant_desc_weight
        self.k_weight_quantizer = TensorQuantizer(weight_desc, role="weight")
        self.v_weight_quantizer = TensorQuantizer(weight_desc, role="weight")
        if not isinstance(self.out_proj, QuantLinear):
            self._float_out_proj = type(self.out_proj)  # NonDynamicallyQuantizableLinear, given back by to_float
            self.out_proj = QuantLinear.from_float(  # type: ignore[assignment]  # torch's MHA types it as its Linear
                self.out_proj, quant_desc_input, quant_desc_weight
            )
        self.attention = QuantScaledDotProductAttention(quant_desc_input)

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        return (self._input_quantizer, self.key_input_quantizer, self.value_input_quantizer)

    def to_float(self) -> nn.Module:
        """The ``nn.MultiheadAttention`` this module replaced: the same parameters, its ``out_proj`` float again."""
        float_module = super().to_float()
        out_proj = cast(QuantLinear, self.out_proj).to_float()  # made a QuantLinear by init_quantizer
        out_proj.__class__ = float_module.__dict__.pop("_float_out_proj", type(out_proj))
        float_module._modules["out_proj"] = out_proj
        return float_module

    def _input_quantizer_desc(self, desc: QuantDescriptor | None) -> QuantDescriptor:
        return self.default_quant_desc_input if desc is None else desc

    def quantized_weights(self) -> Iterator[tuple[str, torch.Tensor, TensorQuantizer]]:
        """``(name, weight, quantizer)`` of the input projection weights (``out_proj`` is its own module); the
        packed ``in_proj_weight`` as its three row blocks, each quantized on its own (per row, so the same
        numbers as the packed matrix): each projection's MatMul then reads its weight straight from a DQ, as
        TensorRT requires."""
        quantizers = (self._weight_quantizer, self.k_weight_quantizer, self.v_weight_quantizer)
        if self._qkv_same_embed_dim:
            e = self.embed_dim
            blocks = (self.in_proj_weight[:e], self.in_proj_weight[e : 2 * e], self.in_proj_weight[2 * e :])
            for part, weight, quantizer in zip("qkv", blocks, quantizers):
                yield f"in_proj_weight[{part}]", weight, quantizer
            return
        weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        for part, weight, quantizer in zip("qkv", weights, quantizers):
            yield f"{part}_proj_weight", weight, quantizer

    def _projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(quantizer(weight) for _, weight, quantizer in self.quantized_weights())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        q, k, v = (self._batch_first(t, batched) for t in (query, key, value))
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        w_q, w_k, w_v = self._projection_weights()
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = self._heads(F.linear(self._input_quantizer(q), w_q, b_q))
        k = self._heads(F.linear(self.key_input_quantizer(k), w_k, b_k))
        v = self._heads(F.linear(self.value_input_quantizer(v), w_v, b_v))
        mask = _additive_mask(attn_mask, key_padding_mask, q)
        if is_causal and attn_mask is None:
            raise QdqConfigError("is_causal=True needs attn_mask too (nn.MultiheadAttention's rule): pass the mask.")
        out, probs = self.attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, return_probs=True
        )
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        out = out if batched and self.batch_first else out.transpose(0, 1) if batched else out.squeeze(0)
        if not need_weights:
            return out, None
        weights = probs.mean(dim=1) if average_attn_weights else probs
        return out, weights if batched else weights.squeeze(0)

    def _batch_first(self, x: torch.Tensor, batched: bool) -> torch.Tensor:
        if not batched:
            return x.unsqueeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, L, H * D)`` to ``(N, H, L, D)``."""
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)


def _as_additive(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention's mask convention: a boolean True masks (becomes -inf), a float is added."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))
    return mask.to(like.dtype)


def _additive_mask(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, q: torch.Tensor
) -> torch.Tensor | None:
    """One additive mask broadcastable to ``(N, H, L, S)`` from an ``(L, S)`` or ``(N * H, L, S)`` attention
    mask and an ``(N, S)`` key padding mask."""
    batch, heads = q.shape[0], q.shape[1]
    mask = None
    if attn_mask is not None:
        mask = _as_additive(attn_mask, q)
        mask = mask.view(batch, heads, *mask.shape[-2:]) if mask.dim() == 3 else mask
    if key_padding_mask is not None:
        padding = _as_additive(key_padding_mask, q).view(batch, 1, 1, -1)
        mask = padding if mask is None else mask + padding
    return mask

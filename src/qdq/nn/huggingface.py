"""Hugging Face ``transformers``: route a model's attention through qdq's quantized attention.

transformers (5.x) computes attention in a function looked up, at each call, in its attention registry
(``AttentionInterface``, instance ``ALL_ATTENTION_FUNCTIONS``) under the model's
``config._attn_implementation`` (``"sdpa"``, ``"eager"``...), and builds masks with the function its mask
registry (``AttentionMaskInterface``) holds under the same name. BERT, DistilBERT, RoBERTa, ViT and most
current models call it as ``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)``
with ``(batch, heads, length, head_dim)`` tensors, and expect ``(output (batch, length, heads, head_dim),
weights or None)``. torch.fx cannot trace these models, but this registry reaches every attention call:

* :func:`register_hf_attention` registers, under :data:`IMPLEMENTATION` (``"qdq"``), an attention function
  that calls the :class:`~qdq.nn.attention.QuantScaledDotProductAttention` the calling module carries as
  ``quant_attention``, and the ``"sdpa"`` mask function (boolean masks, none when nothing is masked). It is
  explicit (nothing registers at import) and idempotent.
* :func:`capture_hf_attention` registers, gives each module whose ``forward`` dispatches through the registry
  its own ``quant_attention`` (so its quantizers are ordinary submodules: in ``state_dict``, calibrated,
  exported), and switches the model to ``"qdq"`` (``set_attn_implementation``). The model then computes what
  ``"sdpa"`` computes when the quantizers are disabled.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.attention import QuantScaledDotProductAttention

__all__ = ["ATTRIBUTE", "IMPLEMENTATION", "capture_hf_attention", "hf_attention_forward", "register_hf_attention"]

#: The name qdq's attention function and mask function are registered under in transformers.
IMPLEMENTATION = "qdq"
#: The attribute of an attention module that holds its quantized attention.
ATTRIBUTE = "quant_attention"
_REGISTRY_NAME = "ALL_ATTENTION_FUNCTIONS"


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function protocol, computed by ``module.quant_attention`` (the rules of its
    ``"sdpa"`` function: causal only without a mask and for more than one query; grouped key/value heads
    repeated)."""
    attention = getattr(module, ATTRIBUTE, None)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    if not isinstance(attention, QuantScaledDotProductAttention):
        raise QdqConfigError(
            f"{type(module).__name__} runs with attention implementation {IMPLEMENTATION!r} but has no "
            f"{ATTRIBUTE}; call qdq.nn.huggingface.capture_hf_attention(model) on the whole model."
        )
    if kwargs.get("softcap") is not None:
        raise QdqConfigError(
            f"{type(module).__name__} passes softcap, which qdq's attention does not compute; keep this model on "
            "its own attention implementation (capture_hf_attention does for models with attn_logit_softcapping)."
        )
    if kwargs.get("position_bias") is not None:  # T5's relative bias: one additive mask, as "sdpa" makes it
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(kwargs["position_bias"], attention_mask, causal, query, key)
        causal = False
    groups = getattr(module, "num_key_value_groups", 1)
    out, probs = attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=groups > 1, return_probs=True,
    )  # fmt: skip
    weights = probs if kwargs.get("output_attentions") else None
    return out.transpose(1, 2).contiguous(), weights


def soft_capped(module: nn.Module) -> bool:
    """Whether ``module``'s attention caps its scores (``attn_logit_softcapping``: Gemma 2 and its kin), which
    qdq's attention does not compute."""
    return getattr(module, "attn_logit_softcapping", None) is not None


def register_hf_attention() -> str:
    """Register qdq's attention function and the ``"sdpa"`` mask function under :data:`IMPLEMENTATION` in
    transformers' registries (idempotent); return the name.

    Raises:
        QdqBackendUnavailable-like ImportError: transformers is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, hf_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return IMPLEMENTATION


def dispatches_through_registry(module: nn.Module) -> bool:
    """Whether ``module.forward`` looks its attention function up in transformers' registry."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)  # through decorators (deprecate_kwarg)
    return code is not None and _REGISTRY_NAME in code.co_names


def capture_hf_attention(
    model: nn.Module, quant_desc_input: QuantDescriptor | None = None, quant_desc_probs: QuantDescriptor | None = None
) -> list[str]:
    """Route every attention of a Hugging Face ``model`` through a :class:`QuantScaledDotProductAttention`.

    Registers :data:`IMPLEMENTATION` (:func:`register_hf_attention`), adds ``quant_attention`` to each module
    that dispatches through transformers' attention registry (kept when already there: calling this twice
    changes nothing), and sets the model's attention implementation to it.

    Args:
        model: a transformers ``PreTrainedModel`` (built from a config or loaded), quantized or not.
        quant_desc_input / quant_desc_probs: descriptors of the added attention quantizers.

    Returns:
        The names of the attention modules that carry a ``quant_attention``; none, with one warning, for a model
        whose attention caps its scores (:func:`soft_capped`): it keeps its own implementation, float.

    Raises:
        QdqTypeError: ``model`` is not a transformers model.
        QdqConfigError: no module of ``model`` dispatches through the registry (an older modeling file:
            its attention stays float).
    """
    if not hasattr(model, "set_attn_implementation"):
        raise QdqTypeError(f"capture_hf_attention needs a transformers PreTrainedModel, got {type(model).__name__}.")
    register_hf_attention()
    capped = [name for name, module in model.named_modules() if dispatches_through_registry(module)
              and soft_capped(module)]  # fmt: skip
    if capped:  # a setting of the whole config: every layer's attention caps
        warnings.warn(
            f"{type(model).__name__}'s attention caps its scores (attn_logit_softcapping, {len(capped)} modules), "
            "which qdq's attention does not compute: the attention matmuls stay float on the model's own "
            "implementation; its linear layers are quantized.",
            stacklevel=2,
        )
        return []
    names = []
    for name, module in model.named_modules():
        if not dispatches_through_registry(module):
            continue
        if not isinstance(getattr(module, ATTRIBUTE, None), QuantScaledDotProductAttention):
            module.add_module(ATTRIBUTE, QuantScaledDotProductAttention(quant_desc_input, quant_desc_probs))
        names.append(name)
    if not names:
        raise QdqConfigError(
            f"no module of {type(model).__name__} dispatches its attention through transformers' attention "
            "registry, so its attention cannot be quantized this way (it stays float)."
        )
    model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]  # a transformers PreTrainedModel's
    return names

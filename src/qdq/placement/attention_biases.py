"""Attention biases folded out of the key and value projections: the same float model, fewer int8 bias passes.

Two identities of softmax attention (rows of ``softmax(Q·Kᵀ·s + mask)`` sum to 1):

* **key bias**: ``Q·(K + 1·b_kᵀ)ᵀ = Q·Kᵀ + (Q·b_k)·1ᵀ`` adds one constant to every score of a query's row,
  which the softmax ignores: ``b_k`` can be set to 0;
* **value bias**: ``P·(V + 1·b_vᵀ) = P·V + 1·b_vᵀ``: the value bias comes out of the attention unchanged, and
  when the heads' concatenation goes straight into the output Linear, ``W_o·b_v`` joins that Linear's bias:
  ``b_o += W_o·b_v`` and ``b_v = 0``.

The float model computes the same function (up to float rounding); its quantized model quantizes ``K`` and ``V``
without their offsets (often a narrower range) and the attention output without ``b_v``. A target whose int8
GEMM pays for a bias (ONNX Runtime's ``QGemm`` writes an int32 bias over its whole output before accumulating)
then runs the key and value projections with no bias; placement does it for targets whose
:class:`~qdq.targets.AttentionFacts` say ``fold_biases``, before anything is traced, on the model's own parameters
(so the float model passed to placement changes its parameters, not its outputs).

Which parameters are the biases is found by the layouts in :data:`ATTENTION_LAYOUTS` (a registry: name ->
function from a module to its :class:`AttentionBiases` or None): a packed ``qkv`` Linear with a ``proj`` (timm's
ViT, DeiT, Swin and most PyTorch code), one Linear each for key, value and output at the paths Hugging Face
models use (:data:`SEPARATE_PROJECTIONS`: BERT, RoBERTa, DistilBERT, ViT, DeiT...) and ``nn.MultiheadAttention``.
A layout says where the parameters are, not that the identities hold (rotary position
embeddings rotate ``b_k`` per position; a gate or a norm between the attention and the output Linear breaks the
value fold): each fold is checked by running the module alone on a fixed random input before and after, in
float, and undone when its output moves by more than float rounding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qdq.quantizer import TensorQuantizer, disabled_quantizers
from qdq.registry import Registry
from qdq.utils.batches import flatten_outputs
from qdq.utils.modes import eval_mode

__all__ = ["ATTENTION_LAYOUTS", "AttentionBiases", "fold_attention_biases", "register_attention_layout"]

#: largest change of the module's output a fold may make, relative to the output's largest magnitude
TOLERANCE = 1e-4
#: tokens of the probe input (a window's tokens where the module has a ``window_size``)
_PROBE_TOKENS = 7


@dataclass
class AttentionBiases:
    """Where one attention module keeps its key and value biases.

    Attributes:
        key: the key bias entries (a view into a bias parameter).
        value: the value bias entries (a view), or None.
        out: the Linear that reads the heads' concatenation (the value fold needs its bias), or None.
        probe: runs the module alone on a fixed input and returns its output (the fold's check).
    """

    key: torch.Tensor
    value: torch.Tensor | None
    out: nn.Linear | None
    probe: Callable[[], torch.Tensor]


Layout = Callable[[nn.Module], "AttentionBiases | None"]

#: name -> function returning a module's :class:`AttentionBiases` when the module has that layout, else None.
ATTENTION_LAYOUTS: Registry[str, Layout] = Registry("attention layout")


def register_attention_layout(name: str, layout: Layout, *, override: bool = False) -> Layout:
    """Register ``layout`` (module -> :class:`AttentionBiases` or None) under ``name``; returns it."""
    return ATTENTION_LAYOUTS.register(name, layout, override=override)


def fold_attention_biases(model: nn.Module) -> list[str]:
    """Fold the key and value biases of every attention module of ``model`` (module doc), in place.

    A module whose quantizers are already calibrated is left as it is: its ranges were measured on the tensors
    the fold would change.

    Returns:
        ``"<module>: key and value biases folded"`` (or ``key bias``) for each module changed.
    """
    done = []
    for name, module in model.named_modules():
        found = _layout_of(module)
        if found is None or _calibrated(module):
            continue
        what = _fold_checked(module, found)
        if what:
            done.append(f"{name or type(module).__name__}: {what} folded")
    return done


def _calibrated(module: nn.Module) -> bool:
    return any(isinstance(m, TensorQuantizer) and m.amax is not None for m in module.modules())


def _layout_of(module: nn.Module) -> AttentionBiases | None:
    for _, layout in ATTENTION_LAYOUTS.items():
        found = layout(module)
        if found is not None:
            return found
    return None


def _fold_checked(module: nn.Module, found: AttentionBiases) -> str:
    """Try both folds, then the key fold alone; keep the first whose probe output is unchanged."""
    with _float(module), torch.no_grad():
        before = _run(found.probe)
        if before is None:
            return ""
        value = found.value if found.out is not None and found.out.bias is not None else None
        attempts = [(value, "key and value biases")] if value is not None else []
        for val, what in [*attempts, (None, "key bias")]:
            undo = _fold(found.key, val, found.out)
            after = _run(found.probe)
            if after is not None and _same(before, after):
                return what
            undo()
    return ""


def _fold(key: torch.Tensor, value: torch.Tensor | None, out: nn.Linear | None) -> Callable[[], None]:
    """Zero ``key``; move ``value`` into ``out``'s bias; a function that puts everything back."""
    touched = (key, value, out.bias if value is not None and out is not None else None)
    saved = [(t, t.clone()) for t in touched if t is not None]
    if value is not None and out is not None:
        out.bias.add_(out.weight.to(value.dtype) @ value)
        value.zero_()
    key.zero_()

    def undo() -> None:
        for tensor, copy in saved:
            tensor.copy_(copy)

    return undo


def _run(probe: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    try:
        return probe().detach().float()
    except Exception:  # a module the probe cannot call alone (extra required inputs): left as it is
        return None


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    if before.shape != after.shape or not bool(torch.isfinite(before).all()):
        return False
    scale = float(before.abs().max()) or 1.0
    return float((after - before).abs().max()) <= TOLERANCE * scale


def _probe_input(module: nn.Module, width: int) -> torch.Tensor:
    """A fixed ``[2, tokens, width]`` input with the module's dtype and device."""
    param = next(module.parameters())
    window = getattr(module, "window_size", None)
    tokens = math.prod(window) if isinstance(window, tuple | list) else _PROBE_TOKENS
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, tokens, width, generator=generator).to(param.device, param.dtype)


def _first_output(module: nn.Module, *args: torch.Tensor, **kwargs: Any) -> Callable[[], torch.Tensor]:
    def probe() -> torch.Tensor:
        return flatten_outputs(module(*args, **kwargs))[0]

    return probe


@contextlib.contextmanager
def _float(module: nn.Module) -> Iterator[None]:
    """``module`` in float and eval mode: quantizers disabled (the check is about the float function)."""
    with disabled_quantizers(module), eval_mode(module):
        yield


def _linear(module: object) -> nn.Linear | None:
    return module if isinstance(module, nn.Linear) else None


# --- the built-in layouts ------------------------------------------------------------------------------------


def _packed_qkv(module: nn.Module) -> AttentionBiases | None:
    """``qkv``: one Linear to ``3·E`` (query, key, value blocks) with a bias; ``proj``: the output Linear."""
    qkv, proj = _linear(getattr(module, "qkv", None)), _linear(getattr(module, "proj", None))
    if qkv is None or proj is None or qkv.bias is None or qkv.out_features % 3:
        return None
    width = qkv.out_features // 3
    bias = qkv.bias.data
    out = proj if proj.in_features == width else None
    probe = _first_output(module, _probe_input(module, qkv.in_features))
    return AttentionBiases(bias[width : 2 * width], bias[2 * width :], out, probe)


#: (key, value, output Linear) paths, relative to an attention module, of the layouts with one Linear each
SEPARATE_PROJECTIONS = (
    ("self.key", "self.value", "output.dense"),  # Hugging Face BERT, RoBERTa
    ("attention.key", "attention.value", "output.dense"),  # Hugging Face ViT, DeiT (4.x)
    ("k_proj", "v_proj", "o_proj"),  # Hugging Face ViT (5.x) and the Llama-style models
    ("k_proj", "v_proj", "out_proj"),  # BART, CLIP, Whisper
    ("k_lin", "v_lin", "out_lin"),  # DistilBERT
)


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    found: object = module
    for part in path.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, nn.Module) else None


def _separate_projections(module: nn.Module) -> AttentionBiases | None:
    """One Linear per key and value, and an output Linear, at one of the :data:`SEPARATE_PROJECTIONS` paths."""
    for key_path, value_path, out_path in SEPARATE_PROJECTIONS:
        key, value = _linear(_submodule(module, key_path)), _linear(_submodule(module, value_path))
        out = _linear(_submodule(module, out_path))
        if key is None or value is None or out is None or key.bias is None or value.bias is None:
            continue
        probe = _first_output(module, _probe_input(module, key.in_features))
        out = out if out.in_features == value.out_features else None
        return AttentionBiases(key.bias.data, value.bias.data, out, probe)
    return None


def _multihead(module: nn.Module) -> AttentionBiases | None:
    """``nn.MultiheadAttention`` (and its quantized subclass): ``in_proj_bias`` blocks and ``out_proj``."""
    if not isinstance(module, nn.MultiheadAttention) or module.in_proj_bias is None:
        return None
    width = module.embed_dim
    bias = module.in_proj_bias.data
    x = _probe_input(module, width)
    probe = _first_output(module, x, x, x, need_weights=False)
    return AttentionBiases(bias[width : 2 * width], bias[2 * width :], _linear(module.out_proj), probe)


for _name, _layout in (("packed_qkv", _packed_qkv), ("separate_projections", _separate_projections),
                       ("multihead", _multihead)):  # fmt: skip
    register_attention_layout(_name, _layout)

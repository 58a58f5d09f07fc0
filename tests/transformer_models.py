"""Small random-init transformers built from configs (no hub), with an input batch each, for the attention tests.

Head size 16 everywhere (width 32, 2 heads), so the TensorRT target keeps the attention quantizers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def hugging_face_model(name: str, layers: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``"bert"``, ``"distilbert"``, ``"roberta"`` (a padded text batch) or ``"vit"`` (an image batch)."""
    tf = pytest.importorskip("transformers")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    text = {"input_ids": ids, "attention_mask": mask}
    small = dict(num_hidden_layers=layers, num_attention_heads=2, intermediate_size=32, num_labels=3)
    if name == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(vocab_size=50, hidden_size=32, **small)), text
    if name == "roberta":
        config = tf.RobertaConfig(vocab_size=50, hidden_size=32, max_position_embeddings=20, **small)
        return tf.RobertaForSequenceClassification(config), text
    if name == "distilbert":
        config = tf.DistilBertConfig(vocab_size=50, dim=32, n_layers=layers, n_heads=2, hidden_dim=32, num_labels=3)
        return tf.DistilBertForSequenceClassification(config), text
    config = tf.ViTConfig(image_size=8, patch_size=4, hidden_size=32, **small)
    return tf.ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 8, 8)}


def random_biases(model: nn.Module, std: float = 0.3, seed: int = 0) -> None:
    """Trained-looking biases, in place: every parameter named ``bias`` (MultiheadAttention's ``in_proj_bias``
    too) drawn from N(0, std²). Random init leaves them 0, and a rewrite may drop a bias of zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(std * torch.randn(param.shape, generator=generator))

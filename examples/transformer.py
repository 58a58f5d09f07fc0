"""A Hugging Face transformer to INT8: every Linear and the attention matmuls quantized, exported, run on ORT.

Builds a small BERT classifier from a config (no download; use ``from_pretrained`` for your trained weights),
smooths the Linear inputs (SmoothQuant), calibrates on dict batches (a tokenizer's output), exports for ONNX
Runtime with dynamic batch and sequence axes and runs the engine at another sequence length.

    pip install -e ".[transformers]" && python examples/transformer.py
"""

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

import qdq
from qdq.runtime import load_runtime

torch.manual_seed(0)
config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, num_labels=3)  # fmt: skip
model = BertForSequenceClassification(config).eval()  # or .from_pretrained(...): your trained weights


def batch(size: int, length: int) -> dict[str, torch.Tensor]:
    """What a tokenizer returns (``dict(tokenizer(texts, return_tensors="pt", padding=True))``)."""
    ids = torch.randint(0, config.vocab_size, (size, length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


calibration = [batch(8, 32) for _ in range(4)]  # calibrate on the sequence length you deploy
model = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))  # attention quantized too
# Optional, for activations with outlier channels; fold=False: each scale rides on its input quantizer (see the guide)
smoothing = qdq.smooth_inputs(model, calibration, alpha=0.5, fold=False)
qdq.calibrate(model, calibration, method="percentile", progress=False)
path = qdq.export_onnx(model, calibration[0], "bert_int8.onnx")  # inputs named input_ids, attention_mask

probe = batch(2, 48)  # another batch size and sequence length: both axes are dynamic
with load_runtime(path, "onnxruntime", threads=2) as engine:
    logits = engine.run({name: value.numpy() for name, value in probe.items()})[0]
with torch.no_grad():
    reference = model(**probe).logits.numpy()
print(f"engine logits {logits.shape}; largest difference from PyTorch: {np.abs(logits - reference).max():.4f} "
      f"(logits span {np.ptp(reference):.3f})")
print(f"smoothed {len(smoothing.scales)} Linear inputs, each carrying its scale as pre_quant_scale")

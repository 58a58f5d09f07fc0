"""An accuracy budget met at the lowest measured latency: ``qdq.tune`` leaves float the fewest tensors it needs.

A small CNN trained on scikit-learn's 8x8 digits (seconds), exported to FP32 ONNX; calibrated with ``max``, its
plain INT8 file misses an output-SQNR budget against FP32; ``tune`` finds which tensors to leave float, times every
configuration on ONNX Runtime and keeps the fastest that meets the budget on held-out data.

    python examples/tune_budget.py
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import qdq

# --- what you hold: an FP32 ONNX file and some of its input data --------------------------------------------------
torch.manual_seed(0)
digits = load_digits()
images = (digits.images[:, None] / 16).astype(np.float32)  # [1797, 1, 8, 8] in [0, 1]
net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                    nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                    nn.Linear(32, 10))  # fmt: skip
optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
for _ in range(5):
    for start in range(0, 1400, 50):
        optimizer.zero_grad()
        x, y = torch.from_numpy(images[start : start + 50]), torch.from_numpy(digits.target[start : start + 50])
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
torch.onnx.export(net.eval(), (torch.from_numpy(images[:1]),), "digits_fp32.onnx", input_names=["pixels"],
                  output_names=["logits"], dynamic_axes={"pixels": {0: "batch"}}, dynamo=False)
calibration = [{"pixels": images[i : i + 50]} for i in range(0, 400, 50)]
evaluation = [{"pixels": images[i : i + 64]} for i in range(1400, 1784, 64)]  # every other batch is held out

# --- the budget: outputs within 45 dB SQNR of FP32's (Budget.agreement, .drop and .minimum take others) -----------
result = qdq.tune("digits_fp32.onnx", calibration, evaluation, "digits_tuned.onnx", budget=qdq.Budget.sqnr(45.0),
                  method="max", rounds=3, progress=False)  # fmt: skip
print(result.report())
print(f"plain INT8 meets the budget: {result.int8.meets(result.budget)}; tuned file: {result.path}")

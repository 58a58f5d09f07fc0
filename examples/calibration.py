"""Choosing and checking calibration: every method from one pass, the diagnostics, the clipping warning, auto.

Trains a small CNN on scikit-learn's 8x8 digits, then: scores every calibration method with ``qdq.ptq`` (one
statistics pass), prints the per-quantizer diagnostics, shows the ``QdqCalibrationWarning`` a clipping range
raises, and calibrates with the default, ``method="auto"`` (the method whose quantized model stays closest to the
float model on calibration batches held out from setting the ranges; no labels needed).

    python examples/calibration.py
"""

import copy
import warnings

import torch
from sklearn.datasets import load_digits
from torch import nn

import qdq

torch.manual_seed(0)
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
labels = torch.tensor(digits.target)
train = list(zip(images[:1400].split(50), labels[:1400].split(50)))
test = list(zip(images[1400:].split(100), labels[1400:].split(100)))

model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))  # fmt: skip
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for _ in range(8):
    for x, y in train:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
model.eval()


def accuracy(m: nn.Module) -> float:
    """Top-1 % on the held-out images: what ptq maximises (higher is better)."""
    with torch.no_grad():
        return 100 * sum(int((m(x).argmax(1) == y).sum()) for x, y in test) / sum(len(y) for _, y in test)


calib = train[:8]
float_accuracy = accuracy(model)  # before quantize_model: the model passed in may not be run after it
quantized = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))

# 1. Every method (max, entropy, mse, percentiles) from one histogram pass, each scored, the best kept.
result = qdq.ptq(quantized, calib, accuracy, progress=False)
print(result.table())

# 2. What each activation range clips, from the statistics already collected.
print(qdq.calibration_report(quantized))

# 3. A range that cuts off much of an activation's energy raises a warning naming the quantizer and what to do.
clipped = copy.deepcopy(quantized)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", qdq.QdqCalibrationWarning)
    qdq.calibrate(clipped, calib, method="percentile", percentile=50.0, progress=False)
for warning in caught:
    if issubclass(warning.category, qdq.QdqCalibrationWarning):
        print("warning:", "\n  ".join(str(warning.message).splitlines()[:2]))

# 4. The default, auto: every method's ranges from most batches, scored on the held-out ones without labels.
auto = qdq.calibrate(copy.deepcopy(quantized), calib, progress=False)
chosen = next(q.amax_method for _, q in qdq.workflow.named_quantizers(auto, weights=False))
print(f"auto: {accuracy(auto):.2f} % ({chosen}; float {float_accuracy:.2f} %, best by labels {result.best.method})")

"""Quantization-aware training: recover what PTQ loses, with checkpoints that resume exactly.

Trains a small CNN on scikit-learn's 8x8 digits, quantizes it with 4-bit weights (where PTQ loses accuracy),
calibrates, then fine-tunes with ``qdq.qat`` (the seed toolkit's schedule: from 1 % of the training LR, cosine)
in two runs: the second resumes from the first one's checkpoint, as after an interruption.

    python examples/qat.py
"""

import tempfile

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
TRAINING_LR = 0.05  # the LR the float model was trained with: qat starts from 1 % of it

model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                      nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=TRAINING_LR, momentum=0.9)
for _ in range(6):
    for x, y in train:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def accuracy(m: nn.Module) -> float:
    m.eval()
    with torch.no_grad():
        return 100 * sum(int((m(x).argmax(1) == y).sum()) for x, y in test) / sum(len(y) for _, y in test)


print(f"FP32: {accuracy(model):.2f} %")
weights_4bit = qdq.QuantDescriptor(num_bits=4, axis=(0,))  # per output channel
config = qdq.QuantConfig(quant_desc_weight=weights_4bit, target="onnxruntime")
model = qdq.quantize_model(model, config)
qdq.calibrate(model, train[:8], method="mse", progress=False)
print(f"W4A8 after PTQ: {accuracy(model):.2f} %")

with tempfile.TemporaryDirectory() as checkpoints:
    # Epoch 1 of 2, then "interrupted"; the checkpoint (written atomically) holds model, optimizer, scheduler, RNG.
    first = qdq.qat(model, train, accuracy, epochs=1, lr=TRAINING_LR, checkpoint_dir=checkpoints, progress=False)
    print(f"W4A8 after QAT epoch 1: {first.final_score:.2f} %")
    # The same call with epochs=2 and resume=True continues at epoch 2, as if it had never stopped.
    second = qdq.qat(model, train, accuracy, epochs=2, lr=TRAINING_LR, checkpoint_dir=checkpoints, resume=True,
                     progress=False)  # fmt: skip
    print(f"W4A8 after QAT epoch 2 (resumed from epoch {second.resumed_from_epoch}): {second.final_score:.2f} %")
qdq.export_onnx(model, images[:8], "cnn_w4a8_qat.onnx")

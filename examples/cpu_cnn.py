"""A trained PyTorch CNN to an INT8 engine on a CPU: ONNX Runtime, and OpenVINO where it is installed.

Trains a small residual CNN on scikit-learn's 8x8 digits (seconds), quantizes it for the ``onnxruntime`` target,
calibrates, exports Q/DQ ONNX, checks each engine against the PyTorch model and times INT8 against FP32.

    python examples/cpu_cnn.py
"""

import importlib.util

import torch
from sklearn.datasets import load_digits
from torch import nn

import qdq
from qdq.runtime import compare_models

torch.manual_seed(0)
digits = load_digits()  # 1,797 images of 8x8 pixels, 16 grey levels
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
labels = torch.tensor(digits.target)
train = list(zip(images[:1400].split(50), labels[:1400].split(50)))  # (inputs, labels) batches
test = list(zip(images[1400:].split(100), labels[1400:].split(100)))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                   nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(torch.relu(x + self.block(x)))


def accuracy(model: nn.Module) -> float:
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
    return 100 * hits / sum(len(y) for _, y in test)


# --- what you hold: a trained float model (here trained in a few seconds) ---------------------------------------
model = SmallResNet()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for _ in range(8):
    for x, y in train:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
model.eval()
torch.onnx.export(model, (images[:8],), "cnn_fp32.onnx", input_names=["input"], dynamic_shapes=({0: "batch"},),
                  dynamo=True, verbose=False)  # the float baseline the INT8 engine is timed against
print(f"FP32 accuracy: {accuracy(model):.2f} %")

# --- quantize for ONNX Runtime's int8 kernels, calibrate on a few batches, export ---------------------------------
qmodel = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))  # always use the returned model
qdq.calibrate(qmodel, train[:8], method="percentile", progress=False)  # 400 images; labels are ignored
print(f"INT8 (fake-quant) accuracy: {accuracy(qmodel):.2f} %")
path = qdq.export_onnx(qmodel, images[:8], "cnn_int8.onnx")  # for the model's target, onnxruntime

# --- each engine against the PyTorch model, then INT8 against FP32 on the same runtime ----------------------------
runtimes = ["onnxruntime"] + (["openvino"] if importlib.util.find_spec("openvino") else [])
for runtime in runtimes:
    print(qdq.verify(qmodel, path, test, runtime).verdict_line(), f"({runtime})")
    timing = compare_models({"FP32": "cnn_fp32.onnx", "INT8": path}, runtime, baseline="FP32", batch=8,
                            threads=2, rounds=3, iters=10)  # FP32 and INT8 interleaved in each round
    print(f"  {runtime}: FP32 {timing.median_ms('FP32'):.3f} ms, INT8 {timing.median_ms('INT8'):.3f} ms per batch "
          f"of 8, speed-up {timing.speedup('INT8')}")

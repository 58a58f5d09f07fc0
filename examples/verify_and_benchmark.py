"""Verifying and benchmarking an INT8 engine: PASS / FAIL against the PyTorch model, where it departs, how fast.

Quantizes a small CNN (random weights: use your trained model and real data) for ONNX Runtime, exports it, then
checks the engine against the fake-quant model with ``qdq.verify``, locates the first quantizer where an engine
departs (``locate_divergence``), reports which layers run in int8, and times INT8 against FP32, in Python and
with the ``qdq bench`` command.

    python examples/verify_and_benchmark.py
"""

import torch
from torch import nn

import qdq
from qdq.cli import main as qdq_command
from qdq.runtime import benchmark_model, results_table
from qdq.runtime.ort import fusion_report
from qdq.workflow.verification import locate_divergence

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                      nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()
data = [torch.randn(16, 3, 32, 32) for _ in range(4)]  # your validation batches (labels, if any, are not used)
torch.onnx.export(model, (data[0],), "small_fp32.onnx", input_names=["input"], dynamic_shapes=({0: "batch"},),
                  dynamo=True, verbose=False)  # fmt: skip
model = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
qdq.calibrate(model, data, progress=False)
path = qdq.export_onnx(model, data[0], "small_int8.onnx")

# PASS needs top-1 agreement >= 99.5 % and a max error <= 8 output steps (both adjustable); exit code in the CLI.
result = qdq.verify(model, path, data, "onnxruntime")
print(result)
print(result.verdict_line())
# Where an engine departs from PyTorch: the graph cut after each quantizer, compared in that quantizer's steps.
print(locate_divergence(model, path, data[0], "onnxruntime"))

print(fusion_report(path, threads=2).to_markdown())  # which layers ONNX Runtime runs in int8, and why not
fp32 = benchmark_model("small_fp32.onnx", "onnxruntime", batch=8, threads=2, iters=20, label="FP32")
int8 = benchmark_model(path, "onnxruntime", batch=8, threads=2, iters=20, label="INT8")
print(results_table([fp32, int8], baseline=fp32))

# The same from the command line: `qdq bench small_int8.onnx --fp32 small_fp32.onnx --runtime onnxruntime ...`
qdq_command(["bench", str(path), "--fp32", "small_fp32.onnx", "--runtime", "onnxruntime", "--threads", "2",
             "--batch", "8", "--iters", "20"])  # fmt: skip

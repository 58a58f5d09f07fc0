"""An FP32 ONNX file you already hold to INT8: for ONNX Runtime on a CPU, and for TensorRT 11 with an FP16 rest.

The file here is exported from a small CNN trained on scikit-learn's 8x8 digits (seconds); from the line
"what you hold" on, only the file and data are used, as for a detector or OCR model exported by its framework.

    python examples/onnx_file.py
"""

import subprocess
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import qdq

# --- what you hold: an FP32 ONNX file (here made in a few seconds) and some of its input data --------------------
torch.manual_seed(0)
digits = load_digits()
images = (digits.images[:, None] / 16).astype(np.float32)  # [1797, 1, 8, 8] in [0, 1]
labels = digits.target
net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.BatchNorm2d(32), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
for _ in range(10):
    for start in range(0, 1400, 50):
        optimizer.zero_grad()
        x, y = torch.from_numpy(images[start : start + 50]), torch.from_numpy(labels[start : start + 50])
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
torch.onnx.export(net.eval(), (torch.from_numpy(images[:1]),), "digits_fp32.onnx", input_names=["pixels"],
                  output_names=["logits"], dynamic_axes={"pixels": {0: "batch"}}, dynamo=False)

# --- calibration batches: dicts named after the graph inputs (or, from the command line, a .npz of them) ----------
calibration = [{"pixels": images[i : i + 50]} for i in range(0, 400, 50)]
test = [{"pixels": images[i : i + 99]} for i in range(1400, 1797, 99)]
test_labels = labels[1400 : 1400 + sum(len(b["pixels"]) for b in test)]

# --- ONNX Runtime on a CPU: every Conv a QLinearConv -------------------------------------------------------------
result = qdq.quantize_onnx("digits_fp32.onnx", calibration, "digits_int8.onnx", target="onnxruntime",
                           method="percentile", progress=False)  # fmt: skip
print(result.report())


def accuracy(reference: list, engine: list) -> float:  # a metric of your own: here, against the labels
    return float(np.mean(engine[0].argmax(1) == test_labels))


# INT8 against FP32: a few samples near a decision boundary flip, so ask for the agreement your task needs
check = qdq.verify("digits_fp32.onnx", result.path, test, min_agreement=98.0, metric=accuracy, min_metric=0.9)
print(check)
print(check.verdict_line())
fp32 = qdq.verify("digits_fp32.onnx", "digits_fp32.onnx", test, metric=accuracy)  # the file against itself
print(f"accuracy: FP32 {fp32.metric:.4f}, INT8 {check.metric:.4f}")

# --- TensorRT 11: INT8 Q/DQ, the float part in FP16, checked against TensorRT's rules ----------------------------
trt = qdq.quantize_onnx("digits_fp32.onnx", calibration, "digits_trt11.onnx", target="tensorrt",
                        method="percentile", target_options={"float": "fp16"}, progress=False)  # fmt: skip
report = qdq.export.check_tensorrt(trt.path)
print(f"TensorRT file: {trt.path.name}, rule check {'PASS' if report.ok else 'FAIL'}")

# --- the same from the command line ---------------------------------------------------------------------------------
np.savez("digits_calibration.npz", pixels=images[:400])
np.savez("digits_test.npz", pixels=images[1400:])
cli = [sys.executable, "-m", "qdq.cli"]
subprocess.run([*cli, "quantize", "--model", "digits_fp32.onnx", "--data", "digits_calibration.npz",
                "--target", "onnxruntime", "--calib", "percentile", "--out", "digits_cli_int8.onnx"], check=True)
subprocess.run([*cli, "verify", "digits_cli_int8.onnx", "--reference", "digits_fp32.onnx", "--data",
                "digits_test.npz", "--min-agreement", "95"], check=True)  # exit code 0 on PASS, 1 on FAIL

"""A PyTorch CNN for TensorRT 11: INT8 Q/DQ with the rest of the network in FP16, checked against TensorRT's rules.

TensorRT 11 builds strongly typed networks only: INT8 exists as Q/DQ nodes and FP16 as the types written in the
ONNX file, with no precision flags. This script quantizes torchvision's ResNet-18 (random weights here: load
yours) for the ``tensorrt`` target with FP16 steps, calibrates, exports INT8 + FP16 and runs the rule check;
TensorRT itself is not needed (the engine build is the printed trtexec command, on a machine with a GPU).

    python examples/tensorrt_cnn.py
"""

import subprocess
import sys

import torch
import torchvision

import qdq

torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10).eval()  # your trained model: load its weights here
batches = [torch.randn(8, 3, 64, 64) for _ in range(4)]  # your calibration images, preprocessed as in training

# Quantize for TensorRT with FP16 steps: PyTorch calibrates and verifies on the grid the file will hold.
config = qdq.QuantConfig(target="tensorrt", target_options={"float": "float16"})
model = qdq.quantize_model(model, config)  # always use the returned model
qdq.calibrate(model, batches, method="percentile", progress=False)

# INT8 Q/DQ where the model is quantized, FP16 everywhere else; nodes whose values overflow FP16 on the
# calibration data stay FP32 and are listed in the file's conversion record.
path = qdq.export_onnx(model, batches[0], "resnet18_trt11.onnx", target_options={"calibration_data": batches})

report = qdq.export.check_tensorrt(path)  # TensorRT's explicit-quantization and strong-typing rules, per node
print(report)
assert report.ok, "the graph breaks a TensorRT rule"

# The same check from the command line (exit code 0 on PASS, 1 on FAIL):
subprocess.run([sys.executable, "-m", "qdq.cli", "check", str(path), "--target", "tensorrt"], check=True)

print("\nBuild the engine where TensorRT 11 is installed (strongly typed: no --int8 / --fp16 flags):")
print(f"  trtexec --onnx={path} --saveEngine=resnet18_trt11.plan")

"""The TensorRT 11 export (INT8 Q/DQ, float part in FP16) of resnet50, efficientnet_b0 and a ViT, measured.

For each model (random init, quantized for target "tensorrt", max-calibrated on random images):

1. export the float32 Q/DQ graph; convert it to float16 with ranges measured on the calibration batches;
2. TensorRT rule check of both files (PASS/FAIL, FP32 compute nodes outside the allow-list, counted);
3. sizes: whole file, float-layer initializers (FP32 vs FP16) and quantized weights (FP32 vs int8 codes);
4. fidelity, on evaluation batches different from the calibration ones, all in ONNX Runtime (CPU):
   * ``steps``: output error in int8 steps of the reference output (``max |ref| / 127``);
   * grid: the float32 export vs the same graph with its steps rounded to float16 (``round_scales``);
   * ORT fp16: the float16 file vs that rounded float32 graph (same grid: float16 arithmetic alone), with the
     per-quantizer int8 code agreement and whether every QuantizeLinear is exact on its own input;
   * torch fp16: the PyTorch model with the same float16 steps (``TensorQuantizer.step_type``), run in float16
     vs float32 on the CPU — what float16 arithmetic does to the same quantized model outside ONNX Runtime;
   * explained = ORT fp16 relative L2 error / torch fp16 relative L2 error (about 1: the file's difference is
     what float16 arithmetic does);
   * int8 vs float: the quantized PyTorch model against itself with its quantizers off — the size of the
     quantization noise that a float16 rounding re-draws (a value near a rounding boundary flips a code).

BatchNorm statistics are re-estimated on the calibration images first (``reestimate_batchnorm``): with the
default statistics a random-init network's activations vanish (EfficientNet) or explode (ResNet-50) with depth.

Nothing is timed (ONNX Runtime's CPU FP16 path converts to FP32 around most kernels; speed is TensorRT's).

    python benchmarks/trt11_fp16.py [--models resnet50 efficientnet_b0 vit] [--size 224] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import torchvision

import qdq
from qdq.export import check_tensorrt, compare_graphs, convert_float_precision, export_onnx, round_scales
from qdq.markdown import markdown_table
from qdq.placement import apply_placement
from qdq.quantizer import TensorQuantizer
from qdq.targets.tensorrt.float_fidelity import weight_bytes


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "vit":
        try:
            import timm

            return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000)
        except ImportError:  # torchvision's ViT-B/16 with 4 layers
            from torchvision.models.vision_transformer import VisionTransformer

            return VisionTransformer(224, 16, num_layers=4, num_heads=12, hidden_dim=768, mlp_dim=3072)
    return getattr(torchvision.models, name)()


def reestimate_batchnorm(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.nn.Module:
    """BatchNorm statistics of the random-init model measured on ``batches`` (cumulative average).

    With torchvision's default statistics (mean 0, variance 1) a random-init network's activations drift with
    depth: EfficientNet-B0's vanish (1e-8 in its last blocks), ResNet-50's grow past 500. Measured statistics
    keep every layer normalized, as in a trained network.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    return model.eval()


def quantized(name: str, calib: list[torch.Tensor]) -> torch.nn.Module:
    float_model = reestimate_batchnorm(build(name), calib)
    model = apply_placement(qdq.quantize_model(float_model), target="tensorrt")
    qdq.calibrate(model, calib, method="max", progress=False)
    return model.eval()


def use_float16_steps(model: torch.nn.Module) -> None:
    """Quantize on the FP16 file's grid (what ``QuantConfig(target_options={"float": "float16"})`` sets)."""
    for q in model.modules():
        if isinstance(q, TensorQuantizer):
            q.step_type = "float16"


def steps_apart(reference: np.ndarray, other: np.ndarray) -> float:
    unit = float(np.abs(reference).max()) / 127 or 1.0
    return float(np.abs(reference.astype(np.float64) - other).max() / unit)


def rel_error(reference: np.ndarray, other: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    return float(np.linalg.norm(reference - other) / (np.linalg.norm(reference) or 1.0))


def quantization_error(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Relative L2 error of the quantized model (float32) against the same model with its quantizers off."""
    quantizers = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.is_enabled]
    with torch.no_grad():
        quantized = np.concatenate([model(x).numpy() for x in batches])
        for q in quantizers:
            q.disable()
        try:
            full = np.concatenate([model(x).numpy() for x in batches])
        finally:
            for q in quantizers:
                q.enable()
    return rel_error(full, quantized)


def torch_fp16_steps(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[float, float, float]:
    """(steps, relative L2 error, top-1 agreement) of ``model`` (float16-exact steps) in float16 vs float32."""
    use_float16_steps(model)
    with torch.no_grad():
        full = np.concatenate([model(x).numpy() for x in batches])
        model.half()
        half = np.concatenate([model(x.half()).float().numpy() for x in batches])
        model.float()
    return steps_apart(full, half), rel_error(full, half), float(np.mean(full.argmax(-1) == half.argmax(-1)))


def measure(name: str, size: int, folder: Path) -> dict:
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(4, 3, size, size, generator=gen) for _ in range(2)]
    evaluate = [torch.randn(4, 3, size, size, generator=gen) for _ in range(2)]
    start = time.perf_counter()
    model = quantized(name, calib)
    fp32 = export_onnx(model, calib[0], folder / f"{name}_fp32.onnx")
    conversion = convert_float_precision(
        fp32, "fp16", calibration_data=[x.numpy() for x in calib], path=folder / f"{name}_fp16.onnx"
    )
    fp16 = folder / f"{name}_fp16.onnx"
    check32, check16 = check_tensorrt(fp32), check_tensorrt(fp16)
    before, after = weight_bytes(fp32), weight_bytes(fp16)
    rounded = round_scales(fp32, "fp16")
    feeds = [x.numpy() for x in evaluate]
    grid = compare_graphs(onnx.load(str(fp32)), rounded, feeds)
    ort16 = compare_graphs(rounded, fp16, feeds)
    int8_error = quantization_error(model, evaluate)
    torch_steps, torch_rel, torch_top1 = torch_fp16_steps(model, evaluate)
    return {
        "name": name,
        "conversion": conversion,
        "check32": check32,
        "check16": check16,
        "size32": fp32.stat().st_size,
        "size16": fp16.stat().st_size,
        "before": before,
        "after": after,
        "grid": grid,
        "ort16": ort16,
        "torch_steps": torch_steps,
        "torch_rel": torch_rel,
        "torch_top1": torch_top1,
        "int8_error": int8_error,
        "seconds": time.perf_counter() - start,
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def report(results: list[dict]) -> str:
    checks = [
        [
            r["name"],
            "PASS" if r["check32"].ok else "FAIL",
            "PASS" if r["check16"].ok else "FAIL",
            r["check16"].compute.get("float16", 0),
            r["check16"].compute.get("float32", 0),
            r["check16"].fp32_outside,
            len(r["conversion"].fp32_nodes),
            r["check16"].int8_ops,
            f"{max(r['conversion'].scale_changes.values()):.1e}",
        ]
        for r in results
    ]
    sizes = [
        [
            r["name"],
            mib(r["size32"]),
            mib(r["size16"]),
            f"{r['size16'] / r['size32']:.3f}",
            mib(r["before"]["float_layers"]),
            mib(r["after"]["float_layers"]),
            f"{r['after']['float_layers'] / max(r['before']['float_layers'], 1):.3f}",
            mib(r["before"]["quantized_weights"]),
            mib(r["after"]["quantized_weights"]),
        ]
        for r in results
    ]
    fidelity = [
        [
            r["name"],
            f"{r['grid'].max_steps:.2f}",
            f"{100 * r['ort16'].mean_agreement:.2f} / {100 * r['ort16'].min_agreement:.2f}",
            f"{sum(r['ort16'].q_exact.values())}/{len(r['ort16'].q_exact)}",
            f"{r['ort16'].max_steps:.2f} / {r['ort16'].rel_error:.1e}",
            f"{100 * r['ort16'].top1:.0f}",
            f"{r['torch_steps']:.2f} / {r['torch_rel']:.1e}",
            f"{100 * r['torch_top1']:.0f}",
            f"{r['ort16'].rel_error / max(r['torch_rel'], 1e-12):.2f}",
            f"{r['int8_error']:.1e}",
        ]
        for r in results
    ]
    return "\n\n".join(
        [
            markdown_table(
                [
                    "model",
                    "fp32 export",
                    "fp16 file",
                    "fp16 nodes",
                    "fp32 nodes",
                    "fp32 outside allow-list",
                    "kept fp32 (recorded)",
                    "int8 ops",
                    "largest step change",
                ],
                checks,
            ),
            markdown_table(
                [
                    "model",
                    "fp32 MiB",
                    "fp16 MiB",
                    "ratio",
                    "float layers fp32 MiB",
                    "fp16 MiB",
                    "ratio",
                    "quantized weights fp32 MiB",
                    "int8 MiB",
                ],
                sizes,
            ),
            markdown_table(
                [
                    "model",
                    "grid: fp16 steps vs fp32 steps (steps)",
                    "codes equal ORT fp16 vs fp32, mean / worst %",
                    "Q exact",
                    "ORT fp16 vs fp32 (steps / rel. L2)",
                    "top-1 %",
                    "torch fp16 vs fp32 (steps / rel. L2)",
                    "top-1 %",
                    "explained (ORT / torch rel. L2)",
                    "int8 vs float model (torch, rel. L2)",
                ],
                fidelity,
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "efficientnet_b0", "vit"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", type=Path, help="keep the ONNX files here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = []
        for name in args.models:
            results.append(measure(name, args.size, folder))
            print(f"{name}: {results[-1]['seconds']:.0f} s", flush=True)
        print()
        print(report(results))
        for r in results:
            if r["conversion"].fp32_nodes:
                print(f"\n{r['name']}: {r['conversion']}")


if __name__ == "__main__":
    main()

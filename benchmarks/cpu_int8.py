"""CPU INT8 latency: qdq's engines against ONNX Runtime's own quantizer and FP32, in one run.

For each torchvision model (random init; latency does not depend on the weights' values), calibrated on
generated data, at batch 1 and 8, 2 threads, one session alive at a time:

* ORT FP32 — the FP32 ONNX on ONNX Runtime (the baseline of every ratio);
* ORT quantize_static — ONNX Runtime's own quantizer (QDQ, U8 activations, S8 per-channel weights,
  after its recommended ``quant_pre_process``), the peer;
* qdq INT8 on ORT — ``export_onnx(target="onnxruntime")``;
* OV FP32 (f32) and OV bf16 — the FP32 ONNX on OpenVINO at true f32 and at bf16;
* qdq INT8 on OV — the TensorRT-style graph (``target="tensorrt"``) on OpenVINO.

Usage: python benchmarks/cpu_int8.py [--models resnet18,resnet50,mobilenet_v2,efficientnet_b0]
       [--batches 1,8] [--iters 30] [--threads 2] [--out benchmarks/cpu_int8.md]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
import torchvision

import qdq
from qdq.export import export_onnx
from qdq.placement import apply_placement
from qdq.runtime import benchmark_model
from qdq.runtime.ort import fusion_report
from qdq.workflow.calibrate import calibrate

VARIANTS = ("ORT FP32", "ORT quantize_static", "qdq INT8 on ORT", "OV FP32 (f32)", "OV bf16", "qdq INT8 on OV")


def _calib_batches(size: int, count: int = 4, batch: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(count)]


def _qdq_model(float_model: torch.nn.Module, target: str, data: list[torch.Tensor]) -> torch.nn.Module:
    model = qdq.quantize_model(copy.deepcopy(float_model))
    model = apply_placement(model, target=target)
    calibrate(model, data, method="max", progress=False)
    return model


def _ort_quantize_static(fp32: Path, out: Path, data: list[torch.Tensor]) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{"input": b.numpy()} for b in data])

        def get_next(self):
            return next(self._it, None)

    prep = out.with_name(out.stem + "_prep.onnx")
    quant_pre_process(str(fp32), str(prep))
    quantize_static(str(prep), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
    return out


def _build(name: str, folder: Path, size: int) -> dict[str, Path]:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    data = _calib_batches(size)
    example = data[0][:1]
    paths = {"fp32": folder / f"{name}_fp32.onnx"}
    torch.onnx.export(model, (example,), str(paths["fp32"]), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, opset_version=17,
                      dynamo=False)  # fmt: skip
    paths["ort_static"] = _ort_quantize_static(paths["fp32"], folder / f"{name}_ort_static.onnx", data)
    for target in ("onnxruntime", "tensorrt"):
        paths[target] = export_onnx(_qdq_model(model, target, data), example, folder / f"{name}_{target}.onnx",
                                    target=target)  # fmt: skip
    return paths


def _cases(paths: dict[str, Path]) -> list[tuple[str, Path, str, dict]]:
    return [
        ("ORT FP32", paths["fp32"], "onnxruntime", {}),
        ("ORT quantize_static", paths["ort_static"], "onnxruntime", {}),
        ("qdq INT8 on ORT", paths["onnxruntime"], "onnxruntime", {}),
        ("OV FP32 (f32)", paths["fp32"], "openvino", {"precision": "f32"}),
        ("OV bf16", paths["fp32"], "openvino", {"precision": "bf16"}),
        ("qdq INT8 on OV", paths["tensorrt"], "openvino", {"precision": "f32"}),
    ]


def _measure(name: str, paths: dict[str, Path], batches: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for batch in batches:
        times = {}
        for label, path, runtime, options in _cases(paths):
            result = benchmark_model(path, runtime, label=label, batch=batch, threads=args.threads,
                                     iters=args.iters, warmup=args.warmup, **options)  # fmt: skip
            times[label] = (result.min_ms, result.median_ms)
        rows.append({"model": name, "batch": batch, "times": times})
        print(_row_text(rows[-1]), flush=True)
    return rows


def _row_text(row: dict) -> str:
    base = row["times"]["ORT FP32"][1]
    peer = row["times"]["ORT quantize_static"][1]
    cells = [f"{row['model']} b{row['batch']}"]
    for label in VARIANTS:
        _, med = row["times"][label]
        cells.append(f"{med:.2f} ({base / med:.2f}x)")
    ort_vs_peer = row["times"]["qdq INT8 on ORT"][1] / peer
    ov_vs_peer = row["times"]["qdq INT8 on OV"][1] / peer
    ov_vs_bf16 = row["times"]["qdq INT8 on OV"][1] / row["times"]["OV bf16"][1]
    cells += [f"{ort_vs_peer:.2f}", f"{ov_vs_peer:.2f}", f"{ov_vs_bf16:.2f}"]
    return "| " + " | ".join(cells) + " |"


def _header() -> str:
    cols = ["model", *[f"{v} ms (vs ORT FP32)" for v in VARIANTS],
            "qdq-ORT / ORT-static", "qdq-OV / ORT-static", "qdq-OV / OV bf16"]  # fmt: skip
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenet_v2,efficientnet_b0")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"median ms per inference, {args.threads} threads, {args.iters} runs after {args.warmup} warm-up; "
          "ratio = ORT FP32 median / this median (> 1 is faster); last columns: latency ratios (< 1 is faster)")
    print(_header())
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            paths = _build(name, Path(tmp), args.size)
            _measure(name, paths, batches, args)
            report = fusion_report(paths["onnxruntime"], threads=args.threads)
            print(f"<!-- {name}: qdq graph on ORT: {report.n_int8} int8 kernels {report.int8_kernels}, "
                  f"{report.n_float} float kernels {report.float_kernels} -->", flush=True)


if __name__ == "__main__":
    main()

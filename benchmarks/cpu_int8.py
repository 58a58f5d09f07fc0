"""CPU INT8 latency: qdq's engines against ONNX Runtime's own quantizer and FP32, in one run.

For each torchvision model (random init; latency does not depend on the weights' values), calibrated on
generated data, at batch 1 and 8, 2 threads, one session alive at a time:

* ORT FP32 — the FP32 ONNX on ONNX Runtime (the baseline of every ratio);
* ORT quantize_static — ONNX Runtime's own quantizer (QDQ, U8 activations, S8 per-channel weights,
  after its recommended ``quant_pre_process``), the peer;
* qdq INT8 on ORT — ``export_onnx(target="onnxruntime")``;
* OV FP32 (f32) and OV bf16 — the FP32 ONNX on OpenVINO at true f32 and at bf16;
* qdq INT8 on OV — the TensorRT-style graph (``target="tensorrt"``) on OpenVINO, its float layers
  (SiLU, squeeze-excitation, ...) in f32;
* qdq INT8+bf16 on OV — the same graph with its float layers in bf16 (``INFERENCE_PRECISION_HINT=bf16``,
  OpenVINO's default on CPUs with bf16). This is the row the OpenVINO ratio columns use: it is what a user
  of such a CPU deploys, and it compares like with like against "OV bf16" (float parts in bf16 in both).

On an x86 CPU without VNNI (:mod:`qdq.cpu`) ONNX Runtime's U8S8 kernels saturate: there "ORT quantize_static"
runs as ORT writes it (int8 weights, fast but not exact), "ORT quantize_static reduce_range" is ORT's own remedy
(7-bit weights), "qdq INT8 on ORT" is exported with uint8 weights (exact, ORT's U8U8 kernels), and "qdq W7 on
ORT" quantizes weights to 7 bits (exact in the U8S8 kernels). Without bf16 support the OpenVINO bf16 rows are
left out.

With ``--profile`` it also prints, per model and batch, OpenVINO's own per-kernel timing (PERF_COUNT) of
"OV bf16" and "qdq INT8+bf16 on OV", summed by layer and kernel type: where an INT8 graph is not faster,
this shows which kernels are to blame.

Every variant is timed in ``--rounds`` interleaved rounds; its figure is the best of its round medians.

Usage: python benchmarks/cpu_int8.py [--models resnet18,resnet50,mobilenet_v2,efficientnet_b0]
       [--batches 1,8] [--iters 30] [--rounds 3] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
import torchvision

import qdq
from qdq.cpu import int8_dot_saturates
from qdq.export import export_onnx
from qdq.markdown import markdown_table
from qdq.placement import apply_placement
from qdq.runtime import benchmark_model
from qdq.runtime.openvino import supported_precisions
from qdq.runtime.ort import fusion_report
from qdq.workflow.calibration import calibrate

VARIANTS = (
    "ORT FP32",
    "ORT quantize_static",
    "ORT quantize_static reduce_range",
    "qdq INT8 on ORT",
    "qdq W7 on ORT",
    "OV FP32 (f32)",
    "OV bf16",
    "qdq INT8 on OV",
    "qdq INT8+bf16 on OV",
)
QDQ_OV = "qdq INT8+bf16 on OV"  # the OpenVINO row of the ratio columns (see the module docstring)


def _calib_batches(size: int, count: int = 4, batch: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(count)]


def _qdq_model(
    float_model: torch.nn.Module, target: str, data: list[torch.Tensor], weight_bits: int = 8
) -> torch.nn.Module:
    config = qdq.QuantConfig(quant_desc_weight=qdq.QuantDescriptor(num_bits=weight_bits, axis=0))
    model = qdq.quantize_model(copy.deepcopy(float_model), config)
    model = apply_placement(model, target=target)
    calibrate(model, data, method="max", progress=False)
    return model


def _ort_quantize_static(fp32: Path, out: Path, data: list[torch.Tensor], reduce_range: bool = False) -> Path:
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
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    reduce_range=reduce_range)  # fmt: skip
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
    if int8_dot_saturates():
        paths["ort_static_rr"] = _ort_quantize_static(paths["fp32"], folder / f"{name}_ort_rr.onnx", data, True)
        paths["w7"] = export_onnx(_qdq_model(model, "onnxruntime", data, weight_bits=7), example,
                                  folder / f"{name}_w7.onnx", target="onnxruntime")  # fmt: skip
    return paths


def _cases(paths: dict[str, Path]) -> list[tuple[str, Path, str, dict]]:
    as_written = {"uint8_weights": False}  # the peer's file as ORT wrote it, also where its kernels saturate
    cases = [
        ("ORT FP32", paths["fp32"], "onnxruntime", {}),
        ("ORT quantize_static", paths["ort_static"], "onnxruntime", as_written),
        ("ORT quantize_static reduce_range", paths.get("ort_static_rr"), "onnxruntime", as_written),
        ("qdq INT8 on ORT", paths["onnxruntime"], "onnxruntime", {}),
        ("qdq W7 on ORT", paths.get("w7"), "onnxruntime", {}),
        ("OV FP32 (f32)", paths["fp32"], "openvino", {"precision": "f32"}),
        ("OV bf16", paths["fp32"], "openvino", {"precision": "bf16"}),
        ("qdq INT8 on OV", paths["tensorrt"], "openvino", {"precision": "f32"}),
        ("qdq INT8+bf16 on OV", paths["tensorrt"], "openvino", {"precision": "bf16"}),
    ]
    bf16 = "bf16" in supported_precisions()
    return [case for case in cases if case[1] is not None and (bf16 or "bf16" not in case[0])]


def _measure(
    name: str, paths: dict[str, Path], batches: list[int], args: argparse.Namespace, notes: list[str]
) -> list[dict]:
    """Time every variant in ``args.rounds`` interleaved rounds (each round loads and times each variant
    once, one session alive at a time); a variant's figure is its best round median, so a burst of load
    from elsewhere on the machine hits one round of one variant, not the ratio."""
    rows = []
    for batch in batches:
        medians: dict[str, list[float]] = {label: [] for label, *_ in _cases(paths)}
        for _ in range(args.rounds):
            for label, path, runtime, options in _cases(paths):
                result = benchmark_model(path, runtime, label=label, batch=batch, threads=args.threads,
                                         iters=args.iters, warmup=args.warmup, **options)  # fmt: skip
                medians[label].append(result.median_ms)
        rows.append({"model": name, "batch": batch, "times": {k: min(v) for k, v in medians.items()}})
        print(f"measured {name} batch {batch}: " + " | ".join(_row_cells(rows[-1], list(medians))[1:]), flush=True)
        if args.profile:
            notes += _profile_lines(name, paths, batch, args.threads)
    return rows


def _ov_profile(path: Path, batch: int, threads: int, iters: int = 20) -> dict[tuple[str, str], float]:
    """OpenVINO's per-kernel time (ms per inference) of ``path`` at bf16, summed by (layer type, kernel)."""
    import numpy as np
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    shape = list(model.inputs[0].get_partial_shape().get_min_shape())
    shape[0] = batch
    model.reshape({model.inputs[0].get_any_name(): shape})
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "bf16",
              "PERF_COUNT": True}  # fmt: skip
    request = core.compile_model(model, "CPU", config).create_infer_request()
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    for _ in range(iters):
        request.infer({0: x})
    totals: dict[tuple[str, str], float] = {}
    for _ in range(iters):
        request.infer({0: x})
        for layer in request.profiling_info:
            key = (layer.node_type, layer.exec_type)
            totals[key] = totals.get(key, 0.0) + layer.real_time.total_seconds() * 1e3 / iters
    return totals


def _profile_lines(name: str, paths: dict[str, Path], batch: int, threads: int) -> list[str]:
    lines = []
    labels = (("OV bf16", paths["fp32"]), (QDQ_OV, paths["tensorrt"]))
    if "bf16" not in supported_precisions():
        return []
    for label, path in labels:
        totals = _ov_profile(path, batch, threads)
        top = sorted(((ms, kind) for kind, ms in totals.items() if ms >= 0.01), reverse=True)[:6]
        kernels = ", ".join(f"{node} {kernel} {ms:.2f}" for ms, (node, kernel) in top)
        lines.append(f"OpenVINO {name} b{batch} {label}: kernels sum {sum(totals.values()):.2f} ms: {kernels}")
    return lines


def _row_cells(row: dict, labels: list[str]) -> list[str]:
    times = row["times"]
    base, peer = times["ORT FP32"], times["ORT quantize_static"]
    cells = [f"{row['model']} b{row['batch']}"]
    for label in labels:
        med = times[label]
        cells.append(f"{med:.2f} ({base / med:.2f}x)")
    ov = QDQ_OV if QDQ_OV in times else "qdq INT8 on OV"
    cells += [f"{times['qdq INT8 on ORT'] / peer:.2f}", f"{times[ov] / peer:.2f}"]
    if "OV bf16" in times:
        cells.append(f"{times[QDQ_OV] / times['OV bf16']:.2f}")
    return cells


def _table(rows: list[dict]) -> str:
    labels = [label for label in VARIANTS if label in rows[0]["times"]]
    cols = ["model", *[f"{v} ms (vs ORT FP32)" for v in labels], "qdq-ORT / ORT-static", "qdq-OV / ORT-static"]
    if "OV bf16" in labels:
        cols.append("qdq-OV / OV bf16")
    return markdown_table(cols, [_row_cells(row, labels) for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenet_v2,efficientnet_b0")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round median counts")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--profile", action="store_true", help="print OpenVINO's per-kernel times")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"ms per inference: best of {args.rounds} interleaved round medians, each of {args.iters} runs after "
        f"{args.warmup} warm-up, {args.threads} threads; int8 dot products saturate on this CPU: "
        f"{int8_dot_saturates()}; "
        "ratio = ORT FP32 / this (> 1 is faster); last columns: latency ratios (< 1 is faster)"
    )
    notes: list[str] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            paths = _build(name, Path(tmp), args.size)
            rows += _measure(name, paths, batches, args, notes)
            report = fusion_report(paths["onnxruntime"], threads=args.threads)
            notes.append(
                f"ORT fusion of the qdq graph, {name}: {report.n_int8} int8 kernels {report.int8_kernels}, "
                f"{report.n_float} float kernels {report.float_kernels}"
            )
    print("\n" + _table(rows))
    print("\n" + "\n".join(f"- {line}" for line in notes))


if __name__ == "__main__":
    main()

"""CPU INT8 latency of a CRNN text recognizer: qdq's targets against ONNX Runtime's own quantizer and FP32.

The model (:func:`crnn`, random init): VGG-style convs (6 Conv-BN-ReLU, 4 max-pools) over a 1x32x128 text
line, two bidirectional LSTMs (hidden 128) over the 32 columns, a Linear head to 37 classes, log-softmax,
CTC-shaped output ``(T=32, N, 37)``; 2.2 M parameters. Calibrated on generated data; batch 1 and 8, 2 threads,
one session alive at a time. Variants:

* ORT FP32 — the FP32 ONNX (TorchScript export) on ONNX Runtime: the baseline of every ratio;
* ORT quantize_static — ONNX Runtime's own quantizer (QDQ, U8 activations, S8 per-channel weights, after
  ``quant_pre_process``): the peer; it leaves the LSTMs float;
* qdq INT8 on ORT — ``QuantConfig(target="onnxruntime")``: every conv a ``QLinearConv``, the LSTMs in ORT's
  float LSTM kernel (the target's ``float_recurrent`` rule), the head's input int8;
* qdq INT8 on ORT + DynamicQuantizeLSTM — the same file with its LSTMs given to ONNX Runtime's int8 recurrent
  kernel (``quantize_dynamic(op_types_to_quantize=["LSTM"])``): does that kernel pay?
* qdq tensorrt target on ORT — ``QuantConfig(target="tensorrt")`` (the seed's QuantLSTM, unrolled) on ONNX
  Runtime: what running a graph made for TensorRT there costs.

Every variant is timed in ``--rounds`` interleaved rounds; its figure is the best of its round medians.

Usage: python benchmarks/crnn_int8.py [--batches 1,8] [--iters 30] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from cpu_int8 import _ort_quantize_static
from torch import nn

import qdq
from qdq.cpu import int8_dot_saturates
from qdq.export import export_onnx
from qdq.markdown import markdown_table
from qdq.runtime import benchmark_model
from qdq.runtime.ort import fusion_report
from qdq.workflow.calibration import calibrate

SHAPE = (1, 32, 128)  # one grey text line: channels, height, width
VARIANTS = (
    "ORT FP32",
    "ORT quantize_static",
    "qdq INT8 on ORT",
    "qdq INT8 on ORT + DynamicQuantizeLSTM",
    "qdq tensorrt target on ORT",
)


class CRNN(nn.Module):
    """A small CRNN text recognizer (VGG-style convs, two bidirectional LSTMs, a Linear head; CTC output)."""

    def __init__(self, classes: int = 37, hidden: int = 128) -> None:
        super().__init__()

        def block(cin: int, cout: int, pool: int | tuple[int, int] | None) -> list[nn.Module]:
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            return layers + ([nn.MaxPool2d(pool)] if pool else [])

        self.features = nn.Sequential(
            *block(1, 32, 2), *block(32, 64, 2), *block(64, 128, None), *block(128, 128, (2, 1)),
            *block(128, 256, None), *block(256, 256, (2, 1)),
        )  # fmt: skip
        self.rnn1 = nn.LSTM(512, hidden, bidirectional=True, batch_first=True)
        self.rnn2 = nn.LSTM(2 * hidden, hidden, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, 1, 32, 128)`` images -> ``(T=32, N, classes)`` log-probabilities (what ``nn.CTCLoss`` takes)."""
        f = self.features(x)
        n, c, h, w = f.shape
        f = f.permute(0, 3, 1, 2).reshape(n, w, c * h)
        f, _ = self.rnn1(f)
        f, _ = self.rnn2(f)
        return self.head(f).log_softmax(-1).transpose(0, 1)


def crnn(seed: int = 0) -> CRNN:
    """The benchmark's CRNN, random init, BatchNorm statistics of generated data (eval mode)."""
    torch.manual_seed(seed)
    model = CRNN()
    with torch.no_grad():  # one training-mode pass with momentum 1: BN statistics of the data, not identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = 1.0
        model.train()(calibration_batches()[0])
    return model.eval()


def calibration_batches(count: int = 4, batch: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.rand(batch, *SHAPE, generator=g) for _ in range(count)]


def _qdq_model(float_model: nn.Module, target: str, data: list[torch.Tensor]) -> nn.Module:
    model = qdq.quantize_model(copy.deepcopy(float_model), qdq.QuantConfig(target=target))
    calibrate(model, data, method="max", progress=False)
    return model


def _dynamic_lstm(path: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name(path.stem + "_dynlstm.onnx")
    quantize_dynamic(str(path), str(out), op_types_to_quantize=["LSTM"], weight_type=QuantType.QInt8)
    return out


def _build(folder: Path) -> dict[str, Path]:
    model, data = crnn(), calibration_batches()
    example = data[0][:1]
    paths = {"fp32": folder / "crnn_fp32.onnx"}
    torch.onnx.export(model, (example,), str(paths["fp32"]), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {1: "batch"}}, opset_version=17,
                      dynamo=False)  # fmt: skip
    paths["ort_static"] = _ort_quantize_static(paths["fp32"], folder / "crnn_ort_static.onnx", data)
    for target in ("onnxruntime", "tensorrt"):
        paths[target] = export_onnx(_qdq_model(model, target, data), example, folder / f"crnn_{target}.onnx",
                                    target=target, dynamo=False)  # fmt: skip
    paths["dynamic_lstm"] = _dynamic_lstm(paths["onnxruntime"])
    return paths


def _cases(paths: dict[str, Path]) -> list[tuple[str, Path]]:
    return list(zip(VARIANTS, (paths[k] for k in ("fp32", "ort_static", "onnxruntime", "dynamic_lstm", "tensorrt"))))


def _measure(paths: dict[str, Path], batches: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for batch in batches:
        medians: dict[str, list[float]] = {label: [] for label in VARIANTS}
        for _ in range(args.rounds):
            for label, path in _cases(paths):
                result = benchmark_model(path, "onnxruntime", label=label, batch=batch, threads=args.threads,
                                         iters=args.iters, warmup=args.warmup)  # fmt: skip
                medians[label].append(result.median_ms)
        rows.append({"batch": batch, "times": {k: min(v) for k, v in medians.items()},
                     "spread": {k: max(v) / min(v) for k, v in medians.items()}})  # fmt: skip
        print(f"measured batch {batch}: " + " | ".join(f"{k} {v:.2f}" for k, v in rows[-1]["times"].items()))
    return rows


def _table(rows: list[dict]) -> str:
    cols = ["batch", *[f"{v} ms (vs ORT FP32)" for v in VARIANTS], "qdq-ORT / ORT-static", "round spread (max/min)"]
    out = []
    for row in rows:
        times, base = row["times"], row["times"]["ORT FP32"]
        cells = [f"b{row['batch']}", *[f"{times[v]:.2f} ({base / times[v]:.2f}x)" for v in VARIANTS]]
        cells.append(f"{times['qdq INT8 on ORT'] / times['ORT quantize_static']:.2f}")
        cells.append(f"{max(row['spread'].values()):.2f}")
        out.append(cells)
    return markdown_table(cols, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round median counts")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"ms per inference: best of {args.rounds} interleaved round medians, each of {args.iters} runs after "
        f"{args.warmup} warm-up, {args.threads} threads; int8 dot products saturate on this CPU: "
        f"{int8_dot_saturates()}; ratio = ORT FP32 / this (> 1 is faster); qdq-ORT / ORT-static < 1 is faster"
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = _build(Path(tmp))
        rows = _measure(paths, [int(b) for b in args.batches.split(",")], args)
        notes = []
        for key in ("onnxruntime", "ort_static", "tensorrt"):
            report = fusion_report(paths[key], threads=args.threads)
            notes.append(f"ORT kernels of {paths[key].name}: int8 {report.int8_kernels}, float {report.float_kernels}")
    print("\n" + _table(rows))
    print("\n" + "\n".join(f"- {line}" for line in notes))


if __name__ == "__main__":
    main()

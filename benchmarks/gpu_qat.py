"""QAT train step and calibration pass on a GPU (or the CPU): qdq vs FP32 vs torch's native fake-quant.

For each model and precision (fp32, or bf16 autocast), one train step = forward + cross-entropy +
backward + SGD(momentum) of:

* ``fp32``          - the float model (the baseline of every ratio);
* ``qdq``           - the same model with every Conv2d/Linear quantized by qdq (per-tensor inputs,
  per-channel weights, static max-calibrated ranges), eager;
* ``native``        - the same layers with torch's ``fake_quantize_per_{tensor,channel}_affine`` (peer);
* ``fp32 compiled`` / ``qdq compiled`` - ``torch.compile`` of the first two (``--compile``); the
  compiled qdq ratio is against compiled FP32.

Every variant runs in ``--rounds`` interleaved rounds of ``--steps`` steps (CUDA: synchronised around
each round, so the time covers the queued kernels); a variant's figure is its median step.

Usage (repository root):
    python benchmarks/gpu_qat.py                      # CUDA when available: resnet50 b128, resnet18 b256,
                                                      # mobilenet_v2 b128 at 224x224
    python benchmarks/gpu_qat.py --device cpu --size 64 --batch-scale 0.0625

The calibration pass on a GPU is measured by ``benchmarks/gpu_histogram.py``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from _qat_common import calibrate_max, native_model, train_step
from torch import nn

import qdq
from qdq.markdown import markdown_table

_BATCH = {"resnet50": 128, "resnet18": 256, "mobilenet_v2": 128}
_PRECISION = {"fp32": None, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_rounds(fns: dict[str, Callable[[], None]], device: torch.device, rounds: int, steps: int) -> dict[str, float]:
    """Median ms per call of each function, interleaved round by round (order reversed every other round)."""
    for fn in fns.values():  # warm-up (and compilation)
        fn(), fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(rounds):
        for name in list(fns) if index % 2 == 0 else list(reversed(fns)):
            start = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def _models(name: str, device: torch.device, batch: torch.Tensor) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    fp32 = getattr(torchvision.models, name)(num_classes=1000).to(device)
    quantized = qdq.quantize_model(copy.deepcopy(fp32), qdq.QuantConfig(include_types=(nn.Conv2d, nn.Linear)))
    calibrate_max(quantized, batch[: max(1, batch.shape[0] // 4)])
    return {"fp32": fp32, "qdq": quantized, "native": native_model(fp32, quantized)}


_TRAIN_HEADERS = [
    "model",
    "precision",
    "FP32 ms/step",
    "qdq",
    "torch native fake-quant",
    "FP32 compiled ms",
    "qdq compiled",
]


def bench_train(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    rows = []
    for name in args.models:
        batch_size = max(1, round(_BATCH[name] * args.batch_scale))
        batch = torch.randn(batch_size, 3, args.size, args.size, device=device)
        labels = torch.randint(0, 1000, (batch_size,), device=device)
        models = _models(name, device, batch)
        for precision in args.precisions:
            autocast = _PRECISION[precision]
            steps = {key: train_step(model.train(), batch, labels, autocast) for key, model in models.items()}
            if args.compile:
                for key in ("fp32", "qdq"):
                    compiled = torch.compile(copy.deepcopy(models[key]).train())
                    steps[f"{key} compiled"] = train_step(compiled, batch, labels, autocast)
            ms = _time_rounds(steps, device, args.rounds, args.steps)
            rows.append(_train_row(name, batch_size, precision, ms))
            print("  " + " ".join(rows[-1]), flush=True)
    return rows


def _train_row(name: str, batch: int, precision: str, ms: dict[str, float]) -> list[str]:
    cells = [f"{name} b{batch}", precision, f"{ms['fp32']:.1f}"]
    cells += [f"{ms[key] / ms['fp32']:.2f}x" for key in ("qdq", "native")]
    if "qdq compiled" in ms:
        cells += [f"{ms['fp32 compiled']:.1f}", f"{ms['qdq compiled'] / ms['fp32 compiled']:.2f}x"]
    else:
        cells += ["-", "-"]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="resnet50,resnet18,mobilenet_v2", type=lambda s: s.split(","))
    parser.add_argument("--precisions", default="fp32,bf16", type=lambda s: s.split(","))
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-scale", type=float, default=1.0, help="multiplies the per-model batch sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, {args.size}x{args.size}, median of {args.rounds} rounds")
    print("\n" + markdown_table(_TRAIN_HEADERS, bench_train(args, device)))


if __name__ == "__main__":
    main()

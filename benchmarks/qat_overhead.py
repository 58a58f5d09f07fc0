"""QAT training-step overhead: resnet18 with every conv quantized vs the same model in FP32.

One step = forward + cross-entropy + backward + SGD(momentum) on a batch of 128 images of 32x32, the
setting of the probe (plain torch fake-quant measured 1.42x there). Both models run in the same process,
interleaved round by round, so machine noise hits both alike; the ratio of the per-variant minimum and
median step times is reported. A third variant uses torch's native fake-quant kernels in the same
wrapper, as the peer (faster numerics are only a win if they are also exact; see tensor_quant.py).

Usage: python benchmarks/qat_overhead.py [--rounds 12] [--steps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision
from _qat_common import calibrate_max, native_model, train_step
from torch import nn

import qdq
from qdq.markdown import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = torch.randn(args.batch, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))

    fp32 = torchvision.models.resnet18(num_classes=10)
    qat = torchvision.models.resnet18(num_classes=10)
    qat.load_state_dict(fp32.state_dict())
    qat = qdq.quantize_model(qat, qdq.QuantConfig(include_types=(nn.Conv2d,)))
    calibrate_max(qat, batch)
    native = native_model(fp32, qat)
    variants = {"fp32": fp32, "qdq": qat, "torch-native-fq": native}
    steps = {name: train_step(model.train(), batch, labels) for name, model in variants.items()}
    for step in steps.values():  # warm-up
        step(), step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            for _ in range(args.steps):
                start = time.perf_counter()
                steps[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
    _report(times, args)


def _report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    base_min, base_med = min(times["fp32"]), statistics.median(times["fp32"])
    print(
        f"resnet18 train step, batch {args.batch}, 32x32, {args.threads} threads, "
        f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}"
    )
    rows = []
    for name, values in times.items():
        lo, med = min(values), statistics.median(values)
        rows.append([name, f"{lo:.1f}", f"{med:.1f}", f"{lo / base_min:.2f} / {med / base_med:.2f}"])
    print(markdown_table(["variant", "min ms", "median ms", "ratio vs FP32 (min / median)"], rows))


if __name__ == "__main__":
    main()

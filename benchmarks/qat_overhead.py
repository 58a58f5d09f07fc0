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
from torch import nn

import qdq
from qdq import nn as quant_nn


def _calibrate_max(model: nn.Module, batch: torch.Tensor) -> None:
    """Static amax = max |x| of one batch for every quantizer (what max calibration gives)."""
    quantizers = [m for m in model.modules() if isinstance(m, quant_nn.TensorQuantizer)]
    seen: dict[int, torch.Tensor] = {}

    def hook(module, inputs, _out):
        x = inputs[0].detach()
        if module.axis is None:
            seen[id(module)] = x.abs().max()
        else:
            dims = [d for d in range(x.dim()) if d not in module.axis]
            seen[id(module)] = x.abs().amax(dim=dims, keepdim=True)

    handles = [q.register_forward_hook(hook) for q in quantizers]
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    for quantizer in quantizers:
        quantizer.amax = seen[id(quantizer)]


class _NativeFQConv(nn.Conv2d):
    """Peer: the same conv with torch's native fake-quant kernels (per-tensor input, per-channel weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.fake_quantize_per_tensor_affine(x, float(self.in_amax) / 127, 0, -128, 127)
        scale = (self.w_amax / 127).flatten()
        zero = torch.zeros_like(scale, dtype=torch.int32)
        w = torch.fake_quantize_per_channel_affine(self.weight, scale, zero, 0, -128, 127)
        return self._conv_forward(x, w, self.bias)


def _native_model(reference: nn.Module) -> nn.Module:
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict({k: v for k, v in reference.state_dict().items() if "quantizer" not in k})
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Conv2d):
            quant = reference.get_submodule(name)
            module.__class__ = _NativeFQConv
            module.in_amax = quant.input_quantizer.amax.item()
            module.w_amax = quant.weight_quantizer.amax.clone()
    return model


def _step_fn(model: nn.Module, batch: torch.Tensor, labels: torch.Tensor):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(batch), labels).backward()
        optimizer.step()

    return step


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
    _calibrate_max(qat, batch)
    native = _native_model(qat)
    variants = {"fp32": fp32, "qdq": qat, "torch-native-fq": native}
    steps = {name: _step_fn(model.train(), batch, labels) for name, model in variants.items()}
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
    print("| variant | min ms | median ms | ratio vs FP32 (min / median) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        lo, med = min(values), statistics.median(values)
        print(f"| {name} | {lo:.1f} | {med:.1f} | {lo / base_min:.2f} / {med / base_med:.2f} |")


if __name__ == "__main__":
    main()

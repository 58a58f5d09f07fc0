"""Histogram calibration on a GPU: the per-tensor histogram kernels of ``qdq.calib.binning``, alone and in a pass.

Four measurements, each variant checked bit for bit against the ``scatter_add_`` reference first:

* ``kernel``: one per-tensor histogram (4096 bins) of a post-ReLU activation and of a signed one, per variant,
  timed with CUDA events (median of ``--reps``);
* ``pass``: ``collect_stats(calibrator="histogram")`` of a torchvision model over ``--batches`` batches, per
  variant, interleaved with the FP32 forward over the same batches (ratio to it), and the max pass;
* ``calibrate``: ``qdq.calibrate(model, data)`` with its default method (``auto``: every method, chosen on
  held-out batches) per variant, against the same FP32 forward;
* ``profile`` (``--profile``): the CUDA kernels that take the most device time in one histogram pass, per variant.

Variants: ``histc`` (``torch.histc`` of float bin indices per ``2**22`` elements, zeros counted apart: the path
without triton) and ``triton`` (:func:`qdq.triton_kernels.histogram_triton`, one launch: the default on CUDA).

Usage (repository root, on a CUDA machine; about 100 s on an H200 with the default calibration's host copies, which
are gone since):
    python benchmarks/gpu_histogram.py --profile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torchvision

import qdq
from qdq.calib import binning
from qdq.markdown import markdown_table

_VARIANTS = {"histc": binning._histogram_histc, "triton": binning._histogram_triton}


@contextmanager
def variant(name: str) -> Iterator[None]:
    """Route per-tensor histograms of CUDA tensors through one variant."""
    original = binning._per_tensor_kernel
    kernel = _VARIANTS[name]
    binning._per_tensor_kernel = lambda x, channels, num_bins: (
        kernel if channels == 1 and x.is_cuda else original(x, channels, num_bins)
    )
    try:
        yield
    finally:
        binning._per_tensor_kernel = original


def _tensors(device: torch.device, scale: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    relu = torch.randn(64 // scale, 256, 56, 56, device=device, generator=g).relu_()
    signed = torch.randn(64 // scale, 512, 28, 28, device=device, generator=g) * 3
    return {"post-ReLU 64x256x56x56": relu, "signed 64x512x28x28": signed}


def check(device: torch.device) -> list[str]:
    """Every variant equal to the scatter reference on data with zeros, negatives, tiny values and bin edges."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(300_000, generator=g).relu() * 3, torch.randn(200_000, generator=g) * 2])
    x = torch.cat([x, torch.tensor([0.0, 2.0**-30, 1.0 - 2.0**-24, 1.0, -1.0])]).to(device)
    lines = []
    for unsigned in (False, True):
        for skip_zeros in (False, True):
            for num_bins in (128, 2048, 4096):
                exponent = binning.range_exponent(x.abs().amax().reshape(1))
                scale = (binning._pow2(-exponent) * num_bins).float().reshape(())
                mag = x.clamp(min=0) if unsigned else x.abs()
                index = mag.mul(scale).to(torch.int64).clamp(0, num_bins - 1)
                keep = mag != 0 if skip_zeros else torch.ones_like(mag, dtype=torch.bool)
                reference = torch.bincount(index[keep], minlength=num_bins)
                for name, kernel in _VARIANTS.items():
                    got = kernel(x, scale, num_bins, unsigned=unsigned, skip_zeros=skip_zeros).reshape(-1)
                    ok = torch.equal(got.cpu(), reference.cpu())
                    lines.append(
                        f"{'ok' if ok else 'MISMATCH'} {name} bins={num_bins} unsigned={unsigned} "
                        f"skip_zeros={skip_zeros}"
                    )
    return lines


def _cuda_ms(fn: Callable[[], object], reps: int) -> float:
    if not torch.cuda.is_available():  # a smoke run under TRITON_INTERPRET=1
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_kernels(device: torch.device, reps: int, scale: int) -> list[list[str]]:
    rows = []
    for label, x in _tensors(device, scale).items():
        unsigned = "ReLU" in label
        exponent = binning.range_exponent(x.abs().amax().reshape(1))
        scale = (binning._pow2(-exponent) * 4096).float().reshape(())
        ms = {}
        for name, kernel in _VARIANTS.items():
            fn = partial(kernel, x, scale, 4096, unsigned=unsigned, skip_zeros=False)
            fn()
            ms[name] = _cuda_ms(fn, reps)
        copy_ms = _cuda_ms(x.clone, reps)
        for name, value in ms.items():
            gbs = x.numel() * 4 / value / 1e6
            rows.append(
                [label, name, f"{value:.3f}", f"{value / ms['histc']:.2f}x", f"{gbs:.0f}", f"{value / copy_ms:.1f}x"]
            )
    return rows


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_PASS_HEADERS = ["pass", "variant", "median ms", "spread", "ratio vs FP32 forward"]


def bench_pass(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    fp32 = getattr(torchvision.models, args.model)().to(device).eval()
    quantized = qdq.quantize_model(copy.deepcopy(fp32))
    data = [torch.randn(args.batch, 3, args.size, args.size, device=device) for _ in range(args.batches)]

    def forward() -> None:
        with torch.no_grad():
            for x in data:
                fp32(x)

    def under(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with variant(name):
                fn()

        return run

    def collect(calibrator: str) -> Callable[[], object]:
        return lambda: qdq.collect_stats(quantized, data, calibrator=calibrator, progress=False)

    passes = {"fp32 forward": forward, "max": collect("max")}
    passes.update({f"histogram, {name}": under(name, collect("histogram")) for name in _VARIANTS})
    label = f"{args.model} {args.batches}x{args.batch}"
    rows = _interleaved(passes, args.rounds, label)
    print("\n" + markdown_table(_PASS_HEADERS, rows), flush=True)
    if args.calibrate_rounds:
        default = {"fp32 forward": forward}
        for name in _VARIANTS:
            default[f"calibrate(), {name}"] = under(name, lambda: qdq.calibrate(quantized, data, progress=False))
        print("\n" + markdown_table(_PASS_HEADERS, _interleaved(default, args.calibrate_rounds, label)), flush=True)


def _interleaved(fns: dict[str, Callable[[], None]], rounds: int, label: str) -> list[list[str]]:
    """One warm-up call each, then ``rounds`` interleaved rounds (order reversed every other round)."""
    for fn in fns.values():
        fn()
    _sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(rounds):
        for name in list(fns) if index % 2 == 0 else list(reversed(fns)):
            start = time.perf_counter()
            fns[name]()
            _sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: statistics.median(values) for name, values in times.items()}
    return [
        [
            label,
            name,
            f"{value:.1f}",
            f"{min(times[name]):.1f}-{max(times[name]):.1f}",
            f"{value / ms['fp32 forward']:.2f}x",
        ]
        for name, value in ms.items()
    ]


def profile(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    model = qdq.quantize_model(getattr(torchvision.models, args.model)().to(device).eval())
    data = [torch.randn(args.batch, 3, args.size, args.size, device=device) for _ in range(2)]
    for name in ("histc", "triton"):
        with variant(name):  # warm-up, then one profiled pass
            qdq.collect_stats(model, data, calibrator="histogram", progress=False)
            _sync()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                qdq.collect_stats(model, data, calibrator="histogram", progress=False)
                _sync()
        print(f"\nprofile, {name}, {args.model} 2x{args.batch}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calibrate-rounds", type=int, default=1, help="0: no calibrate() rows")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--kernel-scale", type=int, default=1, help="divides the kernel tensors' batch of 64")
    args = parser.parse_args()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"torch {torch.__version__}, {where}")
    lines = check(device)
    print("\n".join(lines))
    kernel_rows = bench_kernels(device, args.reps, args.kernel_scale)
    print(
        "\n" + markdown_table(["tensor", "variant", "ms", "vs histc", "GB/s read", "vs a copy"], kernel_rows),
        flush=True,
    )
    bench_pass(args, device)
    if args.profile:
        profile(args, device)


if __name__ == "__main__":
    main()

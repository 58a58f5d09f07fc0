"""Calibration benchmark: amax computation on a 2048-bin histogram, and histogram collection.

Run from the repository root::

    python benchmarks/calibration.py            # full run (the seed-style entropy loop takes seconds)
    python benchmarks/calibration.py --quick    # fewer repeats, for a smoke test
    python benchmarks/calibration.py --auto-only --size 112 --repeats 3   # only the diagnostics / auto costs

It prints, per quantizer (one 2048-bin histogram):

* ``qdq.calib`` entropy (signed: 128 levels, unsigned: 256 levels) and mse ``compute_amax`` times
  (target: <= 20 ms each), on a post-ReLU-like histogram and on one with all 2048 bins filled;
* the same computations done the seed's way (pytorch-quantization 2.2: a Python loop over candidate
  bins, per-bin Python loops for the entropy's Q, one fake-quant call per mse candidate), written
  here from the algorithm description as the baseline, and the speed-up;
* histogram collection throughput on activation-sized tensors, and what an exact per-bin sum of ``x**2`` (instead
  of the diagnostics' estimate from the counts) would add to it;
* on resnet18: the calibration pass with the clipping diagnostics against the same pass without them
  (interleaved; issue 24's target <= 1.05x), and the cost of ``method="auto"`` (its comparison pass and its
  model check) against the histogram pass and an FP32 forward.

:func:`time_histogram_collection` is the reusable part: it times one calibration pass of histogram
collection over any list of tensors (e.g. the activations a model produces), for comparison with the
forward pass that produced them.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch

from qdq.calib import HistogramCalibrator
from qdq.calib.base import Calibrator

# -- timing helpers ---------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(min, median) wall time of ``fn`` in seconds over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def time_histogram_collection(
    tensors: Sequence[torch.Tensor],
    make_calibrator: Callable[[], Calibrator] = HistogramCalibrator,
    repeats: int = 3,
) -> tuple[float, float]:
    """Time collecting every tensor of ``tensors`` into fresh calibrators, one per tensor.

    This is what a histogram calibration pass adds on top of the model's forward: each quantizer's
    calibrator sees the tensor its quantizer receives.

    Args:
        tensors: the tensors the quantizers see in one pass (e.g. gathered with forward hooks).
        make_calibrator: builds one calibrator per tensor (default: per-tensor 2048-bin histogram).
        repeats: timed passes (after one warm-up pass).

    Returns:
        (min, median) seconds for one pass over ``tensors``.
    """

    def one_pass() -> None:
        for t in tensors:
            make_calibrator().collect(t)

    return _timed(one_pass, repeats)


# -- the seed's way (baseline), written from the algorithm description -----------------------------------


def seed_style_entropy(counts: np.ndarray, num_bits: int, unsigned: bool, start_bin: int = 128) -> int:
    """Candidate bin minimising KL, with per-candidate Python loops as in the seed (slow by design)."""
    from scipy.stats import entropy as kl_divergence

    bins = counts.astype(np.float64)
    bins[0] = bins[1]
    levels = 1 << (num_bits - 1 + int(unsigned))
    scores = []
    for i in range(start_bin, len(bins) + 1):
        group = np.digitize(range(i), np.linspace(0, i, levels + 1)) - 1
        group[bins[:i] == 0] = -1
        group_mass = np.zeros(levels)
        for j, g in enumerate(group):
            if g != -1:
                group_mass[g] += bins[j]
        for g, size in Counter(group).items():
            if g != -1:
                group_mass[g] /= size
        q = np.zeros(i)
        for j, g in enumerate(group):
            if g != -1:
                q[j] = group_mass[g]
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        scores.append(kl_divergence(p, q))
    scores_arr = np.array(scores)
    return start_bin + len(scores_arr) - 1 - int(np.argmin(scores_arr[::-1]))


def seed_style_mse(counts: np.ndarray, width: float, num_bits: int, unsigned: bool, start_bin: int = 128) -> int:
    """Candidate bin minimising the fake-quant error, one torch call per candidate as in the seed."""
    weights = torch.from_numpy(counts).double()
    centres = (torch.arange(len(counts), dtype=torch.float64) + 0.5).mul(width).float()
    max_bound = 2 ** (num_bits - 1 + int(unsigned)) - 1
    qmin = 0 if unsigned else -max_bound - 1
    errors = []
    for i in range(start_bin, len(counts)):
        step = centres[i] / max_bound
        fq = torch.clamp(torch.round(centres / step), qmin, max_bound) * step
        errors.append(float(((fq.double() - centres.double()) ** 2 * weights).sum()))
    return start_bin + int(np.argmin(errors))


# -- benchmark ----------------------------------------------------------------------------------------


def _histogram_data(kind: str, numel: int = 1 << 20, seed: int = 0) -> torch.Tensor:
    """``"relu"``: half zeros, a gaussian body and a few far outliers (a sparse tail);
    ``"dense"``: uniform values filling all 2048 bins (the most work for entropy and mse)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "dense":
        return torch.rand(numel, generator=gen) * 16
    x = torch.randn(numel, generator=gen).clamp_(min=0)
    x[torch.randint(0, numel, (8,), generator=gen)] = 15.9
    return x


def bench_amax(repeats: int, seed_repeats: int) -> None:
    """Print compute_amax times for 2048-bin histograms, against the seed-style loops."""
    print(f"{'compute_amax, 2048 bins':<40}{'qdq min':>10}{'qdq median':>12}{'seed-style':>12}{'speed-up':>10}")
    for kind in ("relu", "dense"):
        data = _histogram_data(kind)
        for method, unsigned in (("entropy", False), ("entropy", True), ("mse", False), ("mse", True)):
            cal = HistogramCalibrator(num_bins=2048, unsigned=unsigned)
            cal.collect(data)
            counts, width = cal.bin_counts[0].numpy(), float(cal.bin_width[0])
            best, median = _timed(functools.partial(cal.compute_amax, method), repeats)
            if method == "entropy":
                seed_fn = functools.partial(seed_style_entropy, counts, 8, unsigned)
            else:
                seed_fn = functools.partial(seed_style_mse, counts, width, 8, unsigned)
            seed_best = _timed(seed_fn, seed_repeats)[0] if seed_repeats else float("nan")
            used = int(np.nonzero(counts)[0].max()) + 1
            label = f"{method} {'unsigned' if unsigned else 'signed'}, {kind} ({used} bins used)"
            print(
                f"{label:<40}{best * 1e3:>8.1f}ms{median * 1e3:>10.1f}ms{seed_best * 1e3:>10.0f}ms"
                f"{seed_best / median:>9.0f}x"
            )


def bench_collection(repeats: int) -> None:
    """Print histogram collection throughput on activation-sized tensors."""
    x = torch.randn(32, 64, 56, 56)
    print(f"\ncollection of one {tuple(x.shape)} float32 tensor ({x.numel() / 1e6:.1f} M values):")
    for label, factory in (
        ("max of |x| (reference)", None),
        ("histogram, per tensor", lambda: HistogramCalibrator()),
        ("histogram, per channel axis 1", lambda: HistogramCalibrator(axis=1)),
    ):
        if factory is None:
            best, median = _timed(lambda: x.abs().amax(), repeats)
        else:
            best, median = time_histogram_collection([x], factory, repeats)
        print(
            f"  {label:<32}{best * 1e3:>8.1f} ms min {median * 1e3:>8.1f} ms median"
            f"{x.numel() / median / 1e6:>8.0f} M values/s"
        )


def bench_exact_energy(repeats: int) -> None:
    """What keeping an exact per-bin sum of x**2 would cost: a weighted bincount next to the counts."""
    x = torch.randn(32, 64, 56, 56)

    def counts_only() -> None:
        HistogramCalibrator().collect(x)

    def with_energy() -> None:
        cal = HistogramCalibrator()
        cal.collect(x)
        flat = x.reshape(-1)
        index = flat.abs().mul_(4096 / 8).to(torch.int32).clamp_(0, 4095)
        torch.bincount(index, weights=flat.double().square(), minlength=4096)

    plain, exact = [], []
    for _ in range(repeats):
        plain.append(_timed(counts_only, 1)[0])
        exact.append(_timed(with_energy, 1)[0])
    ratio = statistics.median(exact) / statistics.median(plain)
    print(f"  + exact per-bin sum of x**2 (weighted bincount) {statistics.median(exact) * 1e3:8.1f} ms median: "
          f"{ratio:.2f}x the counts alone")


def bench_diagnostics_and_auto(repeats: int, batches: int = 8, batch: int = 16, size: int = 224) -> None:
    """resnet18: the calibration pass with diagnostics vs without, and ``method="auto"`` (the default) against the
    percentile method alone (issue 43: at most 2x), interleaved."""
    import copy
    import warnings

    import torchvision

    import qdq
    from qdq.workflow.auto_calibration import select_amax
    from qdq.workflow.calibration import collect_stats, load_amax

    torch.manual_seed(0)
    float_model = torchvision.models.resnet18().eval()
    quant_model = qdq.quantize_model(copy.deepcopy(float_model))
    data = [torch.randn(batch, 3, size, size) for _ in range(batches)]

    def fp32() -> None:
        with torch.no_grad():
            for x in data:
                float_model(x)

    def calibration(method: str, diagnostics: bool) -> Callable[[], None]:
        def run() -> None:
            collect_stats(quant_model, data, calibrator="histogram", progress=False)
            load_amax(quant_model, method, warn=diagnostics)

        return run

    scoring: list[float] = []

    def auto() -> None:
        scoring.append(select_amax(quant_model, data, progress=False).seconds["scoring"])

    variants = {"FP32 forward": fp32, "calibration, no diagnostics": calibration("entropy", False),
                "calibration + diagnostics": calibration("entropy", True),
                "percentile": calibration("percentile", False), "auto": auto}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qdq.QdqCalibrationWarning)  # random weights: entropy clips; still computed
        for fn in variants.values():
            fn()
        scoring.clear()
        for _ in range(repeats):  # interleaved, so load changes hit every variant
            for name, fn in variants.items():
                times[name].append(_once(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nresnet18, {batches} batches of {batch}x3x{size}x{size}, {repeats} interleaved repeats:")
    for name, t in times.items():
        print(f"  {name:<30}{min(t) * 1e3:9.1f} ms min {med[name] * 1e3:9.1f} ms median")
    base = times["calibration, no diagnostics"]
    ratios = [d / b for d, b in zip(times["calibration + diagnostics"], base)]
    print(f"  diagnostics / no diagnostics  {statistics.median(ratios):8.3f} median of paired ratios "
          f"(spread {min(ratios):.3f}-{max(ratios):.3f})")
    hist = med["calibration, no diagnostics"]
    print(f"  calibration / FP32 forward    {min(base) / min(times['FP32 forward']):8.2f} min "
          f"{hist / med['FP32 forward']:8.2f} median (issue 10's CPU target <= 1.3x)")
    to_percentile = [a / b for a, b in zip(times["auto"], times["percentile"])]
    print(f"  auto / percentile alone       {statistics.median(to_percentile):8.2f} median of paired ratios "
          f"(spread {min(to_percentile):.2f}-{max(to_percentile):.2f}; issue 43's bound <= 2); of auto, scoring the "
          f"candidates {statistics.median(scoring) * 1e3:.1f} ms median")


def _once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and no seed-style entropy loop")
    parser.add_argument("--auto-only", action="store_true", help="only the resnet18 diagnostics / auto part")
    parser.add_argument("--size", type=int, default=224, help="resnet18 input size of that part (pixels)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats of that part (default 7, --quick 2)")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.2f}\n"
    )
    if not args.auto_only:
        bench_amax(repeats=5 if args.quick else 20, seed_repeats=0 if args.quick else 1)
        bench_collection(repeats=2 if args.quick else 5)
        bench_exact_energy(repeats=2 if args.quick else 5)
    repeats = args.repeats or (2 if args.quick else 7)
    bench_diagnostics_and_auto(repeats=repeats, size=args.size)


if __name__ == "__main__":
    main()

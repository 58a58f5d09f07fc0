"""INT8 from an existing ONNX file: every quantizer on two real pretrained models, in one run (issue 34).

Models (from PyPI wheels, offline; loading, data and metrics in ``_onnx_in_models.py``):

* ``nudenet``: nudenet 3.4.2 ``320n.onnx``, a YOLOv8n-style detector, on skimage photos and LFW face mosaics;
  metric: detections (nudenet's own postprocessing) matched to FP32's (same class, IoU >= 0.5): F1; and the SQNR
  of the raw output against FP32's. Timed at batch 1, 320x320 (``NudeDetector.detect`` runs one image at a time).
* ``ppocr``: rapidocr-onnxruntime 1.4.4 ``ch_PP-OCRv4_rec_infer.onnx``, the PP-OCRv4 recognizer, on rendered text
  lines; metric: exact-line accuracy and character error rate against the ground truth. Timed at batch 8, 48x320.

Variants (``_onnx_in_quant.VARIANTS``; each quantizer in its own process, its int8 file in a temporary folder):
FP32; ORT ``quantize_static`` U8S8 and S8S8 (QDQ, per-channel weights) with MinMax, Entropy and Percentile, on the
file raised to opset 13 when older (ORT writes per-channel DequantizeLinear with an ``axis`` that opset 12 lacks)
and after ``quant_pre_process`` when that works (on these two models it fails: the run says how); NVIDIA ModelOpt's
``modelopt.onnx.quantization.quantize`` (int8, max, CPU calibration; float remainder fp16 as by default, fp32, and
fp32 after onnxslim); qdq's ``quantize_onnx`` (target ``onnxruntime`` with each calibration method, target
``tensorrt`` with an fp16 float part) when this qdq has it. The same calibration batches go to every quantizer.

Per variant: the task metric on the held-out set; the latency ratio FP32 / variant on ONNX Runtime (CPU, 2
threads; all variants loaded, timed in interleaved rounds: each round one block of runs per variant, the order
reversed every other round; the figure is the median over rounds of the per-round ratio, with its 25-75 %
percentiles); the quantizer's wall time and its process's peak resident memory; and from ORT's optimized graph
(``qdq.runtime.ort.fusion_report``) the Conv/Gemm/MatMul that run as int8 kernels and as float kernels, and the
QuantizeLinear/DequantizeLinear left with no int8 kernel behind them ("idle").

Installation (every package with ``--no-deps``: none may replace torch, onnx, onnxruntime or numpy):

    pip install --no-deps nudenet==3.4.2 rapidocr-onnxruntime==1.4.4 opencv-python-headless==4.10.0.84 \
        scikit-image==0.26.0 imageio tifffile lazy-loader
    # ModelOpt (optional; its [onnx] extra would replace onnx and onnxruntime): a venv that sees this one's packages
    python -m venv /tmp/venv-modelopt
    echo "$(python -c 'import site; print(site.getsitepackages()[0])')" \
        > "$(/tmp/venv-modelopt/bin/python -c 'import site; print(site.getsitepackages()[0])')/main_venv.pth"
    /tmp/venv-modelopt/bin/pip install --no-deps nvidia-modelopt==0.47.0 ninja nvidia-ml-py omegaconf \
        antlr4-python3-runtime==4.9.3 pulp onnx-graphsurgeon onnxconverter-common onnxslim polygraphy lief \
        cppimport mako pybind11

Usage (repository root):

    PYTHONPATH=src python benchmarks/onnx_in.py [--models nudenet,ppocr] [--variants 'fp32,ort-*,qdq-*']
        [--rounds 7] [--calib-images N] [--eval-images N] [--modelopt-python /tmp/venv-modelopt/bin/python]
        [--int8-weights as-written|exact] [--quick]

On an x86 CPU without VNNI pass ``--int8-weights exact``: files run as written there saturate their int8 dot
products, and their task metric is wrong.

ORT's Entropy and Percentile calibrators keep every activation of every batch: on ppocr with 64 lines they
need more than 13 GiB (killed by the kernel at 13.4 GiB on a shared 24 GiB machine).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _onnx_in_models as models
import numpy as np
from _onnx_in_quant import VARIANTS, Variant, save_batches

import qdq
from qdq.cpu import int8_dot_saturates
from qdq.markdown import markdown_table
from qdq.runtime import Comparison, compare_models, load_runtime
from qdq.runtime.ort import fusion_report

WORKER = Path(__file__).with_name("_onnx_in_quant.py")
QUICK_VARIANTS = "fp32,ort-u8s8-minmax,qdq-ort-max"
RUN_OPTIONS: dict[str, Any] = {"uint8_weights": False}
"""How every file is loaded (``--int8-weights``): as written by default; on an x86 CPU without VNNI
(``qdq.cpu.int8_dot_saturates()``) its U8S8 kernels then saturate, which corrupts the task metric of every file with
int8 weights. ``--int8-weights exact`` runs them as uint8 (qdq.runtime's re-encoding: exact, slower U8U8 kernels):
what a VNNI CPU computes, for every variant alike."""
Batch = dict[str, np.ndarray]


@dataclass
class ModelCase:
    """A real model with its data: ``score(outputs, fp32_outputs)`` gives the metrics of one variant's outputs
    on ``evaluation`` (concatenated over batches), ``describe(metrics)`` their table cell."""

    name: str
    source: Path
    calibration: list[Batch]
    evaluation: list[Batch]
    timing_feed: Batch
    score: Callable[[np.ndarray, np.ndarray], dict]
    describe: Callable[[dict, bool], str]
    notes: list[str] = field(default_factory=list)

    @property
    def timing_batch(self) -> int:
        return len(next(iter(self.timing_feed.values())))


@dataclass
class Row:
    """One variant of one model: its file, how it was made, and what was measured."""

    variant: Variant
    path: Path | None
    job: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    kernels: tuple[int, int, int] | None = None  # int8 kernels, float kernels, idle Q/DQ
    speedup: str = "—"

    @property
    def ok(self) -> bool:
        return self.path is not None


# -- the models ----------------------------------------------------------------------------------------------------


def nudenet_case(calib: int, evals: int) -> ModelCase:
    """nudenet 320n with ``calib`` calibration and ``evals`` evaluation images (batches of 8)."""
    calibration = models.nudenet_split("calibration", calib)
    evaluation = models.nudenet_split("evaluation", evals)
    extents = evaluation.truth

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"{m['fp32_detections']} detections (the reference)"
        return (f"F1 {m['f1']:.2f} ({m['detections']} dets); SQNR {m['sqnr']:.1f} dB, scores "
                f"{m['sqnr_scores']:.1f} dB")  # fmt: skip

    return ModelCase(
        name="nudenet",
        source=models.package_file("nudenet", "320n.onnx"),
        calibration=models.batched(calibration.samples, 8, "images"),
        evaluation=models.batched(evaluation.samples, 8, "images"),
        timing_feed={"images": evaluation.samples[0][None]},
        score=lambda out, ref: models.nudenet_metrics(out, ref, extents),
        describe=describe,
    )


def ppocr_case(calib: int, evals: int) -> ModelCase:
    """PP-OCRv4 recognizer with ``calib`` calibration and ``evals`` evaluation lines (batches of 8)."""
    source = models.package_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx")
    calibration, evaluation = models.ocr_splits(calib, evals)
    characters = models.ocr_characters(source)

    def score(out: np.ndarray, _ref: np.ndarray) -> dict:
        return models.ocr_metrics(list(models.ctc_decode(out, characters)), evaluation.truth)

    return ModelCase(
        name="ppocr",
        source=source,
        calibration=models.batched(calibration.samples, 8, "x"),
        evaluation=models.batched(evaluation.samples, 8, "x"),
        timing_feed=models.batched(evaluation.samples[:8], 8, "x")[0],
        score=score,
        describe=lambda m, _ref: f"lines {m['lines']:.1f} %, CER {m['cer']:.2f} %",
    )


CASES = {"nudenet": nudenet_case, "ppocr": ppocr_case}
DEFAULT_IMAGES = {"nudenet": (32, 32), "ppocr": (64, 160)}  # calibration, evaluation
QUICK_IMAGES = {"nudenet": (8, 8), "ppocr": (8, 16)}


# -- making the files ------------------------------------------------------------------------------------------------


def prepare_for_ort(fp32: Path, notes: list[str]) -> Path:
    """The file ORT's ``quantize_static`` gets: opset raised to 13 when older, then ``quant_pre_process`` (its
    documented first step) when it works; each step's outcome is appended to ``notes``."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model = onnx.load(str(fp32))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    path = fp32
    if opset < 13:
        path = fp32.with_name("fp32_opset13.onnx")
        onnx.save(onnx.version_converter.convert_version(model, 13), str(path))
        notes.append(f"opset {opset} -> 13 for ORT's quantizer (per-channel DequantizeLinear needs `axis`)")
    prep = path.with_name("fp32_prep.onnx")
    try:
        with contextlib.chdir(path.parent):  # it leaves its temporary files in the working folder
            quant_pre_process(str(path), str(prep))
    except Exception as err:
        notes.append(f"`quant_pre_process` failed ({type(err).__name__}: {(str(err).splitlines() or [''])[0]}): "
                     "ORT's quantizer runs without it")  # fmt: skip
        return path
    notes.append("`quant_pre_process` succeeded")
    return prep


def run_worker(variant: Variant, source: Path, calibration: Path, folder: Path, args: argparse.Namespace) -> Row:
    """Quantize ``source`` as ``variant`` says in a fresh process (``_onnx_in_quant.py``)."""
    return Row(variant, *run_job(variant, source, calibration, folder, args))


def run_job(variant: Variant, source: Path, calibration: Path, folder: Path,
            args: argparse.Namespace) -> tuple[Path | None, dict[str, Any]]:  # fmt: skip
    """The worker's run of ``variant`` on ``source`` (``args``: ``modelopt_python``, ``worker_timeout``): its file
    (None when it failed) and its result record. ``benchmarks/zoo.py`` runs its variants through it too."""
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / source.name
    model.unlink(missing_ok=True)
    os.link(source, model)  # ModelOpt writes intermediate files beside its input
    job = {"variant": variant.name, "quantizer": variant.quantizer, "options": dict(variant.options),
           "model": str(model), "calibration": str(calibration), "output": str(folder / "int8.onnx"),
           "result": str(folder / "result.json")}  # fmt: skip
    (folder / "job.json").write_text(json.dumps(job))
    for stale in ("result.json", "int8.onnx"):
        (folder / stale).unlink(missing_ok=True)
    python = args.modelopt_python if variant.quantizer == "modelopt" else sys.executable
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        done = subprocess.run([python, str(WORKER), str(folder / "job.json")], capture_output=True, text=True,
                              timeout=args.worker_timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, {"error": f"no result in {args.worker_timeout} s"}
    result_file = folder / "result.json"
    if result_file.exists():
        result = json.loads(result_file.read_text())
        return (Path(job["output"]) if result["ok"] else None), result
    return None, _death(done, children_peak)


def _death(done: subprocess.CompletedProcess, children_peak: int) -> dict[str, Any]:
    """The result of a worker that died without writing one: how it ended and, when the kernel's record of the
    largest child grew (``RUSAGE_CHILDREN``), its peak resident memory."""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result: dict[str, Any] = {"rss_peak_mib": peak / 1024 if peak > children_peak else None, "rss_start_mib": 0}
    if done.returncode == -signal.SIGKILL:
        result["error"] = "killed (SIGKILL: out of memory, most likely)"
    else:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        result["error"] = f"the process exited with {done.returncode}: {tail}"[:300]
    return result


def make_rows(case: ModelCase, variants: list[Variant], folder: Path, args: argparse.Namespace) -> list[Row]:
    """FP32 and each variant's file of ``case``, each quantizer in its own process."""
    fp32 = folder / "fp32.onnx"
    shutil.copyfile(case.source, fp32)
    calibration = folder / "calibration.npz"
    save_batches(case.calibration, calibration)
    ort_input = prepare_for_ort(fp32, case.notes) if any(v.quantizer == "ort" for v in variants) else fp32
    rows = [Row(VARIANTS[0], fp32)]
    for variant in variants:
        if variant.quantizer:
            source = ort_input if variant.quantizer == "ort" else fp32
            rows.append(run_worker(variant, source, calibration, folder / variant.name, args))
            state = "ok" if rows[-1].ok else rows[-1].job.get("error")
            print(f"  {case.name} {variant.name}: {state}", flush=True)
    return rows


# -- measuring -------------------------------------------------------------------------------------------------------


def outputs_of(path: Path, batches: list[Batch], threads: int) -> np.ndarray:
    """The first output of ``path`` on every batch, concatenated, as float32."""
    with load_runtime(path, "onnxruntime", threads=threads, **RUN_OPTIONS) as runtime:
        return np.concatenate([runtime.run(batch)[0].astype(np.float32) for batch in batches])


def score_rows(case: ModelCase, rows: list[Row], threads: int) -> None:
    """Fill each row's task metrics and kernel counts."""
    reference = outputs_of(rows[0].path, case.evaluation, threads)  # type: ignore[arg-type]
    for row in rows:
        if not row.ok:
            continue
        row.metrics = case.score(outputs_of(row.path, case.evaluation, threads), reference)  # type: ignore[arg-type]
        report = fusion_report(row.path, threads=threads, **RUN_OPTIONS)  # type: ignore[arg-type]
        row.kernels = (report.n_int8, report.n_float, len(report.idle))


def _loading() -> str:
    if RUN_OPTIONS["uint8_weights"] is False:
        return "files run as written"
    return "int8 weights run as uint8 where the CPU saturates: exact, what a VNNI CPU computes, for every variant"


def interleaved(paths: dict[str, Path], feed: Batch, args: argparse.Namespace) -> Comparison:
    """Time ``paths`` (label -> file, the first the baseline) on ``feed`` (real inputs) in interleaved rounds:
    :func:`qdq.runtime.compare_models`, every file loaded as ``--int8-weights`` says."""
    return compare_models(paths, "onnxruntime", threads=args.threads, rounds=args.rounds, iters=args.iters,
                          warmup=args.warmup, batch=len(next(iter(feed.values()))), inputs=feed,
                          **RUN_OPTIONS)  # fmt: skip


def time_rows(case: ModelCase, rows: list[Row], args: argparse.Namespace) -> None:
    """Fill each working row's latency ratio against FP32."""
    good = {row.variant.name: row.path for row in rows if row.ok}
    comparison = interleaved(good, case.timing_feed, args)  # type: ignore[arg-type]
    for row in rows:
        if row.ok:
            row.speedup = str(comparison.speedup(row.variant.name))


# -- the table -------------------------------------------------------------------------------------------------------


def _cells(case: ModelCase, row: Row) -> list[object]:
    reference = not row.variant.quantizer
    metric = case.describe(row.metrics, reference) if row.metrics else None
    job = row.job
    seconds = f"{job['seconds']:.1f}" if job.get("seconds") is not None else None
    memory = None
    if job.get("rss_peak_mib") is not None:
        memory = f"{job['rss_peak_mib']:.0f}"
        memory += f" (+{job['rss_peak_mib'] - job['rss_start_mib']:.0f})" if job.get("rss_start_mib") else " at death"
    kernels = f"{row.kernels[0]} / {row.kernels[1]}" if row.kernels else None
    idle = row.kernels[2] if row.kernels else None
    note = job.get("error") or ""
    return [case.name, row.variant.name, metric, row.speedup, seconds, memory, kernels, idle, note]


HEADERS = ["model", "variant", "task metric (held-out set)", "speed-up vs FP32 (25-75 %)", "calib s",
           "peak RSS MiB (+calib)", "int8 / float kernels", "idle Q/DQ", "note"]  # fmt: skip


def legend(args: argparse.Namespace, cases: list[ModelCase]) -> str:
    """What the columns mean, the machine and the command."""
    import onnxruntime

    sizes = "; ".join(
        f"{c.name}: {sum(len(next(iter(b.values()))) for b in c.calibration)} calibration / "
        f"{sum(len(next(iter(b.values()))) for b in c.evaluation)} evaluation samples, timed at batch "
        f"{c.timing_batch}"
        for c in cases
    )
    return "\n".join(
        [
            f"Command: `{' '.join(sys.argv)}`",
            f"Machine: {_cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; onnxruntime "
            f"{onnxruntime.__version__}, {args.threads} threads; Python {platform.python_version()}; int8 dot products "
            f"saturate on this CPU: {int8_dot_saturates()} ({_loading()}). {sizes}.",
            "",
            "- task metric: nudenet: F1 of the detections (nudenet's postprocessing: score >= 0.2, class-agnostic NMS "
            "0.25 / IoU 0.45) against FP32's (same class, IoU >= 0.5), summed over the images; SQNR of the whole raw "
            "output [N, 22, anchors] and of its 18 class-score rows against FP32's. ppocr: exact lines and character "
            "error rate against the rendered text (spaces removed from both: FP32 itself drops inter-word spaces).",
            f"- speed-up vs FP32: FP32 latency / variant latency on ONNX Runtime (> 1: faster): median over "
            f"{args.rounds} interleaved rounds of the per-round ratio (each round: {args.warmup} untimed + "
            f"{args.iters} timed runs per variant, all loaded), 25th-75th percentile in brackets.",
            "- calib s: wall time of the quantizer call (load, calibrate, write) in its own process. peak RSS: that "
            "process's peak resident memory (`ru_maxrss`), and in brackets its growth during the call.",
            "- int8 / float kernels: Conv/Gemm/MatMul of ORT's optimized graph that run as int8 kernels (QLinearConv, "
            "QGemm, MatMulInteger...) / as float kernels. idle Q/DQ: QuantizeLinear/DequantizeLinear left in that "
            "graph with no int8 kernel behind them (`FusionReport.idle`: pure conversion cost).",
        ]
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# -- the run ---------------------------------------------------------------------------------------------------------


def select_variants(pattern: str) -> tuple[list[Variant], list[str]]:
    """The variants matching the comma-separated names or globs of ``pattern`` (FP32 always), and notes."""
    wanted = [p.strip() for p in pattern.split(",") if p.strip()]
    chosen = [v for v in VARIANTS[1:] if any(fnmatch.fnmatch(v.name, p) for p in wanted)]
    notes = []
    if any(v.quantizer == "qdq" for v in chosen) and not hasattr(qdq, "quantize_onnx"):
        chosen = [v for v in chosen if v.quantizer != "qdq"]
        notes.append("qdq variants skipped: this qdq has no `quantize_onnx` yet")
    return chosen, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nudenet,ppocr", help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--variants", default="*", help="comma-separated names or globs (fp32 is always run)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calib-images", type=int, help="calibration samples per model (nudenet 32, ppocr 64)")
    parser.add_argument("--eval-images", type=int, help="held-out samples per model (nudenet 32, ppocr 160)")
    parser.add_argument("--modelopt-python", default=os.environ.get("QDQ_MODELOPT_PYTHON", sys.executable),
                        help="the interpreter that has nvidia-modelopt (env QDQ_MODELOPT_PYTHON)")  # fmt: skip
    parser.add_argument("--worker-timeout", type=int, default=3600, help="seconds one quantizer may take")
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--int8-weights", choices=("as-written", "exact"), default="as-written",
                        help="exact: on a CPU whose int8 dot products saturate, every file's int8 weights run as "
                        "uint8 (exact, what a VNNI CPU computes)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help=f"sanity run: {QUICK_VARIANTS}, few images, 3 rounds of 5 runs")  # fmt: skip
    args = parser.parse_args(argv)
    RUN_OPTIONS["uint8_weights"] = None if args.int8_weights == "exact" else False
    if args.quick:
        args.rounds, args.iters, args.warmup = 3, 5, 2
        if args.variants == "*":
            args.variants = QUICK_VARIANTS
    return args


def _images(name: str, args: argparse.Namespace) -> tuple[int, int]:
    calib, evals = (QUICK_IMAGES if args.quick else DEFAULT_IMAGES)[name]
    return args.calib_images or calib, args.eval_images or evals


def run_model(name: str, variants: list[Variant], folder: Path, args: argparse.Namespace) -> tuple[ModelCase, list]:
    """Build, score and time every variant of one model; its table rows."""
    case = CASES[name](*_images(name, args))
    print(f"{name}: quantizing ({len(variants)} variants)", flush=True)
    rows = make_rows(case, variants, folder, args)
    print(f"{name}: scoring and timing", flush=True)
    score_rows(case, rows, args.threads)
    time_rows(case, rows, args)
    return case, [_cells(case, row) for row in rows]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants, notes = select_variants(args.variants)
    with tempfile.TemporaryDirectory(prefix="onnx-in-") as tmp:
        root = args.workdir or Path(tmp)
        cases, table = [], []
        for name in args.models.split(","):
            (root / name).mkdir(parents=True, exist_ok=True)
            case, rows = run_model(name, variants, root / name, args)
            cases.append(case)
            table += rows
            notes += [f"{name}: {note}" for note in case.notes]
    print("\n" + legend(args, cases) + "\n\n" + markdown_table(HEADERS, table))
    print("\n" + "\n".join(f"- {note}" for note in notes))


if __name__ == "__main__":
    main()

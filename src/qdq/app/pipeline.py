"""The end-to-end job behind ``qdq quantize`` and ``qdq demo``: float model → INT8 engines + report.

Steps: load model and data → FP32 accuracy → quantize (+ placement for the target) → PTQ with every
calibrator from one pass, keep the best → optional QAT → save the calibrated state_dict → export the
Q/DQ ONNX (and an FP32 ONNX as reference) → for each runtime: accuracy of the INT8 engine, fidelity to
PyTorch (:func:`qdq.verify`), latency FP32 vs INT8 → report.md/html, PNGs, summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.atomic import write_text_atomic
from qdq.calib.registry import CALIBRATION_METHODS
from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.targets import get_target
from qdq.workflow import distributed as dist
from qdq.workflow.auto_calibration import AUTO

__all__ = ["PipelineConfig", "measure_engines", "run_pipeline"]

_log = logging.getLogger(__name__)
_CALIB = ("all", *CALIBRATION_METHODS, AUTO)


@dataclass
class PipelineConfig:
    """Options of one quantization job; the same keys work in a ``--config qdq.yaml`` file.

    Attributes:
        model: ``torchvision:NAME``, ``path/to/file.py:factory``, ``digits_resnet`` or ``digits_mobilenet``.
        weights: a local state_dict file (None: the model as built).
        data: ``digits`` or ``imagefolder:DIR`` (DIR with ``train/`` and ``val/``, or class folders).
        out: output folder.
        calib: ``all`` (every method from one pass, and ``auto``; keep the best) or one method (``auto``: a
            range per quantizer by its layer's output error, :mod:`qdq.workflow.auto_calibration`).
        calib_batches: number of calibration batches of ``batch_size`` training images.
        qat_epochs: QAT epochs after PTQ (0: none); ``train_lr``: the LR the float model was trained with
            (QAT starts at 1 % of it, the seed's recipe).
        target: ``onnxruntime`` (int8 kernels on ORT's CPU) or ``tensorrt`` (TensorRT's explicit placement).
        float: the type the float part of a ``tensorrt`` model.onnx computes in: ``float32`` (default),
            ``float16``/``fp16`` or ``bfloat16``/``bf16`` (TensorRT 11 builds FP16 only where the ONNX says so).
            The model is quantized with it (``QuantConfig(target_options={"float": ...})``: low-precision
            steps) and exported with it, value ranges measured on the calibration batches.
        runtimes: runtimes to run the INT8 engine on (accuracy, fidelity, latency).
        weight_bits / activation_bits: integer widths (W4A8: ``weight_bits=4``).
        bench_batches: batch sizes timed; ``threads``: runtime threads.
        eval_batches: limit evaluation to this many batches (None: the whole test split).
    """

    model: str = "digits_resnet"
    weights: str | None = None
    data: str = "digits"
    out: str = "qdq-out"
    calib: str = "all"
    calib_batches: int = 8
    batch_size: int = 64
    qat_epochs: int = 0
    train_lr: float = 0.1
    target: str = "onnxruntime"
    float: str = "float32"
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime"])
    weight_bits: int = 8
    activation_bits: int = 8
    bench_batches: list[int] = field(default_factory=lambda: [1, 8])
    threads: int = 2
    bench_iters: int = 30
    image_size: int | None = None
    eval_batches: int | None = None
    sensitivity: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        get_target(self.target)  # an unknown target raises, listing the registered ones
        from qdq.graphs.onnx_types import parse_float_type

        self.float = parse_float_type(self.float)
        if self.float != "float32" and self.target != "tensorrt":
            raise QdqConfigError(f"float {self.float!r} is for target 'tensorrt' (TensorRT 11), not {self.target!r}.")
        if self.calib not in _CALIB:
            hint = did_you_mean(self.calib, _CALIB)
            raise QdqConfigError(f"calib must be one of {list(_CALIB)}, got {self.calib!r}.{hint}")
        if isinstance(self.runtimes, str):
            self.runtimes = [self.runtimes]
        for name in ("calib_batches", "batch_size", "threads", "bench_iters"):
            if int(getattr(self, name)) < 1:
                raise QdqConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.qat_epochs < 0:
            raise QdqConfigError(f"qat_epochs must be >= 0, got {self.qat_epochs}.")

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
    """State carried between the steps of one pipeline run."""

    cfg: PipelineConfig
    out: Path
    model: nn.Module
    train_loader: Any
    test_loader: Any
    example: torch.Tensor
    progress: bool
    summary: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    def evaluate(self, model: Callable[..., Any]) -> float:
        from qdq.app.train import evaluate

        return evaluate(model, self.test_loader, max_batches=self.cfg.eval_batches)


def _load(cfg: PipelineConfig, model: nn.Module | None, progress: bool) -> _Job:
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
    methods = (*CALIBRATION_METHODS, AUTO) if cfg.calib == "all" else (cfg.calib,)
    result = ptq(job.model, calib, job.evaluate, methods, progress=job.progress)
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
    if cfg.qat_epochs == 0:
        return
    model, loader = job.model, job.train_loader
    if dist.is_distributed():  # DDP fine-tuning; every rank gets its shard of the training set
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(job.model)
        loader = dist.shard(job.train_loader.dataset, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed)
    result = qat(model, loader, job.evaluate, cfg.qat_epochs, cfg.train_lr,
                 checkpoint_dir=job.out / "checkpoints", progress=job.progress and dist.is_main_process())  # fmt: skip
    job.extras["qat"] = result
    job.summary["qat"] = {"epochs": result.epochs}
    job.summary["accuracy"]["QAT"] = result.final_score


def _export(job: _Job) -> None:
    import itertools

    from qdq.export import export_onnx
    from qdq.targets.tensorrt.float_types import read_float_record
    from qdq.workflow.fine_tuning import save_atomic

    save_atomic(job.model.state_dict(), job.out / "quantized_state_dict.pt")
    options = {}
    if job.cfg.float != "float32":  # value ranges of the FP16/BF16 file measured on the calibration batches
        options["calibration_data"] = [x for x, _ in itertools.islice(iter(job.train_loader), job.cfg.calib_batches)]
    path = export_onnx(job.model, job.example, job.out / "model.onnx", target=job.cfg.target, target_options=options)
    record = read_float_record(path)
    if record is not None:
        job.summary["float"] = record
    job.summary["files"] = {"onnx": path.name, "fp32_onnx": "model_fp32.onnx", "state_dict": "quantized_state_dict.pt"}


def _export_fp32(job: _Job, float_model: nn.Module) -> None:
    from qdq.export import export_onnx

    # The float reference has no quantizers: the "tensorrt" target exports it as the plain graph.
    export_onnx(float_model, job.example, job.out / "model_fp32.onnx", target="tensorrt")


def _engines(job: _Job) -> None:
    def evaluate(predict: Callable[[np.ndarray], np.ndarray]) -> float:
        return job.evaluate(lambda x: torch.from_numpy(predict(x.numpy())))

    batches = _limited(job.test_loader, job.cfg.eval_batches)
    job.summary["engines"], job.summary["latency"] = measure_engines(
        job.cfg, job.model, job.out / "model.onnx", job.out / "model_fp32.onnx", batches, evaluate
    )
    for runtime, engine in job.summary["engines"].items():
        job.summary["accuracy"][f"INT8 engine ({runtime})"] = engine["accuracy"]


def measure_engines(
    cfg: PipelineConfig,
    model: Any,
    int8: Path,
    fp32: Path,
    batches: list[Any],
    evaluate: Callable[[Callable[[np.ndarray], np.ndarray]], float],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The INT8 engine on each of ``cfg.runtimes``: its accuracy (``evaluate(predict)``, ``predict`` mapping an
    input batch to logits), its fidelity to ``model`` (:func:`qdq.verify` on ``batches``, a PyTorch or Keras
    model) and the latency of ``fp32`` and ``int8`` at each of ``cfg.bench_batches``.

    Returns:
        ``({runtime: {"accuracy", **verify's record}}, [latency rows])``.
    """
    from qdq.runtime import benchmark_model, load_runtime
    from qdq.workflow.verification import verify

    engines, latency = {}, []
    for runtime in cfg.runtimes:
        with load_runtime(int8, runtime, threads=cfg.threads) as engine:
            accuracy = evaluate(lambda x, e=engine: e.run(x)[0])
        fidelity = verify(model, int8, batches, runtime, threads=cfg.threads)
        engines[runtime] = {"accuracy": accuracy, **fidelity.to_dict()}
        for batch in cfg.bench_batches:
            for label, path in (("FP32", fp32), ("INT8", int8)):
                options = {"precision": "f32"} if runtime == "openvino" else {}
                result = benchmark_model(path, runtime, label=label, batch=batch, threads=cfg.threads,
                                         iters=cfg.bench_iters, warmup=5, **options)  # fmt: skip
                latency.append({"runtime": runtime, "variant": label, "batch": batch, "threads": cfg.threads,
                                "min_ms": result.min_ms, "median_ms": result.median_ms})  # fmt: skip
    return engines, latency


def _limited(loader: Any, count: int | None) -> list[Any]:
    import itertools

    return list(itertools.islice(iter(loader), count)) if count else list(loader)


def run_pipeline(
    cfg: PipelineConfig, model: nn.Module | None = None, *, progress: bool = True, report: bool = True
) -> dict[str, Any]:
    """Run the whole job; return the summary (also written to ``<out>/summary.json``).

    ``model`` overrides ``cfg.model`` (e.g. a model trained a moment ago by the demo).
    """
    import copy

    job = _load(cfg, model, progress)
    job.summary.update(config=cfg.to_dict(), accuracy={"FP32": job.evaluate(job.model)})
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


def _engine_note(runtime: str, engine: dict[str, Any]) -> str:
    return (
        f"{runtime}: INT8 engine top-1 {engine['accuracy']:.2f} %, agrees with PyTorch fake-quant on "
        f"{engine['top1_agreement']:.2f} % of {engine['samples']} samples, max error {engine['max_error_steps']:.2f} "
        "output steps"
    )


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
        title=f"qdq: {cfg.model} on {cfg.data}, W{cfg.weight_bits}A{cfg.activation_bits}, target {cfg.target}",
        model=cfg.model,
        dataset=cfg.data,
        accuracy={k: v for k, v in job.summary["accuracy"].items() if v is not None},
        ptq=job.extras.get("ptq"),
        calibration=calibration,
        qat=job.extras.get("qat"),
        sensitivity=job.extras.get("sensitivity"),
        latency=job.summary.get("latency", []),
        histograms=collect_histograms(job.model, job.extras.get("ptq"), include=worst),
        notes=[str(_engine_note(r, e)) for r, e in job.summary.get("engines", {}).items()],
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
    job = _load(cfg, None, progress=False)
    _quantize(job)
    state = torch.load(out / "quantized_state_dict.pt", map_location="cpu", weights_only=True)
    job.model.load_state_dict(state)  # quantizer ranges adopt the stored shapes (TensorQuantizer)
    return job.model.eval(), job.test_loader, out / "model.onnx"

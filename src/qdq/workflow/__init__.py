"""The end-to-end workflow: data, models, training, PTQ, QAT, reports.

Importing ``qdq.workflow`` does no work: names below resolve lazily on first access, so the CLI can
import it without paying for torch, torchvision or scikit-learn until a command needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # data
    "DIGITS_MEAN": "qdq.workflow.data",
    "DIGITS_STD": "qdq.workflow.data",
    "IMAGENET_MEAN": "qdq.workflow.data",
    "IMAGENET_STD": "qdq.workflow.data",
    "LabeledSubset": "qdq.workflow.data",
    "SeededSampler": "qdq.workflow.data",
    "digits_datasets": "qdq.workflow.data",
    "imagefolder_datasets": "qdq.workflow.data",
    "imagenet_transform": "qdq.workflow.data",
    "make_loaders": "qdq.workflow.data",
    "parse_data_spec": "qdq.workflow.data",
    "stratified_split": "qdq.workflow.data",
    # models
    "check_input_compatible": "qdq.workflow.models",
    "digits_mobilenet": "qdq.workflow.models",
    "digits_resnet": "qdq.workflow.models",
    "load_model": "qdq.workflow.models",
    "load_weights": "qdq.workflow.models",
    "model_names": "qdq.workflow.models",
    # training
    "evaluate": "qdq.workflow.train",
    "make_optimizer": "qdq.workflow.train",
    "make_scheduler": "qdq.workflow.train",
    "train_classifier": "qdq.workflow.train",
    "train_one_epoch": "qdq.workflow.train",
    # calibration, PTQ, QAT, sensitivity, verification, the end-to-end job
    "calibrate": "qdq.workflow.calibrate",
    "collect_stats": "qdq.workflow.calibrate",
    "compute_amax": "qdq.workflow.calibrate",
    "ptq": "qdq.workflow.ptq",
    "PTQResult": "qdq.workflow.ptq",
    "qat": "qdq.workflow.qat",
    "QATResult": "qdq.workflow.qat",
    "sensitivity": "qdq.workflow.sensitivity",
    "keep_float": "qdq.workflow.sensitivity",
    "verify": "qdq.workflow.verify",
    "VerifyResult": "qdq.workflow.verify",
    "PipelineConfig": "qdq.workflow.pipeline",
    "run_pipeline": "qdq.workflow.pipeline",
    "run_demo": "qdq.workflow.demo",
    "ReportData": "qdq.workflow.report",
    "write_report": "qdq.workflow.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qdq.workflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__

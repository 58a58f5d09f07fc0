"""The end-to-end application behind ``qdq demo`` and ``qdq quantize``, built on the library API.

Data sets (:mod:`~qdq.app.data`), models (:mod:`~qdq.app.models`), float training
(:mod:`~qdq.app.train`), the quantization job (:mod:`~qdq.app.pipeline`), the offline demo
(:mod:`~qdq.app.demo`) and the run report (:mod:`qdq.app.report`). The library it uses (calibration,
PTQ, QAT, verification) is :mod:`qdq.workflow`; nothing below ``qdq.app`` imports it.

Importing ``qdq.app`` does no work: names below resolve lazily on first access, so the CLI can import
it without paying for torch, torchvision or scikit-learn until a command needs them.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

_LAZY = {
    # data
    "DIGITS_MEAN": "qdq.app.data",
    "DIGITS_STD": "qdq.app.data",
    "IMAGENET_MEAN": "qdq.app.data",
    "IMAGENET_STD": "qdq.app.data",
    "LabeledSubset": "qdq.app.data",
    "SeededSampler": "qdq.app.data",
    "digits_datasets": "qdq.app.data",
    "imagefolder_datasets": "qdq.app.data",
    "imagenet_transform": "qdq.app.data",
    "make_loaders": "qdq.app.data",
    "parse_data_spec": "qdq.app.data",
    "stratified_split": "qdq.app.data",
    # models
    "check_input_compatible": "qdq.app.models",
    "digits_mobilenet": "qdq.app.models",
    "digits_resnet": "qdq.app.models",
    "load_model": "qdq.app.models",
    "load_weights": "qdq.app.models",
    "model_names": "qdq.app.models",
    # float training
    "evaluate": "qdq.app.train",
    "make_optimizer": "qdq.app.train",
    "make_scheduler": "qdq.app.train",
    "train_classifier": "qdq.app.train",
    "train_one_epoch": "qdq.app.train",
    # the job, the demo, the report
    "PipelineConfig": "qdq.app.pipeline",
    "run_pipeline": "qdq.app.pipeline",
    "run_demo": "qdq.app.demo",
    "ReportData": "qdq.app.report",
    "write_report": "qdq.app.report",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

"""The library's model-level API: calibration, PTQ, QAT, sensitivity, verification, torch.distributed.

Importing ``qdq.workflow`` does no work: the names below resolve lazily on first access. Each public
name has one meaning: no submodule is named like a function (``qdq.workflow.calibrate`` is always the
function, defined in :mod:`qdq.workflow.calibration`), so importing a submodule never changes what a
name here refers to.

==========================  ================================================================
module                      public names
==========================  ================================================================
``calibration``             ``calibrate``, ``load_amax`` (any registered method, :mod:`qdq.calib.methods`);
                            ``collect_stats``, ``named_quantizers`` (from ``collection``: running the data)
``diagnostics``             ``calibration_report``, ``CalibrationReport`` (what each range clips; the warning)
``auto_calibration``        ``select_amax``, ``AutoResult`` (``method="auto"``, the default: the method whose
                            quantized outputs stay closest to the float model's on held-out batches)
``post_training``           ``ptq``, ``PTQResult``, ``MethodResult``
``fine_tuning``             ``qat``, ``QATResult``
``sensitivity_analysis``    ``sensitivity``, ``keep_float``, ``SensitivityResult``
``verification``            ``verify``, ``VerifyResult`` (an engine against its reference)
``divergence``              ``locate_divergence``, ``Divergence`` (where an engine departs, quantizer by quantizer)
``smoothing``               ``smooth_inputs``, ``SmoothingResult`` (SmoothQuant-style input smoothing)
``distributed``             torch.distributed helpers (import the module: ``from qdq.workflow import distributed``)
==========================  ================================================================

The demo application built on top of these (data sets, models, training, the ``qdq quantize`` job,
reports) lives in :mod:`qdq.app`.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

_LAZY = {
    "calibrate": "qdq.workflow.calibration",
    "collect_stats": "qdq.workflow.calibration",
    "load_amax": "qdq.workflow.calibration",
    "named_quantizers": "qdq.workflow.calibration",
    "calibration_report": "qdq.workflow.diagnostics",
    "CalibrationReport": "qdq.workflow.diagnostics",
    "select_amax": "qdq.workflow.auto_calibration",
    "AutoResult": "qdq.workflow.auto_calibration",
    "ptq": "qdq.workflow.post_training",
    "PTQResult": "qdq.workflow.post_training",
    "MethodResult": "qdq.workflow.post_training",
    "qat": "qdq.workflow.fine_tuning",
    "QATResult": "qdq.workflow.fine_tuning",
    "sensitivity": "qdq.workflow.sensitivity_analysis",
    "keep_float": "qdq.workflow.sensitivity_analysis",
    "SensitivityResult": "qdq.workflow.sensitivity_analysis",
    "verify": "qdq.workflow.verification",
    "smooth_inputs": "qdq.workflow.smoothing",
    "SmoothingResult": "qdq.workflow.smoothing",
    "VerifyResult": "qdq.workflow.verification",
    "locate_divergence": "qdq.workflow.divergence",
    "Divergence": "qdq.workflow.divergence",
}
_SUBMODULES = ("auto_calibration", "calibration", "collection", "diagnostics", "distributed",
               "divergence", "fine_tuning", "post_training", "sensitivity_analysis", "smoothing",
               "verification")  # fmt: skip

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(
    __name__,
    _LAZY,
    submodules=_SUBMODULES,
    renamed={"compute_amax": "load_amax (it loads ranges into a model; a calibrator's compute_amax() returns one)"},
)

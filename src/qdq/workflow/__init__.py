"""The library's model-level API: calibration, PTQ, QAT, sensitivity, verification, torch.distributed.

Importing ``qdq.workflow`` does no work: the names below resolve lazily on first access. Each public
name has one meaning: no submodule is named like a function (``qdq.workflow.calibrate`` is always the
function, defined in :mod:`qdq.workflow.calibration`), so importing a submodule never changes what a
name here refers to.

==========================  ================================================================
module                      public names
==========================  ================================================================
``calibration``             ``calibrate``, ``collect_stats``, ``load_amax``, ``named_quantizers``
``post_training``           ``ptq``, ``PTQResult``, ``MethodResult``
``fine_tuning``             ``qat``, ``QATResult``
``sensitivity_analysis``    ``sensitivity``, ``keep_float``, ``SensitivityResult``
``verification``            ``verify``, ``VerifyResult``
``distributed``             torch.distributed helpers (import the module: ``from qdq.workflow import distributed``)
==========================  ================================================================

The demo application built on top of these (data sets, models, training, the ``qdq quantize`` job,
reports) lives in :mod:`qdq.app`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "calibrate": "qdq.workflow.calibration",
    "collect_stats": "qdq.workflow.calibration",
    "load_amax": "qdq.workflow.calibration",
    "named_quantizers": "qdq.workflow.calibration",
    "ptq": "qdq.workflow.post_training",
    "PTQResult": "qdq.workflow.post_training",
    "MethodResult": "qdq.workflow.post_training",
    "qat": "qdq.workflow.fine_tuning",
    "QATResult": "qdq.workflow.fine_tuning",
    "sensitivity": "qdq.workflow.sensitivity_analysis",
    "keep_float": "qdq.workflow.sensitivity_analysis",
    "SensitivityResult": "qdq.workflow.sensitivity_analysis",
    "verify": "qdq.workflow.verification",
    "VerifyResult": "qdq.workflow.verification",
}
_SUBMODULES = ("calibration", "distributed", "fine_tuning", "post_training", "sensitivity_analysis", "verification")

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"qdq.workflow.{name}")
    if name == "compute_amax":
        raise AttributeError(
            "qdq.workflow.compute_amax was renamed qdq.workflow.load_amax (it loads ranges into a model; "
            "a calibrator's compute_amax() returns one)."
        )
    raise AttributeError(f"module 'qdq.workflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])

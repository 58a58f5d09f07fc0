"""Targets: one package per runtime a model is quantized for, and the registry of them by name.

A :class:`Target` holds everything qdq knows about one runtime's int8 execution: its placement rules
(:class:`PlacementRule`, each written once against the front-end-neutral graph view), its ONNX rewrite, its
fusion facts, its export defaults (opset, rewrite options such as the weight encoding) and how each runtime
runs its graphs (:class:`RuntimeSupport`, naming runtimes registered in :mod:`qdq.runtime_registry`), and the
facts the runtime it is made for needs to read its files (its rule check, its weight encoding). Registered here:

* ``"tensorrt"`` (:mod:`qdq.targets.tensorrt`): TensorRT's explicit quantization; the same graph runs in u8 on
  OpenVINO;
* ``"onnxruntime"`` (:mod:`qdq.targets.onnxruntime`): ONNX Runtime's CPU int8 kernels.

How a target flows: ``QuantConfig(target="onnxruntime")`` names it; :func:`qdq.quantize_model` resolves the
name once (:func:`get_target`) and passes the object to :func:`qdq.placement.apply_placement`, which runs its
rules on the model's graph view and marks the model with the name (:func:`placed_target`);
:func:`qdq.export.export_onnx` runs its ONNX rewrite with its export defaults and writes ``qdq.target`` into the
file; a runtime
(:mod:`qdq.runtime`) reads that entry back and asks the target whether it runs the graph (:meth:`Target.support`).

Adding a target is one call from anywhere, ``register_target(Target(...))``: nothing in qdq needs editing.
Here: what defines, registers and resolves a target; one level down, what placement and the runtimes read:
:mod:`qdq.targets.marks` (the placed / stale marks on models), :mod:`qdq.targets.registry` (the registry itself,
``native_fact``, placement rules added to registered targets), :mod:`qdq.targets.rules` (``PLACEMENT_RULES``).
Importing this package imports neither torch nor onnx: a rule or a pass imports them when it runs.
"""

from __future__ import annotations

from qdq.lazy import lazy_names
from qdq.targets.choice import export_target
from qdq.targets.onnxruntime import ONNXRUNTIME
from qdq.targets.registry import (
    DEFAULT_TARGET,
    get_target,
    register_target,
    resolve_target,
    target_names,
    unregister_target,
)
from qdq.targets.rules import PlacementRule, register_rule
from qdq.targets.target import (
    AttentionFacts,
    ExportDefaults,
    FusionFacts,
    RuntimeSupport,
    Target,
    WeightEncoding,
)
from qdq.targets.tensorrt import TENSORRT
from qdq.targets.tensorrt.cases import MAXPOOL_INPUTS, NORM_INPUTS, PRODUCT_INPUTS

__all__ = [
    "DEFAULT_TARGET",
    "AttentionFacts",
    "ExportDefaults",
    "FusionFacts",
    "PlacementRule",
    "RuntimeSupport",
    "Target",
    "WeightEncoding",
    "export_target",
    "get_target",
    "register_target",
    "resolve_target",
    "target_names",
    "unregister_target",
]

#: names that were exported here and live one level down: reading ``qdq.targets.<name>`` says where
_MOVED = {
    **dict.fromkeys(("check_not_superseded", "mark_placed", "mark_superseded", "placed_options", "placed_target",
                     "superseded_by"), "qdq.targets.marks"),
    **dict.fromkeys(("TARGET_REGISTRY", "add_placement_rule", "remove_placement_rule", "native_fact",
                     "native_targets"), "qdq.targets.registry"),
    "VERDICTS": "qdq.targets.target",
    "PLACEMENT_RULES": "qdq.targets.rules",
    "ONNXRUNTIME_FUSION": "qdq.targets.onnxruntime",
}  # fmt: skip

__getattr__, _lazy_dir = lazy_names(__name__, {}, moved=_MOVED)


def __dir__() -> list[str]:
    return sorted({*globals(), *_lazy_dir()})


for _rule in (NORM_INPUTS, MAXPOOL_INPUTS, PRODUCT_INPUTS):
    register_rule(_rule)
for _target in (TENSORRT, ONNXRUNTIME):
    for _rule in _target.placement_rules:
        register_rule(_rule)
    register_target(_target)

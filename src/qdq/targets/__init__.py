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
Importing this package imports neither torch nor onnx: a rule or a pass imports them when it runs.
"""

from __future__ import annotations

from qdq.targets.choice import export_target
from qdq.targets.marks import (
    check_not_superseded,
    mark_placed,
    mark_superseded,
    placed_options,
    placed_target,
    superseded_by,
)
from qdq.targets.onnxruntime import ONNXRUNTIME, ONNXRUNTIME_FUSION
from qdq.targets.registry import (
    DEFAULT_TARGET,
    TARGET_REGISTRY,
    add_placement_rule,
    get_target,
    native_fact,
    native_targets,
    register_target,
    remove_placement_rule,
    resolve_target,
    target_names,
    unregister_target,
)
from qdq.targets.rules import PLACEMENT_RULES, PlacementRule, register_rule
from qdq.targets.target import (
    ATTENTION_QUANTIZER_NAMES,
    VERDICTS,
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
    "ATTENTION_QUANTIZER_NAMES",
    "DEFAULT_TARGET",
    "ONNXRUNTIME_FUSION",
    "PLACEMENT_RULES",
    "TARGET_REGISTRY",
    "VERDICTS",
    "AttentionFacts",
    "ExportDefaults",
    "FusionFacts",
    "PlacementRule",
    "RuntimeSupport",
    "Target",
    "WeightEncoding",
    "add_placement_rule",
    "check_not_superseded",
    "export_target",
    "get_target",
    "mark_placed",
    "mark_superseded",
    "native_fact",
    "native_targets",
    "placed_options",
    "placed_target",
    "register_target",
    "remove_placement_rule",
    "resolve_target",
    "superseded_by",
    "target_names",
    "unregister_target",
]

for _rule in (NORM_INPUTS, MAXPOOL_INPUTS, PRODUCT_INPUTS):
    register_rule(_rule)
for _target in (TENSORRT, ONNXRUNTIME):
    for _rule in _target.placement_rules:
        register_rule(_rule)
    register_target(_target)

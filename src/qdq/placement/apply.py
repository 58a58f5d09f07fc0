"""``apply_placement``: trace a quantized PyTorch model and run a target's placement rules on it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from qdq.descriptor import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.graphs.fx_edit import apply_notes, materialize
from qdq.graphs.fx_ops import QDQ_LEAVES
from qdq.graphs.fx_view import build_view, trace, untraced_view
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantInputMixin, QuantModule
from qdq.placement.attention_biases import fold_attention_biases
from qdq.placement.capture import capture_graph, capture_model
from qdq.quantizer import TensorQuantizer
from qdq.targets import DEFAULT_TARGET, PlacementRule, Target, resolve_target
from qdq.targets.marks import check_not_superseded, mark_placed, mark_superseded, placed_target
from qdq.targets.rules import PLACEMENT_RULES, apply_rules

__all__ = ["apply_placement"]


def _default_desc(model: nn.Module) -> QuantDescriptor:
    """Per-tensor descriptor matching the model's first input quantizer (bits, calibrator)."""
    for module in model.modules():
        if not isinstance(module, QuantInputMixin):
            continue
        q = next((q for q in module.quantizers().values() if q.role == "input"), None)
        if q is not None:
            return QuantDescriptor(num_bits=q.num_bits, calib_method=q.calib_method, narrow_range=q.narrow_range)
    return QUANT_DESC_8BIT_PER_TENSOR


class _Placement:
    """One placement: the target, the descriptor of the added quantizers, the rules, the extra leaves, the
    capture steps run on each traced graph; records the modules torch.fx could not trace."""

    def __init__(
        self,
        target: Target,
        desc: QuantDescriptor,
        rules: tuple[PlacementRule, ...],
        leaves: tuple[type, ...],
        capture: Sequence[str] | None,
    ) -> None:
        self.target, self.desc, self.rules, self.leaves, self.capture = target, desc, rules, leaves, capture
        self.untraced: list[tuple[str, Exception]] = []
        #: captured modules no traced graph calls (children of untraceable modules), by path
        self.untraced_captured: dict[str, nn.Module] = {}
        #: modules the model capture steps made quantized (attention modules dispatching through a library's
        #: table, which torch.fx cannot trace): calls in the graph, so that the code around them traces.
        self.captured: frozenset[int] = frozenset()
        #: quantized modules no traced graph calls (their parameters read by a function call), left float
        self.uncalled: list[str] = []

    def place(self, module: nn.Module, path: str) -> tuple[nn.Module, list[str]]:
        try:
            gm = trace(module, self.leaves, self.captured)
        except Exception as err:  # torch.fx raises many kinds (TraceError, TypeError, NotImplementedError...)
            return self.place_children(module, path, err)
        self.uncalled += _leave_uncalled_float(module, gm, path)
        changes = [f"{name}: quantized attention" for name in capture_graph(gm, self.desc, self.capture)]
        view = build_view(gm, self.target)
        view.whole_model = not path  # a child traced alone: its outputs feed its parent's untraced code
        apply_rules(view, self.rules)
        changes += materialize(view, gm, self.desc)
        if not changes:
            return module, []
        gm.graph.lint()
        gm.recompile()
        prefix = f"{path}: " if path else ""
        return gm, [prefix + line for line in changes]

    def place_untraced(self) -> None:
        """Run the rules on the view of the captured modules no graph calls (their attention facts)."""
        if self.untraced_captured:
            view = untraced_view(self.untraced_captured, self.target)
            apply_rules(view, self.rules)
            apply_notes(view)

    def place_children(self, module: nn.Module, path: str, err: Exception) -> tuple[nn.Module, list[str]]:
        self.untraced.append((path or type(module).__name__, err))
        changes: list[str] = []
        for name, child in list(module.named_children()):
            child_path = f"{path}.{name}" if path else name
            if id(child) in self.captured:
                self.untraced_captured[child_path] = child
            if isinstance(child, QDQ_LEAVES + self.leaves) or id(child) in self.captured:
                continue
            new, lines = self.place(child, child_path)
            if new is not child:
                setattr(module, name, new)
            changes += lines
        return module, changes

    def warning(self, model: nn.Module, attention: int) -> str | None:
        """One message for the whole model: which modules torch.fx could not trace, and what stays float."""
        if not self.untraced:
            return None
        first, err = self.untraced[0]
        names = [path for path, _ in self.untraced]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        captured = f" Attention is quantized all the same ({attention} modules)." if attention else ""
        return (
            f"torch.fx cannot trace {len(names)} module(s) of {type(model).__name__} ({first}: "
            f"{type(err).__name__}: {err}); quantizers were placed inside their traceable children. What stays "
            f"float: adds and concatenations written in the forward of {shown} (a residual add there is not "
            "quantized). Use qdq.nn.QuantAdd / QuantConcat in those forwards, or make them leaves "
            f"(leaf_modules=...).{captured}"
        )


def _leave_uncalled_float(module: nn.Module, gm: Any, path: str) -> list[str]:
    """Disable the quantizers of the quantized modules of ``module`` that its traced graph ``gm`` never calls, itself
    or through a module that holds it: their parameters are read by a function call (torchvision's Swin V2 passes
    ``qkv.weight`` to ``shifted_window_attention_v2``), so their quantizers would never see data. Their paths."""
    called = {str(node.target) for node in gm.graph.nodes if node.op == "call_module"}
    found = []
    for name, child in module.named_modules():
        parts = name.split(".")
        reached = any(".".join(parts[:i]) in called for i in range(1, len(parts) + 1))  # itself or a holder
        if not isinstance(child, QuantModule) or not name or reached:
            continue
        quantizers = [q for q in child.quantizers().values() if q.is_enabled]
        for quantizer in quantizers:
            quantizer.disable()
        if quantizers:
            found.append(f"{path}.{name}" if path else name)
    return found


def apply_placement(
    model: nn.Module,
    target: str | Target = DEFAULT_TARGET,
    *,
    quant_desc: QuantDescriptor | None = None,
    rules: Sequence[str] | None = None,
    leaf_modules: Sequence[type] = (),
    verbose: bool = False,
    target_options: Mapping[str, Any] | None = None,
    capture: Sequence[str] | None = None,
) -> nn.Module:
    """Add the quantizers ``target`` needs beyond Conv/Linear inputs and weights (see :mod:`qdq.placement`).

    Usually called by :func:`qdq.quantize_model` (``QuantConfig(target=...)``); call it yourself after
    ``quantize_model`` and before calibration (the added quantizers are ordinary
    :class:`~qdq.quantizer.TensorQuantizer` modules, calibrated like the others). Use the returned model:
    when it is a new one, ``model`` is marked stale and raises when run or exported.

    Args:
        model: a model quantized with ``quantize_model`` (float modules are fine too).
        target: a registered target's name (``"tensorrt"``, ``"onnxruntime"``) or a :class:`~qdq.targets.Target`;
            the model computes what that target's export runs.
        quant_desc: descriptor of the added quantizers; default 8-bit per tensor with the calibrator of the
            model's first input quantizer.
        rules: names of the rules to apply (default: the target's PyTorch rules, in its order).
        leaf_modules: module classes not to trace into (kept as calls).
        verbose: print one line per change.
        target_options: the target's export options the model is made for (``"tensorrt"``:
            ``{"float": "float16"}``), remembered by the returned model (``export_onnx`` uses them unless its
            call overrides them). Where they make the file's steps low-precision numbers
            (:meth:`~qdq.targets.Target.step_float_type`), every quantizer of the model gets that
            :attr:`~qdq.quantizer.TensorQuantizer.step_type`, so that the model quantizes as the file does.
            Plain values only (strings, numbers): data such as calibration batches go to ``export_onnx``.
        capture: names of the attention capture steps to run (:data:`qdq.placement.capture.CAPTURE_STEPS`;
            default all, ``()`` none). Every captured attention, and every ``QuantMultiheadAttention``, then
            gets the target's :class:`~qdq.targets.AttentionFacts`.

    Returns:
        A ``torch.fx.GraphModule`` computing the placed model (same parameters, same ``state_dict`` keys
        plus the added quantizers), or ``model`` itself when no rule changed anything. When the model
        cannot be traced, ``model`` with its traceable children replaced. Either way it remembers
        the target's name (:func:`qdq.targets.marks.placed_target`).

    Raises:
        QdqConfigError: an unknown target or rule, a model already
            placed for another target, a stale model (one a previous placement replaced), or an option the
            target does not take.
    """
    chosen = resolve_target(target)
    options = _checked_options(chosen, target_options)
    if not isinstance(model, nn.Module):
        raise QdqTypeError(f"apply_placement needs an nn.Module, got {type(model).__name__}.")
    check_not_superseded(model)
    previous = placed_target(model)
    if previous is not None and previous != chosen.name:
        raise QdqConfigError(
            f"this model is already placed for target {previous!r}; placing it for {chosen.name!r} too would mix "
            "both. Quantize a fresh copy of the float model for the other target."
        )
    rule_list = chosen.placement_rules if rules is None else tuple(PLACEMENT_RULES.get(name) for name in rules)
    desc = _default_desc(model) if quant_desc is None else quant_desc
    folded = fold_attention_biases(model) if chosen.attention.fold_biases and previous is None else []
    captured = capture_model(model, desc, capture)
    placement = _Placement(chosen, desc, rule_list, tuple(leaf_modules), capture)
    placement.captured = frozenset(id(model.get_submodule(name)) for name in captured)
    placed, changes = placement.place(model, "")
    placement.place_untraced()
    changes = folded + [f"{name}: quantized attention" for name in captured] + changes
    attention = sum(isinstance(m, QuantScaledDotProductAttention) for m in placed.modules())
    message = placement.warning(model, attention)
    if message is not None:
        warnings.warn(message, stacklevel=2)
    if placement.uncalled:
        first = placement.uncalled[0]
        warnings.warn(
            f"{len(placement.uncalled)} quantized module(s) of {type(model).__name__} are never called by its "
            f"forward (e.g. {first}: its parameters are read by a function call): they stay float, their "
            "quantizers disabled.",
            stacklevel=2,
        )
    mark_placed(placed, chosen.name, options)
    _set_step_types(placed, chosen.step_float_type(options))
    if placed is not model:
        mark_superseded(model, chosen.name)
    if verbose:
        print("\n".join(changes) if changes else "apply_placement: no change")
    return placed


def _checked_options(target: Target, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` checked against the target's rewrite: known names, plain values."""
    options = dict(options or {})
    target.check_options(options)
    data = [name for name, value in options.items() if not isinstance(value, str | int | float | bool | type(None))]
    if data:
        raise QdqConfigError(
            f"target options {data} hold {type(options[data[0]]).__name__} values; the options a model is "
            "quantized with are plain values (strings, numbers). Pass data such as calibration batches to "
            f"export_onnx(..., target_options={{{data[0]!r}: ...}})."
        )
    return options


def _set_step_types(model: nn.Module, step_type: str) -> None:
    """Every quantizer of ``model`` quantizes with steps of ``step_type`` (the file's scale type)."""
    for module in model.modules():
        if isinstance(module, TensorQuantizer):
            module.step_type = step_type

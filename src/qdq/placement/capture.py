"""Attention capture: how placement finds a model's attention and routes it through quantized attention.

Attention is written in many ways (a function call, a module, a library's dispatch table), and a target's
rules need it as one thing: a :class:`~qdq.nn.attention.QuantScaledDotProductAttention` module, whose four
quantizers sit on the inputs of its two matmuls. A **capture step** turns one way of writing attention into
such modules. The steps are a registry, :data:`CAPTURE_STEPS`; :func:`qdq.placement.apply_placement` runs
every registered step (or the ones its ``capture=`` names), each in one of two places:

* ``model`` steps, ``step(model, quant_desc) -> names``, on the whole model before it is traced (they work
  where torch.fx cannot trace: Hugging Face models);
* ``graph`` steps, ``step(graph_module, quant_desc) -> names``, on each graph placement traces, before the
  target's rules (so the rules see the captured modules as calls).

Built in, in this order:

* ``huggingface_attention``: transformers models whose attention modules look their attention function up in
  transformers' registry (BERT, DistilBERT, RoBERTa, ViT and most current models): each gets a
  ``quant_attention`` child and the model runs qdq's registered implementation
  (:func:`qdq.nn.huggingface.capture_hf_attention`);
* ``fused_attention_flag``: modules with a boolean ``fused_attn`` (timm's ViT / DeiT / Swin attention) compute
  their attention in one ``F.scaled_dot_product_attention`` call (:func:`qdq.nn.attention.use_fused_attention`),
  which the next step reaches;
* ``sdpa_calls``: every ``F.scaled_dot_product_attention`` call of a traced graph becomes a call of a new
  module, arguments and keyword arguments kept (:func:`qdq.nn.attention.replace_sdpa_calls`).

``nn.MultiheadAttention`` needs no step: module replacement swaps it for
:class:`~qdq.nn.QuantMultiheadAttention`, which computes its attention with the same module.

After capture, placement gives every attention module of the model the target's
:class:`~qdq.targets.AttentionFacts` (:func:`apply_attention_facts`: which quantizers stay on); the attention
module itself settles the shape conditions after calibration (its calibration hooks;
:func:`~qdq.nn.attention.settle_attention`, re-exported here).

Adding a way of writing attention is one :func:`register_capture_step` call; nothing else changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx, nn

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqTypeError
from qdq.graphs.fx_edit import apply_attention_facts as apply_module_facts
from qdq.nn.attention import (
    QuantScaledDotProductAttention,
    forget_attention_shapes,
    replace_sdpa_calls,
    settle_attention,
    use_fused_attention,
)
from qdq.nn.huggingface import capture_hf_attention, dispatches_through_registry
from qdq.registry import Registry
from qdq.targets import AttentionFacts

__all__ = [
    "CAPTURE_STEPS",
    "CaptureStep",
    "apply_attention_facts",
    "capture_graph",
    "capture_model",
    "forget_attention_shapes",
    "register_capture_step",
    "settle_attention",
]

ModelStep = Callable[[nn.Module, QuantDescriptor | None], list[str]]
GraphStep = Callable[[fx.GraphModule, QuantDescriptor | None], list[str]]


@dataclass(frozen=True)
class CaptureStep:
    """One way of writing attention, and how to route it through quantized attention.

    Attributes:
        name: its name in :data:`CAPTURE_STEPS`.
        model: ``step(model, quant_desc) -> names``, run on the model before tracing, or None.
        graph: ``step(graph_module, quant_desc) -> names``, run on each traced graph before the rules, or None.
        description: what it captures, one sentence.

    Each returns the names of the modules it made quantized (for placement's summary); ``quant_desc`` is the
    descriptor of the quantizers placement adds (None: 8-bit per tensor).
    """

    name: str
    model: ModelStep | None = None
    graph: GraphStep | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.graph is None):
            raise QdqTypeError(f"capture step {self.name!r}: give exactly one of model= and graph=.")
        if not callable(self.model or self.graph):
            raise QdqTypeError(f"capture step {self.name!r}: its step must be callable.")


#: name -> capture step, in registration order (the order placement runs them).
CAPTURE_STEPS: Registry[str, CaptureStep] = Registry("capture step")


def register_capture_step(step: CaptureStep, *, override: bool = False) -> CaptureStep:
    """Register ``step`` under its name (run by every later placement); returns it."""
    if not isinstance(step, CaptureStep):
        raise QdqTypeError(f"register_capture_step needs a CaptureStep, got {type(step).__name__}.")
    return CAPTURE_STEPS.register(step.name, step, override=override)


def _steps(names: Sequence[str] | None) -> list[CaptureStep]:
    return [CAPTURE_STEPS.get(n) for n in names] if names is not None else [step for _, step in CAPTURE_STEPS.items()]


def capture_model(
    model: nn.Module, quant_desc: QuantDescriptor | None, names: Sequence[str] | None = None
) -> list[str]:
    """Run the ``model`` capture steps (all, or those named) on ``model``; the names of the captured modules."""
    return [found for step in _steps(names) if step.model is not None for found in step.model(model, quant_desc)]


def capture_graph(
    graph_module: fx.GraphModule, quant_desc: QuantDescriptor | None, names: Sequence[str] | None = None
) -> list[str]:
    """Run the ``graph`` capture steps (all, or those named) on a traced graph; the names of the added modules."""
    return [found for step in _steps(names) if step.graph is not None for found in step.graph(graph_module, quant_desc)]


def apply_attention_facts(model: nn.Module, facts: AttentionFacts) -> int:
    """Give every attention module of ``model`` the target's ``facts``: the quantizers they do not list are
    disabled, the softmax scale goes where they say (``scale_query``), and calibration checks the shapes against
    them (:func:`settle_attention`). Returns the number of attention modules."""
    modules = [m for m in model.modules() if isinstance(m, QuantScaledDotProductAttention)]
    for module in modules:
        apply_module_facts(module, facts)
    return len(modules)


# --- the built-in steps ------------------------------------------------------------------------------------------


def _huggingface(model: nn.Module, quant_desc: QuantDescriptor | None) -> list[str]:
    """Capture the outermost transformers models inside ``model`` (``model`` itself, usually)."""
    found: list[str] = []
    done: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{d}.") for d in done) or not hasattr(module, "set_attn_implementation"):
            continue
        if not any(dispatches_through_registry(m) for m in module.modules()):
            continue
        names = capture_hf_attention(module, quant_desc, quant_desc)
        found += [f"{path}.{n}" if path else n for n in names]
        done.append(path)
        if not path:
            break
    return found


def _fused_attention_flag(model: nn.Module, quant_desc: QuantDescriptor | None) -> list[str]:
    use_fused_attention(model)
    return []  # no module yet: the sdpa_calls step adds them


def _sdpa_calls(graph_module: fx.GraphModule, quant_desc: QuantDescriptor | None) -> list[str]:
    make = functools.partial(QuantScaledDotProductAttention, quant_desc)
    return replace_sdpa_calls(graph_module, make=make)


for _step in (
    CaptureStep(
        "huggingface_attention",
        model=_huggingface,
        description="transformers models dispatching attention through its registry get a quant_attention each",
    ),
    CaptureStep(
        "fused_attention_flag",
        model=_fused_attention_flag,
        description="modules with a fused_attn flag (timm) call F.scaled_dot_product_attention",
    ),
    CaptureStep(
        "sdpa_calls",
        graph=_sdpa_calls,
        description="F.scaled_dot_product_attention calls become QuantScaledDotProductAttention modules",
    ),
):
    register_capture_step(_step)

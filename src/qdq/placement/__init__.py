"""Q/DQ placement for PyTorch: where a quantized model needs quantizers beyond its Conv/Linear inputs and weights.

``quantize_model`` quantizes the inputs and weights of weighted modules. A runtime needs a few more
quantizers, at places torch writes as *functions* in ``forward`` (``out += identity``, ``torch.cat``), which
module replacement cannot reach, and some runtimes more (ONNX Runtime's int8 kernels need quantized conv
outputs). :func:`apply_placement` traces the model with ``torch.fx``, builds its graph view in the placement
language (:class:`~qdq.graphs.view.GraphView`: ONNX op names, the quantizers so far), runs a target's rules on
it, makes their decisions in the graph (:mod:`qdq.graphs.fx_edit`) and returns the rewritten model (a
``torch.fx.GraphModule`` with the same parameters, buffers and ``state_dict`` keys, plus the added quantizers)::

    model = quantize_model(torchvision.models.resnet18())
    model = apply_placement(model, target="tensorrt")   # then calibrate, fine-tune, export

The rules belong to their targets: what each decides, and why, is documented in the target packages
(:mod:`qdq.targets.tensorrt`, :mod:`qdq.targets.onnxruntime`, and the shared :mod:`qdq.targets.common`).

The placed model remembers its target (:func:`qdq.targets.marks.placed_target`; ``export_onnx`` defaults to it).
When placement builds a new model, the one passed in is marked stale: running or exporting it raises, so the
returned model is the one to use.

Extending: :func:`register_placement_rule` adds a rule (the counterpart of the TF toolkit's
``CustomQDQInsertionCase``): a function ``rule(view: GraphView) -> None`` that decides on the view (the same rule
then runs for Keras and ONNX models). :func:`op_inputs_rule` builds the common case "quantize the inputs of
every op of these types" (e.g. the squeeze-excitation ``Mul`` of EfficientNet); :func:`function_inputs_rule`
the same from torch functions.

Attention: before the rules, placement routes the model's attention through
:class:`~qdq.nn.attention.QuantScaledDotProductAttention` modules (:mod:`qdq.placement.capture`: a registry
of capture steps for Hugging Face models, timm, ``F.scaled_dot_product_attention`` calls; ``capture=`` picks
them); the target's ``attention`` rule gives every attention module its :class:`~qdq.targets.AttentionFacts`.

Fallback: when ``torch.fx`` cannot trace the whole model (data-dependent control flow), each child module
is placed on its own, recursively; one warning per model names the modules it could not trace, whose own
adds stay float (use :class:`~qdq.nn.QuantAdd` there by hand).
"""

from __future__ import annotations

from qdq.graphs.view import GraphView
from qdq.placement.apply import apply_placement
from qdq.placement.capture import CAPTURE_STEPS, CaptureStep, register_capture_step
from qdq.placement.extend import (
    function_inputs_rule,
    op_inputs_rule,
    placement_rules,
    register_placement_rule,
    unregister_placement_rule,
)
from qdq.targets.rules import PLACEMENT_RULES

__all__ = [
    "CAPTURE_STEPS",
    "PLACEMENT_RULES",
    "CaptureStep",
    "GraphView",
    "apply_placement",
    "function_inputs_rule",
    "op_inputs_rule",
    "placement_rules",
    "register_capture_step",
    "register_placement_rule",
    "unregister_placement_rule",
]

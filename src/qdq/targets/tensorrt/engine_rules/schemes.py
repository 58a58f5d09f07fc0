"""TensorRT's quantization schemes: activations per tensor, weights per output channel.

* ``activation-per-tensor`` — activations are quantized per tensor. Developer guide, "Quantization Schemes"
  (per-tensor activations; per-channel for weights only).
* ``weight-axis`` — a per-channel weight is quantized along the op's output channels: axis 0 of Conv
  weights, of Gemm ``B`` with ``transB=1`` (axis 1 with ``transB=0``), the last axis of a MatMul's constant
  ``B``; ConvTranspose along axis 0 (its input channels): TensorRT's deconvolution kernels take
  per-input-channel weight scales (maintainers in NVIDIA/TensorRT#2380 and #1694; ModelOpt's ONNX path
  uses axis 1 — the TensorRT maintainers' word is followed). Per-channel axes are followed back through
  Transpose perms.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import attr, name_of
from qdq.targets.tensorrt.engine_rules.facts import WEIGHTED, GraphFacts, Q, Rule, Violation

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["RULES"]


def _activation_per_tensor(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type != Q or f.is_constant(node.inputs[0]):
            continue
        if f.per_channel(f.scale(node)):
            yield Violation(
                "activation-per-tensor",
                f.name(node),
                f"quantizes activation {name_of(node.inputs[0], '')!r} per channel "
                f"(axis {f.axis(node)}); TensorRT quantizes activations per tensor",
            )


def _weight_axis(f: GraphFacts) -> Iterator[Violation]:
    for node in f.nodes:
        if node.op_type not in WEIGHTED:
            continue
        for index in _weight_inputs(f, node):
            dq, passed = f.quantized_source(node.inputs[index])
            if dq is None or not f.per_channel(f.scale(dq)):
                continue
            expected = _expected_axis(f, node, index)
            at_dq = _axis_before(passed, expected)
            if at_dq is not None and f.axis(dq) != at_dq:
                yield Violation(
                    "weight-axis",
                    f.name(dq),
                    f"quantizes the weight of {node.op_type} {f.name(node)} "
                    f"along axis {f.axis(dq)}; TensorRT needs axis {at_dq} ({_axis_reason(node)})",
                )


def _weight_inputs(f: GraphFacts, node: ir.Node) -> list[int]:
    """Indices of the inputs of a weighted op that hold its weight (a constant behind its DQ)."""
    if node.op_type in ("Conv", "ConvTranspose", "Gemm"):
        return [1] if len(node.inputs) > 1 else []
    found = []
    for index in (0, 1):
        dq, _ = f.quantized_source(node.inputs[index])
        q = f.q_of(dq) if dq is not None else None
        source = q.inputs[0] if q is not None else (dq.inputs[0] if dq else None)
        if source is not None and f.is_constant(source):
            found.append(index)
    return found


def _expected_axis(f: GraphFacts, node: ir.Node, index: int) -> int | None:
    dims = f.dims(node.inputs[index])
    if node.op_type in ("Conv", "ConvTranspose"):
        return 0
    if node.op_type == "Gemm":
        return 0 if attr(node, "transB", 0) else 1
    if dims is None:
        return None
    return len(dims) - 1 if index == 1 else len(dims) - 2


def _axis_reason(node: ir.Node) -> str:
    return {
        "Conv": "output channels",
        "ConvTranspose": "TensorRT's deconvolution takes per-input-channel scales",
        "Gemm": "output channels of B",
        "MatMul": "the output columns of the constant operand",
    }[node.op_type]


def _axis_before(passed: list[ir.Node], axis: int | None) -> int | None:
    """The axis at the DQ that becomes ``axis`` at the op after the layout ops ``passed`` (nearest op first)."""
    for node in passed:
        if axis is None:
            return None
        if node.op_type == "Identity":
            continue
        if node.op_type != "Transpose":
            return None  # a reshape: the channel axis cannot be followed
        perm = attr(node, "perm")
        if perm is None:
            return None
        axis = perm[axis]
    return axis


RULES = (
    Rule(
        "activation-per-tensor",
        "activations are quantized per tensor",
        "TensorRT dev guide: Quantization Schemes",
        _activation_per_tensor,
    ),
    Rule(
        "weight-axis",
        "per-channel weights along the output channels (ConvTranspose: axis 0)",
        "TensorRT dev guide; NVIDIA/TensorRT#2380",
        _weight_axis,
    ),
)

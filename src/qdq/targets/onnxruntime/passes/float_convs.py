"""The check after the passes: which Convs ONNX Runtime cannot run as ``QLinearConv`` (an input or the weight is
not dequantized, or the output is not read by exactly one QuantizeLinear, through at most one activation ORT
folds), and the one warning that says why."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import const_input, single_reader
from qdq.targets.onnxruntime.fusion import ONNXRUNTIME_FUSION
from qdq.targets.onnxruntime.passes._graph import dq_params

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = ["UnquantizedConvWarning", "float_convs_said", "unfusable_conv_nodes", "unfusable_convs", "warn_float_convs"]


class UnquantizedConvWarning(UserWarning):
    """Convs that will run in float on ONNX Runtime because a quantizer is missing around them; its advice is for a
    model quantized without this target. ``convs``: their names. A front end that placed the file for the target
    (:func:`float_convs_said`) says why instead."""

    def __init__(self, message: str, convs: list[str]) -> None:
        super().__init__(message)
        self.convs = convs


@contextlib.contextmanager
def float_convs_said(say: Callable[[list[str]], str]) -> Iterator[None]:
    """Inside, the :class:`UnquantizedConvWarning` s of the rewrite become one warning, ``say(convs)`` (every Conv
    they name), for a front end that placed the model for the target; other warnings pass as they were. The warning
    points two calls above the function that holds the context (the user's call of the entry point that calls it).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    convs = [conv for w in caught if isinstance(w.message, UnquantizedConvWarning) for conv in w.message.convs]
    for warning in caught:
        if not isinstance(warning.message, UnquantizedConvWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if convs:
        warnings.warn(say(convs), UserWarning, stacklevel=5)


def unfusable_convs(model: onnx.ModelProto) -> list[str]:
    """Convs ONNX Runtime cannot run as ``QLinearConv``: an input or the weight is not dequantized, or the
    output is not read by exactly one QuantizeLinear (through at most one activation ORT folds, Relu/Clip,
    which it removes only when the Q's zero point is the type's minimum, i.e. uint8 with zero point 0)."""
    import onnx_ir as ir

    return [str(conv.name) for conv in unfusable_conv_nodes(ir.serde.deserialize_model(model).graph)]


def clamped_before_q(conv: ir.Node) -> bool:
    """Does the Conv's output reach a QuantizeLinear through a clamp (Clip/Min/Max, after at most its bias Add
    and a Relu)?
    That is how a sub-8-bit quantizer is exported (``mode.py``)."""
    node = single_reader(conv.outputs[0])
    if node is not None and node.op_type == "Add" and const_input(node, 1) is not None:  # its bias, moved
        node = single_reader(node.outputs[0])
    if node is not None and node.op_type == "Relu":
        node = single_reader(node.outputs[0])
    seen_clamp = False
    while node is not None and node.op_type in ("Clip", "Min", "Max"):
        seen_clamp = True
        node = single_reader(node.outputs[0])
    return seen_clamp and node is not None and node.op_type == "QuantizeLinear"


def unfusable_conv_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The Convs of ``graph`` ONNX Runtime cannot run as ``QLinearConv`` (see :func:`unfusable_convs`)."""
    fusion = ONNXRUNTIME_FUSION
    nodes = []
    for conv in graph:
        if conv.op_type != "Conv":
            continue
        data = fusion.dequantized_inputs(conv.op_type, len(conv.inputs))
        inputs_ok = all(dq_params(conv.inputs[i]) is not None for i in data)
        out = single_reader(conv.outputs[0])
        activation = out if out is not None and out.op_type in fusion.folded_activations else None
        if activation is not None:
            out = single_reader(activation.outputs[0])
        q = out if inputs_ok and out is not None and out.op_type == "QuantizeLinear" else None
        fused = q is not None
        if q is not None and activation is not None:  # ORT drops a Relu/Clip only before a Q of zero point the min
            zp = const_input(q, 2)
            fused = zp is not None and bool(np.all(zp == np.iinfo(zp.dtype).min))
        if not fused:
            nodes.append(conv)
    return nodes


def _dequantizes_some(conv: ir.Node) -> bool:
    """Is any input of ``conv`` (its data or its weight) dequantized? A Conv with no Q/DQ at all was left float on
    purpose (``keep_float``, the float stem ``auto`` measured, a sensitivity choice): no quantizer is missing."""
    return any(dq_params(value) is not None for value in conv.inputs[:2])


def warn_float_convs(convs: list[ir.Node]) -> None:
    """One warning per cause for ``convs``, the Convs that will run in float on ONNX Runtime (a Conv with no Q/DQ
    at all is float on purpose: not warned about)."""
    convs = [conv for conv in convs if _dequantizes_some(conv)]  # none at all: left float on purpose
    if not convs:
        return
    is_clamped = [clamped_before_q(conv) for conv in convs]
    clamped = [str(conv.name) for conv, c in zip(convs, is_clamped, strict=True) if c]
    unquantized = [str(conv.name) for conv, c in zip(convs, is_clamped, strict=True) if not c]
    if clamped:
        warnings.warn(
            f"{len(clamped)} Conv(s) will run in float on ONNX Runtime (e.g. {clamped[0]}): their output is "
            "clamped to a sub-8-bit range before its QuantizeLinear, and ORT has no kernel for sub-8-bit "
            "activations. The numbers are those of the quantized model; only the int8 speed-up is lost.",
            stacklevel=4,
        )
    if unquantized:
        message = (
            f"{len(unquantized)} Conv(s) will run in float on ONNX Runtime (e.g. {unquantized[0]}): their "
            "output has no quantizer (or their input/weight none). Quantize the model for this target before "
            "calibrating to run every Conv in int8: model = qdq.quantize_model(model, "
            "qdq.QuantConfig(target='onnxruntime')), or for Keras qdq.keras.quantize_model(model, "
            "target='onnxruntime')."
        )
        warnings.warn(UnquantizedConvWarning(message, unquantized), stacklevel=4)

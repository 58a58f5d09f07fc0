"""Rewrite of a qdq Q/DQ graph so that ONNX Runtime's CPU provider runs its Convs as int8 kernels.

ORT replaces ``DQ(x) + DQ(w) [+ DQ(bias)] -> Conv -> Q`` by ``QLinearConv`` (and similar groups by
``QGemm``, ``QLinearAdd``...). The TensorRT-style graph does not have that form. The rewrite keeps every
quantized value of the model and changes only the encoding:

1. **Weights** ``Q(W) -> DQ`` become an int8 initializer ``-> DQ`` (the integers ORT would compute).
2. **BatchNorm after a Conv** is folded into it: the per-output-channel BN factor ``k = gamma / sqrt(var +
   eps)`` multiplies the weight *scale* (the int8 weights are unchanged; negated where ``k < 0``), and the
   bias becomes ``(b - mean) * k + beta``. This is what TensorRT does internally; it is exact up to float32
   rounding of ``scale * k`` (one ulp), not bit for bit. Channels with ``k = 0`` get zero int8 weights instead.
   Likewise an ``Add`` of one constant per output channel right after a Conv (a bias tf2onnx wrote apart)
   becomes the Conv's bias.
3. **Zero masks after a Conv**: a quantizer with ``amax <= 2**-24`` gives zeros; its export multiplies the
   input by a 0/1 mask before the Q (``mode.py``). A constant mask Mul right after a Conv (possibly through a
   Relu, or a Clip whose range holds 0) is folded into the Conv: the masked output channels get zero int8
   weights and a zero bias, which gives the same zeros, and the Conv keeps its ``-> Q`` form (``QLinearConv``).
   When every channel is masked the activation only sees zeros and goes too (ORT could not drop a Clip(0, 6)
   before a Q of step 1). A mask Mul whose input is zero anyway (after such Convs, through ops that keep zeros)
   is removed. Exact for finite inputs, as the mask itself.
4. **Signed activations** int8 with zero point 0 become uint8 with zero point 128 and the same scale: the
   same grid, bit-identical dequantized values. (ORT's x86 kernels take uint8 activations; its own s8->u8
   rewrite covers only some pairs and leaves Convs unfused.) Unsigned activations (uint8, zero point 0, from
   ``placement``'s ``unsigned_activations`` rule) are kept: ORT then drops the ReLU / ReLU6 before them.
5. **Conv / Gemm bias** becomes int32 with scale ``s_x * s_w`` (per output channel) behind a DQ, as ORT's
   ``QLinearConv`` requires: the bias moves by at most ``s_x * s_w / 2``. At 8 bits that is far below an
   output step; with 4-bit weights and activations it reaches a few % of one. A Conv ORT cannot fuse (its
   output has no Q, e.g. behind a sub-8-bit clamp) runs in float: its bias moves to an ``Add`` after it so
   that ORT's own passes do not round it to int32 either.
6. **Duplicates**: several equal Q/DQ pairs on one tensor become one, and ``DQ -> Q`` with equal parameters
   (a re-quantization that changes nothing) is removed. Both are exact.
7. **Global average pooling**: ``ReduceMean`` over every spatial axis with ``keepdims`` (how the dynamo
   exporter writes ``adaptive_avg_pool2d(x, 1)``) becomes ``GlobalAveragePool``, the same mean, which ORT
   runs as ``QLinearGlobalAveragePool`` between a DQ and a Q (it has no int8 ReduceMean). Exact up to the
   float summation order. A ``Flatten`` after it (the TorchScript exporter's) becomes the equal ``Reshape``,
   which ORT moves the next Q across.
8. **Dense layers**: ``MatMul(x, DQ(W [K, N])) [+ constant bias]`` with a 2-D ``x`` (how Keras writes Dense)
   becomes ``Gemm(x, DQ(W.T), bias, transB=1)``, ORT's ``QGemm`` pattern (step 5 then makes its bias int32).
   The same product; the transposed weight keeps its integers and scales.
9. **Weights on CPUs whose int8 dot products saturate**: on x86 without VNNI, ORT's U8S8 kernels add pairs
   of ``u8 * s8`` products in int16 with saturation and silently compute something else (:mod:`qdq.cpu`).
   With ``weights="uint8"`` (chosen by ``"auto"`` on such a CPU) every int8 weight whose integers leave
   ``[-64, 64]`` is stored as uint8 with zero point 128: the same dequantized values, run by ORT's U8U8
   kernels, which widen to int16 first and are exact. (ORT's own quantizer offers ``reduce_range``, 7-bit
   weights, instead: a different model from the one trained.)

Only the top-level graph is rewritten.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqConfigError
from qdq.export.graph import GraphIndex, add_quantizer_names, quantizer_names, set_metadata, tidy
from qdq.targets import FusionFacts, get_target

if TYPE_CHECKING:
    import onnx

__all__ = [
    "WEIGHTS_METADATA_KEY",
    "WEIGHT_ENCODINGS",
    "encode_weights_uint8",
    "rewrite_for_onnxruntime",
    "unfusable_convs",
]

#: model metadata key recording how the rewrite stored the weights (``"int8"`` or ``"uint8"``)
WEIGHTS_METADATA_KEY = "qdq.ort_weights"

_INT32_LIMIT = 2**31 - 1
_TARGET = "onnxruntime"  # the target whose rewrite this is (qdq.targets); its fusion facts say what ORT fuses


def _fusion() -> FusionFacts:
    return get_target(_TARGET).require_fusion()


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _set_axis(node: Any, axis: int | None) -> None:
    kept = [a for a in node.attribute if a.name != "axis"]
    del node.attribute[:]
    node.attribute.extend(kept)
    if axis is not None:
        from onnx import helper

        node.attribute.append(helper.make_attribute("axis", axis))


def _quantize_weight(w: np.ndarray, scale: np.ndarray, dtype: np.dtype, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear of a constant with zero point 0 (:func:`qdq.ops.round_to_grid`), as ``dtype``."""
    import torch

    from qdq.ops import round_to_grid

    step = torch.tensor(scale, dtype=torch.float32)
    if step.dim() == 1:
        shape = [1] * w.ndim
        shape[axis % w.ndim] = step.numel()
        step = step.reshape(shape)
    info = np.iinfo(dtype)
    q = round_to_grid(torch.tensor(w, dtype=torch.float32), step, int(info.min), int(info.max))
    return q.numpy().astype(dtype)


# ------------------------------------------------------------------------------------- 1. weights
def _fold_weight_quantizers(g: GraphIndex) -> int:
    """``Q(initializer) -> DQ`` with zero point 0 becomes ``int8 initializer -> DQ``."""
    done = []
    for q in list(g.graph.node):
        if q.op_type != "QuantizeLinear":
            continue
        w, scale, zp = g.array(q.input[0]), g.array(q.input[1]), g.const_input(q, 2)
        if w is None or scale is None or zp is None or np.any(zp != 0) or q.output[0] in g.outputs:
            continue
        name = g.add_const(q.input[0] + "_quantized", _quantize_weight(w, scale, zp.dtype, _attr(q, "axis", 1)))
        g.rewire(q.output[0], name)
        done.append(q)
    g.remove(done)
    return len(done)


# ----------------------------------------------------------------------------------- 2. BatchNorm
def _weight_dq(g: GraphIndex, conv: Any) -> Any | None:
    dq = g.producer.get(conv.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or g.array(dq.input[0]) is None:
        return None
    return dq if g.single_reader(dq.output[0]) is conv else None


def _bn_factor(g: GraphIndex, bn: Any) -> tuple[np.ndarray, np.ndarray] | None:
    arrays = [g.array(name) for name in bn.input[1:5]]
    if any(a is None for a in arrays) or len(bn.output) != 1:
        return None
    gamma, beta, mean, var = (a.astype(np.float64) for a in arrays)  # type: ignore[union-attr]
    k = gamma / np.sqrt(var + float(_attr(bn, "epsilon", 1e-5)))
    return k, beta - mean * k


def _fold_bn(g: GraphIndex, conv: Any, bn: Any, dq: Any) -> bool:
    factors = _bn_factor(g, bn)
    if factors is None:
        return False
    k, shift = factors
    wq, scale, zp = g.array(dq.input[0]), g.array(dq.input[1]), g.array(dq.input[2])
    channels = wq.shape[0]
    if k.size != channels or np.any(zp != 0):
        return False
    negative = k < 0
    if np.any(wq[negative] == np.iinfo(wq.dtype).min):
        return False  # -(-128) does not fit in int8
    new_wq = wq.copy()
    new_wq[negative] = -new_wq[negative]
    new_wq[k == 0] = 0  # a dead channel: zero weights at the old step (a zero step is no valid scale)
    old_scale = np.broadcast_to(scale.astype(np.float64), (channels,))
    new_scale = np.where(k == 0, old_scale, old_scale * np.abs(k)).astype(np.float32)
    bias = g.array(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(channels, np.float32)
    if bias is None:
        return False
    new_bias = (bias.astype(np.float64) * k + shift).astype(np.float32)
    dq.input[0] = g.add_const(dq.input[0] + "_bnfold", new_wq)
    dq.input[1] = g.add_const(dq.input[1] + "_bnfold", new_scale)
    dq.input[2] = g.add_const(dq.input[2] + "_bnfold", np.zeros(channels, zp.dtype))
    _set_axis(dq, 0)
    bias_name = g.add_const(conv.name + "_bias_bnfold", new_bias)
    if len(conv.input) > 2:
        conv.input[2] = bias_name
    else:
        conv.input.append(bias_name)
    conv.output[0] = bn.output[0]
    return True


def _fold_batchnorms(g: GraphIndex) -> int:
    """Fold ``Conv -> BatchNormalization`` when the Conv's weight is a dequantized int8 initializer."""
    done = []
    for conv in list(g.graph.node):
        if conv.op_type != "Conv":
            continue
        bn = g.single_reader(conv.output[0])
        dq = _weight_dq(g, conv)
        if bn is None or bn.op_type != "BatchNormalization" or dq is None:
            continue
        if _fold_bn(g, conv, bn, dq):
            done.append(bn)
    g.remove(done)
    return len(done)


def _channel_constant(value: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as one number per channel (axis 1 of a rank-``rank`` tensor), when it broadcasts that way."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if shape[0] != 1 or any(n != 1 for n in shape[2:]) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1), (channels,))


def _fold_bias_adds(g: GraphIndex) -> int:
    """``Conv -> Add(constant, one value per output channel)`` becomes the Conv's bias (tf2onnx writes the
    bias of a Conv on 1x1 feature maps as such an Add); ORT fuses only a Conv whose bias is an input."""
    done = []
    for conv in list(g.graph.node):
        add = g.single_reader(conv.output[0]) if conv.op_type == "Conv" else None
        dq = _weight_dq(g, conv) if add is not None and add.op_type == "Add" else None
        others = [name for name in add.input if name != conv.output[0]] if dq is not None else []
        value = g.array(others[0]) if len(others) == 1 else None
        bias = g.const_input(conv, 2) if len(conv.input) > 2 and conv.input[2] else None
        if value is None or (len(conv.input) > 2 and conv.input[2] and bias is None):
            continue
        weight = g.array(dq.input[0])  # type: ignore[union-attr]
        per_channel = _channel_constant(value, weight.ndim, weight.shape[0])  # type: ignore[union-attr]
        if per_channel is None:
            continue
        total = per_channel.astype(np.float32) + (0 if bias is None else bias.astype(np.float32))
        name = g.add_const(conv.name + "_bias_folded", total.astype(np.float32))
        if len(conv.input) > 2:
            conv.input[2] = name
        else:
            conv.input.append(name)
        conv.output[0] = add.output[0]
        done.append(add)
    g.remove(done)
    return len(done)


# ------------------------------------------------------------------------------ 3. zero masks
def _keeps_zero(g: GraphIndex, node: Any) -> bool:
    """A Relu, or a Clip whose constant bounds hold 0: the op maps 0 to 0."""
    if node.op_type == "Relu":
        return True
    if node.op_type != "Clip":
        return False
    for index, attr, ok in ((1, "min", lambda v: v <= 0), (2, "max", lambda v: v >= 0)):
        name = node.input[index] if len(node.input) > index else ""
        value = g.const_input(node, index) if name else _attr(node, attr)
        if name and value is None:
            return False  # a bound computed at run time
        if value is not None and not ok(float(np.asarray(value).reshape(-1)[0])):
            return False
    return True


def _mask_after(g: GraphIndex, conv: Any) -> tuple[Any, Any | None] | None:
    """``(Mul, activation or None)`` right after ``conv``, through at most one zero-keeping activation."""
    activation = g.single_reader(conv.output[0])
    if activation is not None and _keeps_zero(g, activation):
        mul = g.single_reader(activation.output[0])
    else:
        activation, mul = None, activation
    if mul is None or mul.op_type != "Mul" or len(mul.input) != 2 or mul.output[0] in g.outputs:
        return None
    return mul, activation


def _channel_mask(g: GraphIndex, mul: Any, tensor: str, weight: np.ndarray) -> np.ndarray | None:
    """The 0/1 mask ``mul`` applies to each output channel of a Conv with ``weight``, or None."""
    others = [name for name in mul.input if name != tensor]
    mask = g.array(others[0]) if len(others) == 1 else None
    if mask is None or mask.ndim > weight.ndim or not np.all((mask == 0) | (mask == 1)):
        return None
    shape = (1,) * (weight.ndim - mask.ndim) + mask.shape
    if any(n != 1 for i, n in enumerate(shape) if i != 1) or shape[1] not in (1, weight.shape[0]):
        return None
    return np.broadcast_to(mask.reshape(-1), (weight.shape[0],)).astype(bool)


def _masked(weight: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``weight`` with the output channels (axis 0) where ``keep`` is False set to 0."""
    return np.where(keep.reshape((-1,) + (1,) * (weight.ndim - 1)), weight, 0).astype(weight.dtype)


def _fold_mask(g: GraphIndex, conv: Any, mul: Any, activation: Any | None) -> list[Any]:
    """Zero the int8 weights and bias of the channels ``mul`` masks; return the nodes made useless.

    The Mul's readers then read the activation's output, or the Conv's when every channel is masked (the
    activation then only sees zeros, which it keeps: it goes too, and ORT sees ``Conv -> Q``).
    """
    dq = _weight_dq(g, conv)
    zero_point = g.const_input(dq, 2) if dq is not None else None
    if dq is None or zero_point is None or np.any(zero_point != 0):
        return []
    weight = g.array(dq.input[0])
    tensor = (activation or conv).output[0]
    keep = _channel_mask(g, mul, tensor, weight)  # type: ignore[arg-type]
    bias = g.const_input(conv, 2)
    if keep is None or (len(conv.input) > 2 and conv.input[2] and bias is None):
        return []
    dq.input[0] = g.add_const(dq.input[0] + "_masked", _masked(weight, keep))  # type: ignore[arg-type]
    if bias is not None:
        conv.input[2] = g.add_const(conv.input[2] + "_masked", np.where(keep, bias, 0).astype(bias.dtype))
    if activation is not None and not keep.any():
        g.rewire(mul.output[0], conv.output[0])
        return [mul, activation]
    g.rewire(mul.output[0], tensor)
    return [mul]


def _fold_zero_masks(g: GraphIndex) -> int:
    """Fold the constant 0/1 mask Muls that follow Convs into the Convs' weights and biases."""
    done = []
    for conv in list(g.graph.node):
        found = _mask_after(g, conv) if conv.op_type == "Conv" else None
        if found is not None:
            done += _fold_mask(g, conv, *found)
    g.remove(done)
    return sum(node.op_type == "Mul" for node in done)


# Ops whose output is zero when their first input is (for finite values).
_ZERO_KEEPING = frozenset(
    {"Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceMax", "Reshape",
     "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Resize"}
)  # fmt: skip


def _is_zero_const(g: GraphIndex, name: str) -> bool:
    value = g.array(name) if name else None
    return value is not None and not np.any(value)


def _zero_output(g: GraphIndex, node: Any, zeros: set[str]) -> bool:
    """Is ``node``'s output zero for every finite input, given the tensors known to be zero?"""
    op, inputs = node.op_type, [name for name in node.input if name]
    if op in _ZERO_KEEPING or (op == "Clip" and _keeps_zero(g, node)):
        return inputs[0] in zeros
    if op == "Mul":
        return any(name in zeros or _is_zero_const(g, name) for name in inputs)
    if op in ("Add", "Sub", "Concat"):
        return all(name in zeros for name in inputs)
    if op == "DequantizeLinear":
        q = g.producer.get(inputs[0])
        return q is not None and q.op_type == "QuantizeLinear" and q.input[0] in zeros and _same_params(g, q, node)
    if op == "Conv":
        no_bias = len(inputs) < 3 or _is_zero_const(g, inputs[2])
        return (inputs[0] in zeros or _is_zero_weight(g, inputs[1])) and no_bias
    return False


def _is_zero_weight(g: GraphIndex, name: str) -> bool:
    """A zero constant, or the DequantizeLinear of zero integers with zero points 0."""
    dq = g.producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return _is_zero_const(g, name)
    return _is_zero_const(g, dq.input[0]) and (len(dq.input) < 3 or _is_zero_const(g, dq.input[2]))


def _zero_tensors(g: GraphIndex) -> set[str]:
    """Tensors that are zero whatever the (finite) input: after all-zero Convs, in topological order."""
    zeros: set[str] = set()
    for node in g.graph.node:
        if len(node.output) == 1 and _zero_output(g, node, zeros):
            zeros.add(node.output[0])
    return zeros


def _is_mask(g: GraphIndex, name: str) -> bool:
    """A constant of zeros and ones."""
    value = g.array(name)
    return value is not None and bool(np.all((value == 0) | (value == 1)))


def _drop_masks_of_zeros(g: GraphIndex) -> int:
    """Remove the constant 0/1 mask Muls (read only by QuantizeLinear) whose other input is zero anyway."""
    zeros = _zero_tensors(g)
    done = []
    for mul in list(g.graph.node):
        if mul.op_type != "Mul" or len(mul.input) != 2 or mul.output[0] in g.outputs:
            continue
        readers = g.consumers.get(mul.output[0], [])
        if not readers or any(r.op_type != "QuantizeLinear" for r in readers):
            continue
        for data, mask in (mul.input, reversed(mul.input)):
            if data in zeros and _is_mask(g, mask):
                g.rewire(mul.output[0], data)
                done.append(mul)
                break
    g.remove(done)
    return len(done)


# ------------------------------------------------------------------------ 4. uint8 activations
def _qdq_pairs(g: GraphIndex) -> Iterator[tuple[Any, list[Any]]]:
    for q in g.graph.node:
        if q.op_type == "QuantizeLinear":
            dqs = [u for u in g.consumers.get(q.output[0], []) if u.op_type == "DequantizeLinear"]
            if dqs and len(dqs) == len(g.consumers.get(q.output[0], [])):
                yield q, dqs


def _activations_to_uint8(g: GraphIndex) -> int:
    """int8 zero point 0 -> uint8 zero point 128 (same scale): the same dequantized values."""
    count = 0
    for q, dqs in list(_qdq_pairs(g)):
        zp = g.array(q.input[2])
        if zp is None or zp.dtype != np.int8 or np.any(zp != 0) or q.output[0] in g.outputs:
            continue
        name = g.add_const((q.input[2] or "zero_point") + "_u8", np.full(zp.shape, 128, np.uint8))
        for node in (q, *dqs):
            node.input[2] = name
        count += 1
    g.refresh()
    return count


# --------------------------------------------------------------------------------- 5. int32 bias
def _dq_params(g: GraphIndex, tensor: str) -> tuple[np.ndarray, int | None] | None:
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale = g.array(dq.input[1])
    return None if scale is None else (scale, _attr(dq, "axis", 1))


def _bias_scale(g: GraphIndex, node: Any) -> np.ndarray | None:
    """``s_x * s_w`` per output channel, when input and weight are dequantized and the weight axis is 0."""
    x, w = _dq_params(g, node.input[0]), _dq_params(g, node.input[1])
    if x is None or w is None or x[0].ndim != 0:
        return None
    if node.op_type == "Gemm" and (_attr(node, "transB", 0) != 1 or _attr(node, "transA", 0) != 0):
        return None
    if w[0].ndim == 1 and w[1] != 0:
        return None
    return (x[0].astype(np.float32) * w[0].astype(np.float32)).astype(np.float32)


def _bias_after_float_convs(g: GraphIndex, float_convs: list[Any]) -> int:
    """Each of ``float_convs`` (Convs ORT cannot fuse: they run in float) gets its bias as an ``Add`` after
    it. Left on the Conv, ORT's WeightBiasQuantization pass would round it to int32 at ``s_x * s_w`` (the Conv
    reads ``DQ(x)``), a loss with no int8 kernel to pay for it; ORT does not fold the Add back (the weight is
    a DQ output, not a constant)."""
    from onnx import helper

    count = 0
    for conv in float_convs:
        bias, dq = g.const_input(conv, 2), _weight_dq(g, conv)
        if bias is None or bias.ndim != 1 or dq is None:
            continue
        rank = g.array(dq.input[0]).ndim  # type: ignore[union-attr]  # _weight_dq: a constant weight
        shaped = g.add_const(conv.input[2] + "_broadcast", bias.reshape([1, -1] + [1] * (rank - 2)))
        out = conv.output[0]
        conv.output[0] = g.unique(out + "_without_bias")
        del conv.input[2]
        add = helper.make_node("Add", [conv.output[0], shaped], [out], name=(conv.name or "conv") + "/bias_Add")
        g.insert(conv, add, after=True)
        count += 1
    g.refresh()
    return count


def _quantize_biases(g: GraphIndex, float_convs: list[Any]) -> int:
    """int32 biases for the Convs ORT fuses and for Gemms; ``float_convs`` keep their exact float bias."""
    count = 0
    skip = {id(conv) for conv in float_convs}
    for node in list(g.graph.node):
        if node.op_type not in ("Conv", "Gemm") or id(node) in skip:
            continue
        bias = g.const_input(node, 2)
        scale = _bias_scale(g, node)
        if bias is None or scale is None or bias.ndim != 1:
            continue
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.rint(bias.astype(np.float32) / safe)
        if np.any(np.abs(q) > _INT32_LIMIT) or np.any(scale <= 0):
            warnings.warn(f"{node.name}: bias does not fit int32 at scale s_x*s_w; left float.", stacklevel=2)
            continue
        q_name = g.add_const(node.input[2] + "_int32", q.astype(np.int32))
        s_name = g.add_const(node.input[2] + "_scale", scale)
        z_name = g.add_const(node.input[2] + "_zero", np.zeros(bias.shape, np.int32))
        out = g.unique(node.input[2] + "_dequantized")
        g.insert(node, _make_dq(q_name, s_name, z_name, out, node.name + "/bias_DequantizeLinear"))
        node.input[2] = out
        count += 1
    g.refresh()
    return count


def _make_dq(x: str, scale: str, zp: str, out: str, name: str) -> Any:
    from onnx import helper

    return helper.make_node("DequantizeLinear", [x, scale, zp], [out], name=name, axis=0)


# ------------------------------------------------------------------------------- 6. duplicates
def _same_params(g: GraphIndex, a: Any, b: Any) -> bool:
    for i in (1, 2):
        x, y = g.array(a.input[i]), g.array(b.input[i])
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
    return x.ndim == 0 or _attr(a, "axis", 1) == _attr(b, "axis", 1)


def _merge_duplicate_pairs(g: GraphIndex) -> int:
    """Equal Q/DQ pairs reading the same tensor: keep the first."""
    by_input: dict[str, list[tuple[Any, list[Any]]]] = defaultdict(list)
    for q, dqs in _qdq_pairs(g):
        if len(dqs) == 1:
            by_input[q.input[0]].append((q, dqs))
    doomed: list[Any] = []
    for pairs in by_input.values():
        keep_q, keep_dqs = pairs[0]
        for q, dqs in pairs[1:]:
            if _same_params(g, keep_q, q) and dqs[0].output[0] not in g.outputs:
                g.rewire(dqs[0].output[0], keep_dqs[0].output[0])
                for kept in (keep_q, keep_dqs[0]):
                    add_quantizer_names(kept, quantizer_names(q))
                doomed += [q, dqs[0]]
    g.remove(doomed)
    return len(doomed) // 2


def _remove_requantization(g: GraphIndex) -> int:
    """``DQ -> Q`` with equal parameters returns the DQ's input: drop the Q (and the DQ if unused)."""
    doomed: list[Any] = []
    for q in list(g.graph.node):
        dq = g.producer.get(q.input[0]) if q.op_type == "QuantizeLinear" else None
        if dq is None or dq.op_type != "DequantizeLinear" or q.output[0] in g.outputs:
            continue
        if not _same_params(g, dq, q):
            continue
        g.rewire(q.output[0], dq.input[0])
        doomed.append(q)
        if len(g.consumers.get(dq.output[0], [])) == 1 and dq.output[0] not in g.outputs:
            doomed.append(dq)
    g.remove(doomed)
    return len(doomed)


# ---------------------------------------------------------------------- 7. global average pooling
def _ranks(g: GraphIndex) -> dict[str, int]:
    """Rank of each tensor whose type the graph records (inputs, outputs, value_info)."""
    ranks = {}
    for value in (*g.graph.input, *g.graph.output, *g.graph.value_info):
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape"):
            ranks[value.name] = len(tensor_type.shape.dim)
    return ranks


def _reduce_axes(g: GraphIndex, node: Any) -> list[int] | None:
    """The constant axes of a ReduceMean (input from opset 18, attribute before); None when unknown."""
    axes = g.const_input(node, 1) if len(node.input) > 1 else _attr(node, "axes")
    return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]


def _is_spatial_mean(g: GraphIndex, node: Any, ranks: dict[str, int]) -> bool:
    """A ReduceMean over every spatial axis (2 to rank - 1) that keeps the reduced axes."""
    rank = ranks.get(node.input[0]) if node.op_type == "ReduceMean" else None
    axes = _reduce_axes(g, node) if rank is not None and rank >= 3 else None
    if axes is None or _attr(node, "keepdims", 1) != 1:
        return False
    return sorted(a % rank for a in axes) == list(range(2, rank))  # type: ignore[operator]


def _global_pools(g: GraphIndex) -> int:
    """``ReduceMean(x, spatial axes, keepdims=1)`` becomes ``GlobalAveragePool(x)``."""
    ranks = _ranks(g)
    count = 0
    for node in g.graph.node:
        if not _is_spatial_mean(g, node, ranks):
            continue
        node.op_type = "GlobalAveragePool"
        del node.input[1:]
        del node.attribute[:]
        count += 1
    g.refresh()
    return count


def _flatten_pools(g: GraphIndex) -> int:
    """``Flatten(axis=1)`` of a ``GlobalAveragePool`` becomes ``Reshape(x, [0, -1])``, which ORT moves its
    Q/DQ across (it does not look through Flatten, and the pool would stay float)."""
    count = 0
    for node in g.graph.node:
        source = g.producer.get(node.input[0]) if node.op_type == "Flatten" else None
        if source is None or source.op_type != "GlobalAveragePool" or _attr(node, "axis", 1) != 1:
            continue
        node.op_type = "Reshape"
        del node.attribute[:]
        node.input.append(g.add_const(node.name or "flatten", np.array([0, -1], np.int64)))
        count += 1
    g.refresh()
    return count


# ------------------------------------------------------------------------------- 8. dense layers
def _inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every tensor ONNX shape inference can tell (on a copy; the model keeps its value_info)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return {}
    return _ranks(GraphIndex(inferred))


def _dense_weight(g: GraphIndex, matmul: Any) -> tuple[Any, np.ndarray] | None:
    """The DQ of a 2-D int8 constant ``[K, N]`` read only by ``matmul`` (per tensor or per column N), and it."""
    dq = g.producer.get(matmul.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or g.single_reader(dq.output[0]) is not matmul:
        return None
    w, scale = g.const_input(dq, 0), g.const_input(dq, 1)
    if w is None or scale is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8):
        return None
    if scale.ndim == 1 and _attr(dq, "axis", 1) % 2 != 1:
        return None
    return dq, w


def _bias_add(g: GraphIndex, matmul: Any, columns: int) -> tuple[Any, str] | None:
    """The ``Add`` of a constant ``[N]`` bias that alone reads ``matmul``'s output, and the bias's name."""
    add = g.single_reader(matmul.output[0])
    if add is None or add.op_type != "Add":
        return None
    other = [name for name in add.input if name != matmul.output[0]]
    bias = g.array(other[0]) if len(other) == 1 else None
    return (add, other[0]) if bias is not None and bias.shape == (columns,) else None


def _matmuls_to_gemm(model: onnx.ModelProto, g: GraphIndex) -> int:
    """``MatMul(x, DQ(W [K, N])) [+ bias]`` with a 2-D ``x`` becomes ``Gemm(x, DQ(W.T), bias, transB=1)``.

    The same product, written as ORT's QGemm pattern (Keras Dense layers export as MatMul + Add; QGemm takes
    a float output where no Q follows, like the classifier). The transposed weight keeps its integers, and its
    per-column scales move to axis 0.
    """
    from onnx import helper

    matmuls = [n for n in g.graph.node if n.op_type == "MatMul"]
    ranks = _inferred_ranks(model) if matmuls else {}
    done = []
    for matmul in matmuls:
        found = _dense_weight(g, matmul) if ranks.get(matmul.input[0]) == 2 else None
        if found is None:
            continue
        dq, w = found
        dq.input[0] = g.add_const(dq.input[0] + "_transposed", np.ascontiguousarray(w.T))
        if g.array(dq.input[1]).ndim == 1:  # type: ignore[union-attr]
            _set_axis(dq, 0)
        inputs, output = [matmul.input[0], dq.output[0]], matmul.output[0]
        bias = _bias_add(g, matmul, w.shape[1])
        if bias is not None:
            inputs.append(bias[1])
            output = bias[0].output[0]
            done.append(bias[0])
        gemm = helper.make_node("Gemm", inputs, [output], name=(matmul.name or "matmul") + "/Gemm", transB=1)
        g.insert(matmul, gemm)
        done.append(matmul)
    g.remove(done)
    return len(done) - sum(n.op_type == "Add" for n in done)


# ------------------------------------------------------------ 9. weights on CPUs whose int8 dot saturates
#: the ``weights`` option of :func:`rewrite_for_onnxruntime`
WEIGHT_ENCODINGS = ("auto", "int8", "uint8")
#: ops whose constant input ORT multiplies as an int8 weight (QLinearConv, QGemm, QLinearMatMul)
_WEIGHT_READERS = frozenset({"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"})


def _as_uint8(values: np.ndarray) -> np.ndarray:
    """int8 -> uint8 with the zero point moved by 128: ``q_u8 - zp_u8 == q_s8 - zp_s8`` for every value."""
    return (values.astype(np.int16) + 128).astype(np.uint8)


def _weight_reader_only(g: GraphIndex, dq: Any) -> bool:
    readers = g.consumers.get(dq.output[0], [])
    return bool(readers) and dq.output[0] not in g.outputs and all(r.op_type in _WEIGHT_READERS for r in readers)


def _int8_zero_point(g: GraphIndex, node: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """The node's int8 zero point (an omitted one is 0), or None when it is not a constant int8."""
    if len(node.input) < 3 or not node.input[2]:
        return np.zeros(shape, np.int8)
    zp = g.const_input(node, 2)
    return zp if zp is not None and zp.dtype == np.int8 else None


def _set_zero_point(node: Any, name: str) -> None:
    while len(node.input) < 3:
        node.input.append("")
    node.input[2] = name


def _stored_weights(g: GraphIndex, dq: Any) -> tuple[np.ndarray, Any | None] | None:
    """The int8 integers a weight DQ reads, and the QuantizeLinear making them (None: a stored initializer)."""
    values = g.const_input(dq, 0)
    if values is not None:
        return (values, None) if values.dtype == np.int8 else None
    q = g.producer.get(dq.input[0])
    w, scale = (g.const_input(q, 0), g.const_input(q, 1)) if q is not None and q.op_type == "QuantizeLinear" else (
        None, None)  # fmt: skip
    zp = _int8_zero_point(g, q, np.shape(scale)) if w is not None and scale is not None else None
    if zp is None or np.any(zp != 0) or len(g.consumers.get(q.output[0], [])) != 1:
        return None
    return _quantize_weight(w, scale, np.dtype(np.int8), _attr(q, "axis", 1)), q


def encode_weights_uint8(model: onnx.ModelProto, *, only_saturating: bool = True) -> int:
    """Re-encode the int8 weights of Conv / Gemm / MatMul as uint8 with zero point + 128, in place.

    The dequantized weights are bit for bit the same; ONNX Runtime then runs its U8U8 kernels, which never
    saturate, instead of the U8S8 ones, which saturate on x86 CPUs without VNNI (:mod:`qdq.cpu`). With
    ``only_saturating`` (default) a weight whose integers all lie in ``[-64, 64]`` stays int8 (it cannot
    saturate, and U8S8 is faster): 4-bit weights, for example. Handles stored int8 initializers
    (``int8 -> DQ``, the onnxruntime target) and ``Q(float weight) -> DQ`` (the tensorrt target).

    Returns:
        The number of weights re-encoded.
    """
    from qdq.cpu import SAFE_WEIGHT_MAGNITUDE

    tidy(model)  # constants behind Identity nodes (TorchScript's shared zero points) become visible
    g = GraphIndex(model)
    count, retyped = 0, set()
    for dq in list(g.graph.node):
        if dq.op_type != "DequantizeLinear" or not _weight_reader_only(g, dq):
            continue
        found = _stored_weights(g, dq)
        zp = _int8_zero_point(g, dq, np.shape(g.const_input(dq, 1))) if found is not None else None
        if found is None or zp is None:
            continue
        values, q = found
        if only_saturating and np.abs(values.astype(np.int16)).max(initial=0) <= SAFE_WEIGHT_MAGNITUDE:
            continue
        zp_name = g.add_const((dq.input[2] or "zero_point") + "_u8w", _as_uint8(zp))
        if q is None:
            dq.input[0] = g.add_const(dq.input[0] + "_u8", _as_uint8(values))
        else:
            _set_zero_point(q, zp_name)
            retyped.add(q.output[0])
        _set_zero_point(dq, zp_name)
        count += 1
    kept = [v for v in g.graph.value_info if v.name not in retyped]  # recorded as int8
    del g.graph.value_info[:]
    g.graph.value_info.extend(kept)
    tidy(model)
    return count


def _resolve_weights(weights: str) -> str:
    if weights not in WEIGHT_ENCODINGS:
        raise QdqConfigError(
            f"weights must be one of {WEIGHT_ENCODINGS}, got {weights!r}: 'int8' for the fastest kernels on CPUs "
            "with VNNI (and ARM), 'uint8' for exact results on every CPU, 'auto' for whichever this CPU needs."
        )
    if weights == "auto":
        from qdq.cpu import int8_dot_saturates

        return "uint8" if int8_dot_saturates() else "int8"
    return weights


def unfusable_convs(model: onnx.ModelProto) -> list[str]:
    """Convs ONNX Runtime cannot run as ``QLinearConv``: an input or the weight is not dequantized, or the
    output is not read by exactly one QuantizeLinear (through at most one activation ORT folds, Relu/Clip,
    which it removes only when the Q's zero point is the type's minimum, i.e. uint8 with zero point 0)."""
    return [conv.name for conv in _unfusable_conv_nodes(GraphIndex(model))]


def _clamped_before_q(g: GraphIndex, conv: Any) -> bool:
    """Does the Conv's output reach a QuantizeLinear through a clamp (Clip/Min/Max, after at most its bias Add
    and a Relu)?
    That is how a sub-8-bit quantizer is exported (``mode.py``)."""
    node = g.single_reader(conv.output[0])
    if node is not None and node.op_type == "Add" and g.array(node.input[1]) is not None:  # its bias, moved
        node = g.single_reader(node.output[0])
    if node is not None and node.op_type == "Relu":
        node = g.single_reader(node.output[0])
    seen_clamp = False
    while node is not None and node.op_type in ("Clip", "Min", "Max"):
        seen_clamp = True
        node = g.single_reader(node.output[0])
    return seen_clamp and node is not None and node.op_type == "QuantizeLinear"


def _unfusable_conv_nodes(g: GraphIndex) -> list[Any]:
    fusion = _fusion()
    nodes = []
    for conv in g.graph.node:
        if conv.op_type != "Conv":
            continue
        data = fusion.dequantized_inputs(conv.op_type, len(conv.input))
        inputs_ok = all(_dq_params(g, conv.input[i]) is not None for i in data)
        out = g.single_reader(conv.output[0])
        through_activation = out is not None and out.op_type in fusion.folded_activations
        if through_activation:
            out = g.single_reader(out.output[0])
        fused = inputs_ok and out is not None and out.op_type == "QuantizeLinear"
        if fused and through_activation:  # ORT drops a Relu/Clip only before a Q whose zero point is the minimum
            zp = g.array(out.input[2])
            fused = zp is not None and np.all(zp == np.iinfo(zp.dtype).min)
        if not fused:
            nodes.append(conv)
    return nodes


def rewrite_for_onnxruntime(model: onnx.ModelProto, *, weights: str = "auto") -> dict[str, int]:
    """Rewrite ``model`` in place for ONNX Runtime's int8 kernels (see the module doc).

    Args:
        model: the exported Q/DQ graph.
        weights: how weights are stored (step 9): ``"int8"`` (U8S8 kernels: the fastest on CPUs with VNNI
            and on ARM, saturating on other x86 CPUs), ``"uint8"`` (U8U8: exact on every CPU), or ``"auto"``
            (default): ``"uint8"`` when the CPU doing the export saturates (:func:`qdq.cpu.int8_dot_saturates`).
            The choice is recorded as model metadata ``qdq.ort_weights``; :mod:`qdq.runtime` re-encodes an
            int8 file in memory when it runs on a CPU that saturates.

    Returns:
        How many of each rewrite were made: ``pools``, ``weights``, ``gemms``, ``batchnorms``, ``bias_adds``,
        ``masks``, ``uint8``, ``biases``, ``duplicates``, ``requantizations``, ``float_biases``,
        ``uint8_weights``; and ``float_convs``, the Convs ORT cannot fuse (warned).
    """
    encoding = _resolve_weights(weights)
    tidy(model)
    g = GraphIndex(model)
    counts = {
        "pools": _global_pools(g) + _flatten_pools(g),
        "weights": _fold_weight_quantizers(g),
        "gemms": _matmuls_to_gemm(model, g),
        "batchnorms": _fold_batchnorms(g),
        "bias_adds": _fold_bias_adds(g),
        "masks": _fold_zero_masks(g) + _drop_masks_of_zeros(g),
        "duplicates": _merge_duplicate_pairs(g),
        "uint8": _activations_to_uint8(g),
    }
    counts["requantizations"] = _remove_requantization(g)
    float_convs = _unfusable_conv_nodes(g)
    counts["float_biases"] = _bias_after_float_convs(g, float_convs)
    counts["biases"] = _quantize_biases(g, float_convs)
    tidy(model)
    g = GraphIndex(model)
    left = _unfusable_conv_nodes(g)
    counts["float_convs"] = len(left)
    if left:
        is_clamped = [_clamped_before_q(g, conv) for conv in left]
        clamped = [conv.name for conv, c in zip(left, is_clamped, strict=True) if c]
        unquantized = [conv.name for conv, c in zip(left, is_clamped, strict=True) if not c]
        if clamped:
            warnings.warn(
                f"{len(clamped)} Conv(s) will run in float on ONNX Runtime (e.g. {clamped[0]}): their output is "
                "clamped to a sub-8-bit range before its QuantizeLinear, and ORT has no kernel for sub-8-bit "
                "activations. The numbers are those of the quantized model; only the int8 speed-up is lost.",
                stacklevel=3,
            )
        if unquantized:
            warnings.warn(
                f"{len(unquantized)} Conv(s) will run in float on ONNX Runtime (e.g. {unquantized[0]}): their "
                "output has no quantizer (or their input/weight none). Quantize the model for this target before "
                "calibrating to run every Conv in int8: model = qdq.quantize_model(model, "
                "qdq.QuantConfig(target='onnxruntime')), or for Keras qdq.keras.quantize_model(model, "
                "target='onnxruntime').",
                stacklevel=3,
            )
    counts["uint8_weights"] = encode_weights_uint8(model) if encoding == "uint8" else 0
    set_metadata(model, WEIGHTS_METADATA_KEY, encoding)
    del model.graph.value_info[:]  # stale types (int8 -> uint8); ONNX Runtime infers them again
    return counts

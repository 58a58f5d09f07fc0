"""Rewrite of a qdq Q/DQ graph so that ONNX Runtime's CPU provider runs its Convs as int8 kernels.

ORT replaces ``DQ(x) + DQ(w) [+ DQ(bias)] -> Conv -> Q`` by ``QLinearConv`` (and similar groups by
``QGemm``, ``QLinearAdd``...). The TensorRT-style graph does not have that form. The rewrite keeps every
quantized value of the model and changes only the encoding:

1. **Weights** ``Q(W) -> DQ`` become an int8 initializer ``-> DQ`` (the integers ORT would compute).
2. **BatchNorm after a Conv** is folded into it: the per-output-channel BN factor ``k = gamma / sqrt(var +
   eps)`` multiplies the weight *scale* (the int8 weights are unchanged; negated where ``k < 0``), and the
   bias becomes ``(b - mean) * k + beta``. This is what TensorRT does internally; it is exact up to float32
   rounding of ``scale * k`` (one ulp), not bit for bit.
3. **Signed activations** int8 with zero point 0 become uint8 with zero point 128 and the same scale: the
   same grid, bit-identical dequantized values. (ORT's x86 kernels take uint8 activations; its own s8->u8
   rewrite covers only some pairs and leaves Convs unfused.) Unsigned activations (uint8, zero point 0, from
   ``placement``'s ``unsigned_activations`` rule) are kept: ORT then drops the ReLU / ReLU6 before them.
4. **Conv / Gemm bias** becomes int32 with scale ``s_x * s_w`` (per output channel) behind a DQ, as ORT's
   ``QLinearConv`` requires: the bias moves by at most ``s_x * s_w / 2``, far below an output step.
5. **Duplicates**: several equal Q/DQ pairs on one tensor become one, and ``DQ -> Q`` with equal parameters
   (a re-quantization that changes nothing) is removed. Both are exact.

Only the top-level graph is rewritten.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.export.graph import add_quantizer_names, consumers, initializer_map, quantizer_names, tidy

if TYPE_CHECKING:
    import onnx

__all__ = ["rewrite_for_onnxruntime", "unfusable_convs"]

_INT32_LIMIT = 2**31 - 1


class _Graph:
    """Small mutable view of an ONNX graph: constants, producers, consumers, node removal."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.refresh()
        self._counter = 0

    def refresh(self) -> None:
        self.consts = initializer_map(self.model)
        self.users = consumers(self.model)
        self.producer = {out: node for node in self.graph.node for out in node.output}
        self.outputs = {v.name for v in self.graph.output}

    def array(self, name: str) -> np.ndarray | None:
        from onnx import numpy_helper

        proto = self.consts.get(name)
        return None if proto is None else numpy_helper.to_array(proto)

    def unique(self, stem: str) -> str:
        """A new tensor name."""
        self._counter += 1
        return f"{stem}__ort{self._counter}"

    def add_const(self, stem: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.unique(stem)
        tensor = numpy_helper.from_array(np.array(value, copy=True, order="C"), name)
        self.graph.initializer.append(tensor)
        self.consts[name] = tensor
        return name

    def remove(self, nodes: list[Any]) -> None:
        doomed = {id(n) for n in nodes}
        keep = [n for n in self.graph.node if id(n) not in doomed]
        del self.graph.node[:]
        self.graph.node.extend(keep)
        self.refresh()

    def rewire(self, old: str, new: str) -> None:
        """Make every reader of tensor ``old`` read ``new``."""
        for node in self.users.get(old, []):
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new


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


def _quantize_np(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> np.ndarray:
    """ONNX QuantizeLinear in numpy: ``saturate(round_half_even(x / scale) + zp)`` in float32."""
    if scale.ndim == 1 and axis is not None:
        shape = [1] * x.ndim
        shape[axis] = scale.size
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    info = np.iinfo(zp.dtype)
    q = np.rint(x.astype(np.float32) / scale.astype(np.float32)) + zp.astype(np.float32)
    return np.clip(q, info.min, info.max).astype(zp.dtype)


# ------------------------------------------------------------------------------------- 1. weights
def _fold_weight_quantizers(g: _Graph) -> int:
    """``Q(initializer) -> DQ`` becomes ``int8 initializer -> DQ``."""
    done = []
    for q in list(g.graph.node):
        if q.op_type != "QuantizeLinear":
            continue
        w, scale, zp = g.array(q.input[0]), g.array(q.input[1]), g.array(q.input[2])
        if w is None or scale is None or zp is None or q.output[0] in g.outputs:
            continue
        name = g.add_const(q.input[0] + "_quantized", _quantize_np(w, scale, zp, _attr(q, "axis", 1)))
        g.rewire(q.output[0], name)
        done.append(q)
    g.remove(done)
    return len(done)


# ----------------------------------------------------------------------------------- 2. BatchNorm
def _single_user(g: _Graph, tensor: str) -> Any | None:
    users = g.users.get(tensor, [])
    return users[0] if len(users) == 1 and tensor not in g.outputs else None


def _weight_dq(g: _Graph, conv: Any) -> Any | None:
    dq = g.producer.get(conv.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or g.array(dq.input[0]) is None:
        return None
    return dq if _single_user(g, dq.output[0]) is conv else None


def _bn_factor(g: _Graph, bn: Any) -> tuple[np.ndarray, np.ndarray] | None:
    arrays = [g.array(name) for name in bn.input[1:5]]
    if any(a is None for a in arrays) or len(bn.output) != 1:
        return None
    gamma, beta, mean, var = (a.astype(np.float64) for a in arrays)  # type: ignore[union-attr]
    k = gamma / np.sqrt(var + float(_attr(bn, "epsilon", 1e-5)))
    return k, beta - mean * k


def _fold_bn(g: _Graph, conv: Any, bn: Any, dq: Any) -> bool:
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
    new_scale = (np.broadcast_to(scale.astype(np.float64), (channels,)) * np.abs(k)).astype(np.float32)
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


def _fold_batchnorms(g: _Graph) -> int:
    """Fold ``Conv -> BatchNormalization`` when the Conv's weight is a dequantized int8 initializer."""
    done = []
    for conv in list(g.graph.node):
        if conv.op_type != "Conv":
            continue
        bn = _single_user(g, conv.output[0])
        dq = _weight_dq(g, conv)
        if bn is None or bn.op_type != "BatchNormalization" or dq is None:
            continue
        if _fold_bn(g, conv, bn, dq):
            done.append(bn)
    g.remove(done)
    return len(done)


# ------------------------------------------------------------------------ 3. uint8 activations
def _qdq_pairs(g: _Graph) -> Iterator[tuple[Any, list[Any]]]:
    for q in g.graph.node:
        if q.op_type == "QuantizeLinear":
            dqs = [u for u in g.users.get(q.output[0], []) if u.op_type == "DequantizeLinear"]
            if dqs and len(dqs) == len(g.users.get(q.output[0], [])):
                yield q, dqs


def _activations_to_uint8(g: _Graph) -> int:
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


# --------------------------------------------------------------------------------- 4. int32 bias
def _dq_params(g: _Graph, tensor: str) -> tuple[np.ndarray, int | None] | None:
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale = g.array(dq.input[1])
    return None if scale is None else (scale, _attr(dq, "axis", 1))


def _bias_scale(g: _Graph, node: Any) -> np.ndarray | None:
    """``s_x * s_w`` per output channel, when input and weight are dequantized and the weight axis is 0."""
    x, w = _dq_params(g, node.input[0]), _dq_params(g, node.input[1])
    if x is None or w is None or x[0].ndim != 0:
        return None
    if node.op_type == "Gemm" and (_attr(node, "transB", 0) != 1 or _attr(node, "transA", 0) != 0):
        return None
    if w[0].ndim == 1 and w[1] != 0:
        return None
    return (x[0].astype(np.float32) * w[0].astype(np.float32)).astype(np.float32)


def _quantize_biases(g: _Graph) -> int:
    count = 0
    for node in list(g.graph.node):
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3 or not node.input[2]:
            continue
        bias = g.array(node.input[2])
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
        _insert_before(g, node, _make_dq(q_name, s_name, z_name, out, node.name + "/bias_DequantizeLinear"))
        node.input[2] = out
        count += 1
    g.refresh()
    return count


def _make_dq(x: str, scale: str, zp: str, out: str, name: str) -> Any:
    from onnx import helper

    return helper.make_node("DequantizeLinear", [x, scale, zp], [out], name=name, axis=0)


def _insert_before(g: _Graph, anchor: Any, node: Any) -> None:
    nodes = list(g.graph.node)
    index = next(i for i, n in enumerate(nodes) if n is anchor)
    g.graph.node.insert(index, node)


# ------------------------------------------------------------------------------- 5. duplicates
def _same_params(g: _Graph, a: Any, b: Any) -> bool:
    for i in (1, 2):
        x, y = g.array(a.input[i]), g.array(b.input[i])
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
    return x.ndim == 0 or _attr(a, "axis", 1) == _attr(b, "axis", 1)


def _merge_duplicate_pairs(g: _Graph) -> int:
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


def _remove_requantization(g: _Graph) -> int:
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
        if len(g.users.get(dq.output[0], [])) == 1 and dq.output[0] not in g.outputs:
            doomed.append(dq)
    g.remove(doomed)
    return len(doomed)


_FUSED_ACTIVATIONS = ("Relu", "Clip")


def unfusable_convs(model: onnx.ModelProto) -> list[str]:
    """Convs ONNX Runtime cannot run as ``QLinearConv``: an input or the weight is not dequantized, or the
    output is not read by exactly one QuantizeLinear (through at most one Relu/Clip, which ORT removes only
    when the Q's zero point is the type's minimum, i.e. uint8 with zero point 0)."""
    g = _Graph(model)
    names = []
    for conv in g.graph.node:
        if conv.op_type != "Conv":
            continue
        inputs_ok = all(_dq_params(g, name) is not None for name in conv.input[:2])
        out = _single_user(g, conv.output[0])
        through_activation = out is not None and out.op_type in _FUSED_ACTIVATIONS
        if through_activation:
            out = _single_user(g, out.output[0])
        fused = inputs_ok and out is not None and out.op_type == "QuantizeLinear"
        if fused and through_activation:  # ORT drops a Relu/Clip only before a Q whose zero point is the minimum
            zp = g.array(out.input[2])
            fused = zp is not None and np.all(zp == np.iinfo(zp.dtype).min)
        if not fused:
            names.append(conv.name)
    return names


def rewrite_for_onnxruntime(model: onnx.ModelProto) -> dict[str, int]:
    """Rewrite ``model`` in place for ONNX Runtime's int8 kernels (see the module doc).

    Returns:
        How many of each rewrite were made: ``weights``, ``batchnorms``, ``uint8``, ``biases``,
        ``duplicates``, ``requantizations``; and ``float_convs``, the Convs ORT cannot fuse (warned).
    """
    tidy(model)
    g = _Graph(model)
    counts = {
        "weights": _fold_weight_quantizers(g),
        "batchnorms": _fold_batchnorms(g),
        "duplicates": _merge_duplicate_pairs(g),
        "uint8": _activations_to_uint8(g),
    }
    counts["requantizations"] = _remove_requantization(g)
    counts["biases"] = _quantize_biases(g)
    tidy(model)
    left = unfusable_convs(model)
    counts["float_convs"] = len(left)
    if left:
        warnings.warn(
            f"{len(left)} Conv(s) will run in float on ONNX Runtime (e.g. {left[0]}): their output has no "
            "quantizer (or their input/weight none). Quantize the model with qdq.placement.apply_placement("
            "model, target='onnxruntime') before calibrating to run every Conv in int8.",
            stacklevel=3,
        )
    del model.graph.value_info[:]  # stale types (int8 -> uint8); ONNX Runtime infers them again
    return counts

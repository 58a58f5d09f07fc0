"""The one torch operator qdq exports as ONNX ``QuantizeLinear -> DequantizeLinear``.

``torch.ops.qdq.fake_qdq(x, scale, zero_point, axis, tag)`` is a custom operator (``torch.library``) used only
while exporting. Both exporters turn it into exactly one Q/DQ pair with the constants it is given:

* the dynamo exporter through a translation function passed in ``custom_translation_table``;
* the TorchScript exporter through a symbolic registered for the ``qdq::fake_qdq`` domain.

``axis`` is the (non-negative) channel axis of a per-channel ``scale`` of shape ``[C]``, or -1 for a
per-tensor (0-d) ``scale``; ``zero_point`` has ``scale``'s shape and the quantized dtype (int8/uint8), and
is zero (qdq quantizes symmetrically; its dtype picks the integer grid).
``tag`` is the quantizer's module name. The dynamo translation stores it as node metadata
(``qdq.quantizer``) on the Q and DQ nodes; the TorchScript symbolic cannot, so it appends a marker node
``qdq::QuantizerTag`` that :func:`qdq.export.annotate_quantizers` turns into the same metadata and
removes. Exporters name nodes after module scopes, which do not identify the quantizer reliably (a
``GraphModule`` calls leaf modules directly), hence the explicit tag.

Why not ``torch.fake_quantize_per_tensor_affine``: under ``torch.export`` it decomposes into
``fake_quantize_per_tensor_affine_cachemask``, which has no fake-tensor kernel in torch 2.14, so the dynamo
exporter fails on it; and it refuses narrow ranges. The custom op takes ONNX's own parameters (float32
``scale`` = the quantization step, ``zero_point`` of the integer type, ``axis``), so the exported graph is
exactly what qdq computes in PyTorch, with no Clip or Cast added by an exporter.

Everything here is registered lazily, on the first export, by :func:`ensure_registered`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from qdq.graphs.onnx_tags import QUANTIZER_KEY as TAG_KEY
from qdq.graphs.onnx_tags import TAG_DOMAIN, TAG_OP
from qdq.ops import round_to_grid

__all__ = [
    "TAG_DOMAIN",
    "TAG_KEY",
    "TAG_OP",
    "dynamo_translation_table",
    "ensure_registered",
    "fake_qdq",
    "register_torchscript_symbolic",
]

_OP_NAME = "qdq::fake_qdq"


def _fake_qdq_eager(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """``DequantizeLinear(QuantizeLinear(x))`` with zero point 0 (ONNX semantics, float32), in ``x``'s dtype.

    The grid is the whole range of ``zero_point``'s dtype (``[-128, 127]`` for int8, ``[0, 255]`` for uint8).
    """
    info = torch.iinfo(zero_point.dtype)
    if axis >= 0:
        shape = [1] * x.dim()
        shape[axis] = scale.numel()
        scale = scale.view(shape)
    return (round_to_grid(x, scale, info.min, info.max) * scale).to(x.dtype)


@functools.cache
def ensure_registered() -> Callable[..., torch.Tensor]:
    """Define ``torch.ops.qdq.fake_qdq`` once per process and return it."""

    @torch.library.custom_op(_OP_NAME, mutates_args=())
    def fake_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, tag: str) -> torch.Tensor:
        return _fake_qdq_eager(x, scale, zero_point, axis)

    @fake_qdq.register_fake
    def _(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, tag: str) -> torch.Tensor:
        return torch.empty_like(x)

    return torch.ops.qdq.fake_qdq.default


def fake_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, tag: str) -> torch.Tensor:
    """Call the export operator (registering it on first use)."""
    return ensure_registered()(x, scale, zero_point, axis, tag)


def _translate(x: Any, scale: Any, zero_point: Any, axis: int, tag: str) -> Any:
    """Dynamo translation: one QuantizeLinear and one DequantizeLinear sharing scale and zero point."""
    from onnxscript import opset18 as op

    kwargs = {"axis": axis} if axis >= 0 else {}
    q = op.QuantizeLinear(x, scale, zero_point, **kwargs)
    dq = op.DequantizeLinear(q, scale, zero_point, **kwargs)
    for value in (q, dq):
        value.producer().metadata_props[TAG_KEY] = tag  # type: ignore[union-attr]  # traced: an ir.Value, not FLOAT
    return dq


def dynamo_translation_table() -> dict[Any, Any]:
    """``custom_translation_table`` argument of ``torch.onnx.export(dynamo=True)``."""
    return {ensure_registered(): _translate}


def _symbolic(g: Any, x: Any, scale: Any, zero_point: Any, axis: Any, tag: Any) -> Any:
    from torch.onnx import symbolic_helper

    axis_value = int(symbolic_helper._maybe_get_const(axis, "i"))
    kwargs = {"axis_i": axis_value} if axis_value >= 0 else {}
    q = g.op("QuantizeLinear", x, scale, zero_point, **kwargs)
    dq = g.op("DequantizeLinear", q, scale, zero_point, **kwargs)
    marked = g.op(TAG_OP, dq, quantizer_s=str(symbolic_helper._maybe_get_const(tag, "s")))
    marked.setType(x.type())
    return marked


@functools.cache
def register_torchscript_symbolic() -> None:
    """Register the TorchScript-exporter symbolic of ``qdq::fake_qdq`` (once per process, opset >= 10)."""
    ensure_registered()
    torch.onnx.register_custom_op_symbolic(_OP_NAME, _symbolic, 10)

"""Bias correction: each quantized layer's bias absorbs the mean error its own quantization adds.

Quantizing a layer's input and weights shifts the mean of its output a little per channel (rounding is not zero
mean once clipped, an int8 weight grid sums to a slightly different gain); a deep network adds those shifts up.
For each Conv, Gemm, and MatMul whose product goes into an ``Add`` of a 1-D constant (a linear layer), with its
input and weights quantized, this module measures on calibration batches, in the *float* model::

    shift[c] = mean over batch and positions of ( layer(Q(x), Q(W))[c] - layer(x, W)[c] )

where ``Q`` is qdq's fake quantization (:func:`qdq.tensor_quant.fake_tensor_quant`) on the grid the file will
hold (the activation's range and grid, the weight's per-channel range), and subtracts ``shift`` from the layer's
bias. Each layer is corrected in isolation on the float model's input (the layer's own error, as NNCF's fast bias
correction does): correcting every layer at once on the quantized model's inputs would count an upstream shift
again in each layer below it. The layers are computed in float32 with PyTorch (the means summed in float64); a
layer that ONNX pads asymmetrically is padded first.

Used by :func:`qdq.onnx_in.quantize.quantize_onnx` (``bias_correction=True``).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from qdq.graphs.view import GraphView, Op
from qdq.onnx_in.calibrate import ort_session, probe_model
from qdq.onnx_in.view import weight_axis
from qdq.tensor_quant import fake_tensor_quant
from qdq.workflow.progress import Progress, counter

__all__ = ["BiasShift", "correct_biases"]

_CONV_FUNCTIONS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the weight's rank


@dataclass(frozen=True)
class BiasShift:
    """One corrected bias: the op, its bias tensor, the shift subtracted (float32, per output channel) and the
    shift relative to the spread of the layer's float output (``|shift| / std``, the largest over channels)."""

    op: str
    bias: str
    shift: np.ndarray
    relative: float


@dataclass
class _Layer:
    op: Op
    input: str
    bias: str
    weight: torch.Tensor
    weight_q: torch.Tensor
    input_amax: torch.Tensor
    unsigned: bool
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    channel_axis: int
    error_sum: torch.Tensor | None = None
    output_sum: torch.Tensor | None = None
    output_squares: torch.Tensor | None = None
    count: int = 0

    def observe(self, x: torch.Tensor) -> None:
        reference = self.apply(x, self.weight)
        x_q = fake_tensor_quant(x, self.input_amax, 8, self.unsigned)
        error = self.apply(x_q, self.weight_q).sub_(reference).double()
        reference = reference.double()
        axes = [a for a in range(reference.ndim) if a != self.channel_axis % reference.ndim]
        sums = (error.sum(axes), reference.sum(axes), reference.square().sum(axes))
        if self.error_sum is None:
            self.error_sum, self.output_sum, self.output_squares = sums
        else:
            self.error_sum += sums[0]
            self.output_sum += sums[1]  # type: ignore[operator]
            self.output_squares += sums[2]  # type: ignore[operator]
        self.count += reference.numel() // reference.shape[self.channel_axis]

    def shift(self) -> tuple[np.ndarray, float]:
        assert self.error_sum is not None and self.output_sum is not None and self.output_squares is not None
        shift = self.error_sum / self.count
        mean = self.output_sum / self.count
        std = (self.output_squares / self.count - mean.square()).clamp(min=0).sqrt()
        relative = float((shift.abs() / std.clamp(min=1e-12)).max())
        return shift.numpy().astype(np.float32), relative


def correct_biases(
    model: onnx.ModelProto,
    view: GraphView,
    ranges: Mapping[int, np.ndarray],
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int | None = None,
    progress: Progress = True,
    known: Sequence[BiasShift] | None = None,
) -> list[BiasShift]:
    """Subtract from each quantized layer's bias (in ``model``'s initializers, in place) the mean output shift its
    input and weight quantization cause on ``batches``; returns the shifts applied.

    ``view`` is the placed view of ``model``, ``ranges`` every quantizer's amax by ``id`` (as
    :func:`qdq.onnx_in.materialize.write_qdq` takes them). A layer is left as it is when its bias is shared with
    another op or is not an initializer, or when its convolution pads with ``auto_pad``. ``known``: the shifts of
    an earlier call on the same file with the same ranges (a layer's shift depends only on its own input and
    weight ranges): each layer found there gets its shift again and nothing runs.
    """
    inits = {t.name: t for t in model.graph.initializer}
    uses = Counter(name for node in model.graph.node for name in node.input)
    layers = [layer for op in view.ops if (layer := _layer(model, view, ranges, op, inits)) is not None
              and uses[layer.bias] == 1]  # fmt: skip
    if known is not None:
        by_op = {shift.op: shift for shift in known}
        return [_subtract(by_op[layer.op.name], inits[layer.bias]) for layer in layers if layer.op.name in by_op]
    if not layers or not batches:
        return []
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    wanted = sorted({layer.input for layer in layers})
    bar = counter(progress, "bias correction", len(batches))
    with tempfile.TemporaryDirectory(prefix="qdq-bias-") as folder, torch.no_grad():
        session = ort_session(probe_model(model, wanted), Path(folder), threads)
        for batch in batches:
            outputs = dict(zip(wanted, session.run(wanted, {name: np.asarray(batch[name]) for name in inputs})))
            for layer in layers:
                layer.observe(torch.from_numpy(np.asarray(outputs[layer.input], np.float32)))
            bar.update()
    bar.close()
    return [_subtract(BiasShift(layer.op.name, layer.bias, *layer.shift()), inits[layer.bias]) for layer in layers]


def _subtract(shift: BiasShift, tensor: onnx.TensorProto) -> BiasShift:
    """``tensor`` (the bias initializer) minus ``shift``, in place; returns ``shift``."""
    bias = numpy_helper.to_array(tensor)
    corrected = (bias.astype(np.float64) - shift.shift.reshape(bias.shape)).astype(bias.dtype)
    tensor.CopyFrom(numpy_helper.from_array(corrected, tensor.name))
    return shift


def _layer(model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray], op: Op,
           inits: Mapping[str, onnx.TensorProto]) -> _Layer | None:  # fmt: skip
    """The layer to correct at ``op``, or None (not a quantized layer with its own bias)."""
    if op.type not in ("Conv", "Gemm", "MatMul") or not isinstance(op.ref, int) or len(op.inputs) < 2:
        return None
    activation, weight = view.quantizer_at(op, 0), view.quantizer_at(op, 1)
    if activation is None or weight is None or not weight.per_channel or op.inputs[1].name not in inits:
        return None
    node = model.graph.node[op.ref]
    found = _bias_and_function(view, op, node, inits)
    if found is None:
        return None
    bias, apply, channel_axis = found
    if bias not in inits:
        return None
    w = torch.from_numpy(numpy_helper.to_array(inits[op.inputs[1].name]).astype(np.float32))
    shape = [1] * w.ndim
    shape[weight_axis(op, 1) % w.ndim] = -1
    w_amax = torch.from_numpy(np.asarray(ranges[id(weight)], np.float32)).reshape(shape)
    return _Layer(op=op, input=op.inputs[0].name, bias=bias, weight=w, weight_q=fake_tensor_quant(w, w_amax),
                  input_amax=torch.from_numpy(np.asarray(ranges[id(activation)], np.float32)).reshape(()),
                  unsigned=activation.unsigned, apply=apply, channel_axis=channel_axis)  # fmt: skip


def _bias_and_function(view: GraphView, op: Op, node: onnx.NodeProto,
                       inits: Mapping[str, onnx.TensorProto]) -> tuple[str, Callable, int] | None:  # fmt: skip
    """``(bias initializer, layer(x, w) without its bias, channel axis of the output)`` for a supported layer."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op.type == "Conv":
        if len(node.input) < 3 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return None
        conv = _conv(attrs, len(inits[op.inputs[1].name].dims))
        return None if conv is None else (node.input[2], conv, 1)
    if op.type == "Gemm":
        if len(node.input) < 3 or attrs.get("transA", 0) or float(attrs.get("beta", 1.0)) != 1.0:
            return None
        trans_b = attrs.get("transB", 0)
        if float(attrs.get("alpha", 1.0)) != 1.0 or node.input[2] not in inits or len(inits[node.input[2]].dims) != 1:
            return None
        return node.input[2], lambda x, w: x @ (w.T if trans_b else w), -1
    add = view.single_reader(op.outputs[0])
    if add is None or add.type != "Add" or not isinstance(add.ref, int):
        return None
    other = next((v for v in add.inputs if v is not op.outputs[0]), None)
    if other is None or other.name not in inits or len(inits[other.name].dims) != 1:
        return None
    return other.name, lambda x, w: x @ w, -1


def _conv(attrs: Mapping[str, Any], rank: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    function = _CONV_FUNCTIONS.get(rank)
    if function is None:
        return None
    spatial = rank - 2
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    padding = [p for axis in reversed(range(spatial)) for p in (pads[axis], pads[axis + spatial])]
    strides, dilations = attrs.get("strides", [1] * spatial), attrs.get("dilations", [1] * spatial)
    groups = int(attrs.get("group", 1))

    def apply(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return function(F.pad(x, padding), w, None, strides, 0, dilations, groups)

    return apply

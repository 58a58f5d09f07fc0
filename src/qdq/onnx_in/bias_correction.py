"""Bias correction: each quantized layer's bias absorbs the mean error its own quantization adds.

Quantizing a layer's input and weights shifts the mean of its output a little per channel (rounding is not zero
mean once clipped, an int8 weight grid sums to a slightly different gain); a deep network adds those shifts up.
For each Conv, Gemm, and MatMul whose product goes into an ``Add`` of a 1-D constant (a linear layer), with its
input and weights quantized, in the main graph or inside an ``If`` branch (its input returned through the ``If``
for the probe; a batch that takes the other branch adds nothing), this module measures on calibration batches, in the
*float* model::

    shift[c] = mean over batch and positions of ( layer(Q(x), Q(W))[c] - layer(x, W)[c] )

where ``Q`` is qdq's fake quantization (:func:`qdq.tensor_quant.fake_tensor_quant`) on the grid the file will
hold (the activation's range and grid, the weight's per-channel range), and subtracts ``shift`` from the layer's
bias. Each layer is corrected in isolation on the float model's input (the layer's own error, as NNCF's fast bias
correction does): correcting every layer at once on the quantized model's inputs would count an upstream shift
again in each layer below it.

The layers are linear, so the mean of a layer's output over positions is the layer applied to the mean of the input
patches it reads: each batch adds up, per input channel and kernel position, the input (padded as ONNX pads it)
under every output position, once as is and once on its grid (float64 sums), and the shift is the quantized weights
applied to the quantized mean patch minus the float weights applied to the float mean patch. No layer is run on the
calibration batches (one float run on the first batch gives the output's spread the report states).

**Only measured shifts are applied.** The shift of a channel is a mean over samples (the items along the batch axis
of every batch), each sample's own mean error ``m_i``; its sampling error is ``SE = std(m_i) / sqrt(n)`` over the
``n`` samples. A channel's shift is applied when ``n >= 2`` and ``|shift| >= SIGNIFICANCE * SE`` (3 standard errors);
otherwise it is noise of the calibration set, not the layer's error, and that channel keeps its bias (counted in
``BiasShift.unmeasured``). An error that is the same on every sample (a channel reading a constant) has ``SE = 0``
and is measured exactly: it is applied. A channel whose float output does not vary on the first batch (its spread at
most ``CONSTANT_SPREAD`` times the layer's largest: a dead channel, zero weights or a dead input, only its bias left)
is listed in ``BiasShift.constant``: its shift has no spread to be relative to, so ``BiasShift.relative`` leaves it
out, and the report names such channels instead of dividing by zero.

Used by :func:`qdq.onnx_in.quantize.quantize_onnx` (``bias_correction=True``).
"""

from __future__ import annotations

import math
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

from qdq.graphs.onnx import all_nodes, feed_inputs
from qdq.graphs.onnx_session import ort_session, outputs_of, probe_model
from qdq.graphs.view import GraphView, Op
from qdq.onnx_in.subgraphs import Nested, expose, graph_at
from qdq.onnx_in.view import weight_axis
from qdq.tensor_quant import fake_tensor_quant
from qdq.workflow.bias_correction import CONSTANT_SPREAD, SIGNIFICANCE, BiasShift, measured
from qdq.workflow.progress import Progress, counter

__all__ = ["CONSTANT_SPREAD", "SIGNIFICANCE", "BiasShift", "correct_biases", "measured"]

_CONV_RANKS = (3, 4, 5)  # of the weight: 1-D, 2-D and 3-D convolutions
@dataclass(frozen=True)
class _Shape:
    """How a layer reads its input, for the linearity the shift is computed with.

    The layer's weight is held as ``[C_out, C_in / groups, K]`` (``K`` the kernel's positions, 1 for a linear
    layer); :meth:`patch_sums` gives, for each sample of an input batch, the sum over every output position of the
    input patch that position reads (``[N, C_in, K]``, float64) and the number of output positions of one sample.
    """

    padding: tuple[int, ...] = ()  # F.pad order, for a convolution
    strides: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    kernel: tuple[int, ...] = ()  # () for a linear layer
    groups: int = 1

    def patch_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if not self.kernel:
            rows = x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim > 2 else x[:, None, :]
            return rows.sum(1, dtype=torch.float64)[..., None], rows.shape[1]
        # sums are linear: pad (zeros add nothing), then reduce one spatial axis at a time into its kernel offsets
        # (the output positions' lattice along that axis)
        total = F.pad(x.double(), list(self.padding))
        spans = [(total.shape[2 + a] - self.dilations[a] * (k - 1) - 1) // self.strides[a] + 1
                 for a, k in enumerate(self.kernel)]  # fmt: skip
        for k, d, n, s in zip(self.kernel, self.dilations, spans, self.strides):
            total = torch.stack([total.narrow(2, o * d, (n - 1) * s + 1)[:, :, ::s].sum(2) for o in range(k)], dim=-1)
        return total.reshape(x.shape[0], x.shape[1], -1), math.prod(spans)

    def mean_output(self, mean_patch: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer's output without bias, averaged over positions, per sample and output channel: ``weight``
        (``[C_out, C_in / groups, K]``) applied to the mean input patches (``[N, C_in, K]``); ``[N, C_out]``,
        float64."""
        g = self.groups
        w = weight.double().reshape(g, weight.shape[0] // g, weight.shape[1], -1)
        patches = mean_patch.reshape(mean_patch.shape[0], g, weight.shape[1], -1)
        return torch.einsum("gock,ngck->ngo", w, patches).reshape(mean_patch.shape[0], -1)


@dataclass
class _Layer:
    op: Op
    input: str
    bias: str
    weight: torch.Tensor  # [C_out, C_in / groups, K]
    weight_q: torch.Tensor
    input_amax: torch.Tensor
    unsigned: bool
    shape: _Shape
    apply: Callable[[np.ndarray], torch.Tensor]  # the float layer without bias, as [C_out, positions]
    sums: torch.Tensor | None = None
    sums_q: torch.Tensor | None = None
    count: int = 0
    spread: torch.Tensor | None = None
    samples: int = 0
    moments: torch.Tensor | None = None  # [2, C_out]: sum over samples of m_i and of m_i ** 2

    def observe(self, x: torch.Tensor) -> None:
        """Add a batch of the layer's float input: its patch sums, unquantized and on the input's grid, and each
        sample's own mean error."""
        sums, count = self.shape.patch_sums(x)
        sums_q, _ = self.shape.patch_sums(fake_tensor_quant(x, self.input_amax, 8, self.unsigned))
        errors = (self.shape.mean_output(sums_q / count, self.weight_q)
                  - self.shape.mean_output(sums / count, self.weight))  # fmt: skip
        moments = torch.stack([errors.sum(0), (errors**2).sum(0)])
        if self.sums is None or self.sums_q is None or self.moments is None:
            self.sums, self.sums_q, self.moments = sums.sum(0), sums_q.sum(0), moments
            self.spread = self.apply(x.numpy()).double().std(1, unbiased=False)
        else:
            self.sums += sums.sum(0)
            self.sums_q += sums_q.sum(0)
            self.moments += moments
        self.count += count * x.shape[0]
        self.samples += x.shape[0]

    def shift(self) -> BiasShift:
        """Mean over positions of ``layer(Q(x), Q(W)) - layer(x, W)``, by linearity from the mean patches, where it
        is measured (see the module doc); 0 elsewhere."""
        assert self.sums is not None and self.sums_q is not None and self.spread is not None
        assert self.moments is not None
        shift = (self.shape.mean_output((self.sums_q / self.count)[None], self.weight_q)
                 - self.shape.mean_output((self.sums / self.count)[None], self.weight))[0].numpy()  # fmt: skip
        spread = self.spread.numpy()
        constant = spread <= CONSTANT_SPREAD * spread.max(initial=0.0)
        keep = measured(shift, self.moments[0].numpy(), self.moments[1].numpy(), self.samples)
        shift = np.where(keep, shift, 0.0)
        relative = np.abs(shift) / np.where(constant, 1.0, spread)
        return BiasShift(self.op.name, self.bias, shift.astype(np.float32),
                         float(np.max(np.where(constant, 0.0, relative), initial=0.0)),
                         tuple(int(c) for c in np.flatnonzero(constant)),
                         tuple(int(c) for c in np.flatnonzero(~keep)))  # fmt: skip


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
    uses = Counter(name for node in all_nodes(model.graph) for name in node.input)  # a branch's reads count too
    layers = [layer for op in view.ops if (layer := _layer(model, view, ranges, op, inits, threads)) is not None
              and uses[layer.bias] == 1]  # fmt: skip
    if known is not None:
        by_op = {shift.op: shift for shift in known}
        return [_subtract(by_op[layer.op.name], inits[layer.bias]) for layer in layers if layer.op.name in by_op]
    if not layers or not batches:
        return []
    inputs = [i.name for i in feed_inputs(model)]
    wanted = sorted({layer.input for layer in layers})
    bar = counter(progress, "bias correction", len(batches))
    with tempfile.TemporaryDirectory(prefix="qdq-bias-") as folder, torch.no_grad():
        session = ort_session(probe_model(model, wanted, expose), threads=threads, folder=Path(folder))
        for batch in batches:
            outputs = outputs_of(session, {name: np.asarray(batch[name]) for name in inputs})
            for layer in layers:
                if outputs[layer.input].size:  # empty: an If branch this batch did not take
                    layer.observe(torch.from_numpy(np.asarray(outputs[layer.input], np.float32)))
            bar.update()
    bar.close()
    return [_subtract(layer.shift(), inits[layer.bias]) for layer in layers if layer.samples]


def _subtract(shift: BiasShift, tensor: onnx.TensorProto) -> BiasShift:
    """``tensor`` (the bias initializer) minus ``shift``, in place; returns ``shift``."""
    bias = numpy_helper.to_array(tensor)
    corrected = (bias.astype(np.float64) - shift.shift.reshape(bias.shape)).astype(bias.dtype)
    tensor.CopyFrom(numpy_helper.from_array(corrected, tensor.name))
    return shift


def _layer(model: onnx.ModelProto, view: GraphView, ranges: Mapping[int, np.ndarray], op: Op,
           inits: Mapping[str, onnx.TensorProto], threads: int | None) -> _Layer | None:  # fmt: skip
    """The layer to correct at ``op``, or None (not a quantized layer with its own bias)."""
    path, position = (op.ref.path, op.ref.ref) if isinstance(op.ref, Nested) else ((), op.ref)
    if op.type not in ("Conv", "Gemm", "MatMul") or not isinstance(position, int) or len(op.inputs) < 2:
        return None
    activation, weight = view.quantizer_at(op, 0), view.quantizer_at(op, 1)
    if activation is None or weight is None or not weight.per_channel or op.inputs[1].name not in inits:
        return None
    w = torch.from_numpy(numpy_helper.to_array(inits[op.inputs[1].name]).astype(np.float32))
    node = graph_at(model, path).node[position]  # a layer inside an If branch too: its weights are the main graph's
    found = _bias_and_shape(view, op, node, tuple(w.shape), inits)
    if found is None or found[0] not in inits:
        return None
    bias, shape, transposed = found
    per_channel = [1] * w.ndim
    per_channel[weight_axis(op, 1) % w.ndim] = -1
    w_amax = torch.from_numpy(np.asarray(ranges[id(weight)], np.float32)).reshape(per_channel)
    w_q = fake_tensor_quant(w, w_amax)
    w, w_q = (w.T, w_q.T) if transposed else (w, w_q)
    layer_weight = w.reshape(w.shape[0], w.shape[1], -1)
    return _Layer(op=op, input=op.inputs[0].name, bias=bias, weight=layer_weight,
                  weight_q=w_q.reshape(layer_weight.shape),
                  input_amax=torch.from_numpy(np.asarray(ranges[id(activation)], np.float32)).reshape(()),
                  unsigned=activation.unsigned, shape=shape,
                  apply=_float_layer(model, node, inits[op.inputs[1].name], threads))  # fmt: skip


def _bias_and_shape(view: GraphView, op: Op, node: onnx.NodeProto, weight: tuple[int, ...],
                    inits: Mapping[str, onnx.TensorProto]) -> tuple[str, _Shape, bool] | None:  # fmt: skip
    """``(bias tensor, how the layer reads its input, whether the weight is stored [C_in, C_out])`` for a
    supported layer with a 1-D bias initializer, or None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op.type == "Conv":
        if len(node.input) < 3 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return None
        shape = _conv_shape(attrs, weight)
        return None if shape is None else (node.input[2], shape, False)
    if len(weight) != 2:
        return None
    if op.type == "Gemm":
        if len(node.input) < 3 or attrs.get("transA", 0) or float(attrs.get("beta", 1.0)) != 1.0:
            return None
        if float(attrs.get("alpha", 1.0)) != 1.0 or node.input[2] not in inits or len(inits[node.input[2]].dims) != 1:
            return None
        return node.input[2], _Shape(), not attrs.get("transB", 0)
    add = view.single_reader(op.outputs[0])
    if add is None or add.type != "Add" or not isinstance(add.ref, int | Nested):
        return None
    other = next((v for v in add.inputs if v is not op.outputs[0]), None)
    if other is None or other.name not in inits or len(inits[other.name].dims) != 1:
        return None
    return other.name, _Shape(), True


def _conv_shape(attrs: Mapping[str, Any], weight: tuple[int, ...]) -> _Shape | None:
    if len(weight) not in _CONV_RANKS:
        return None
    spatial = len(weight) - 2
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    return _Shape(padding=tuple(p for axis in reversed(range(spatial)) for p in (pads[axis], pads[axis + spatial])),
                  strides=tuple(attrs.get("strides", [1] * spatial)),
                  dilations=tuple(attrs.get("dilations", [1] * spatial)),
                  kernel=weight[2:], groups=int(attrs.get("group", 1)))  # fmt: skip


def _float_layer(model: onnx.ModelProto, node: onnx.NodeProto, weight: onnx.TensorProto,
                 threads: int | None) -> Callable[[np.ndarray], torch.Tensor]:  # fmt: skip
    """The float layer without its bias, ``x -> [C_out, positions]``: ``node`` with its input and weight, run alone
    on ONNX Runtime (a one-node model; on the first batch)."""

    def run(x: np.ndarray) -> torch.Tensor:
        single = onnx.NodeProto()
        single.CopyFrom(node)
        del single.input[2:]
        source = helper.make_tensor_value_info(node.input[0], weight.data_type, None)
        graph = helper.make_graph([single], "layer", [source], [onnx.ValueInfoProto(name=node.output[0])], [weight])
        session = ort_session(helper.make_model(graph, opset_imports=model.opset_import), threads=threads)
        feed = {node.input[0]: x.astype(helper.tensor_dtype_to_np_dtype(weight.data_type))}
        channels = np.moveaxis(outputs_of(session, feed)[node.output[0]], 1 if node.op_type == "Conv" else -1, 0)
        return torch.from_numpy(np.ascontiguousarray(channels.reshape(channels.shape[0], -1)))

    return run

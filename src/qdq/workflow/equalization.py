"""Cross-layer equalization: a per-channel scale moved through a positively homogeneous activation, so that one
per-tensor int8 grid serves every channel of the tensor between two convolutions.

A convolution ``first`` writes ``C`` channels, an activation ``f`` with ``f(s x) = s f(x)`` for ``s > 0`` maps them
(``Relu``, ``LeakyRelu``; ``Clip(0, b)`` on the int8 path, below), and a convolution ``second`` reads them through
one per-tensor quantizer. Its step is set by the largest channel: a channel whose peak is a tenth of it is left a
tenth of the grid. Multiplying output channel ``c`` of ``first`` (its weight row and bias) by ``s_c`` and dividing
input channel ``c`` of ``second``'s weight by it computes the same function (Nagel et al., 2019, "Data-Free
Quantization", section 4.1): the activation's spread across channels moves into ``second``'s weight columns, which
are quantized per *output* channel. ``first``'s weights are quantized per output channel too, so scaling its rows
costs nothing; a depthwise ``second`` has one input channel per output channel, so there the move is free as well.

The scales are ``s_c = (M / m_c) ** alpha``, ``m_c`` the channel's peak on calibration batches (floored at
``M / SCALE_CAP``: a dead channel is not scaled without bound), ``M`` the largest. ``alpha = 1`` gives every channel
the largest one's peak and moves all of the spread into ``second``'s weight columns, where it coarsens the step of
each output channel. :func:`plan_scaling` keeps the ``alpha`` of :data:`ALPHAS` whose predicted output noise of
``second`` is lowest, where it is at least :data:`MIN_GAIN_DB` below that of no scaling: uniform rounding noise of
the activation's step (``max_c s_c m_c / levels``) through ``second``'s weights, plus that of each output channel's
weight step (``max |W_kc / s_c| / 127``) through the activation's per-channel mean square (:func:`predicted_noise`).
Larger ``alpha`` predicts more than it gives once a range method clips the activation: every channel then reaches
the clipped top. The noise model is local; ``auto`` then scores the whole model on its held-out samples with the
pairs rescaled and with the weights as they were (each pair's activation at the range its own histogram gives, the
two convolutions' weight ranges computed again) and undoes the scalings exactly (``Scaling.originals``) where they
score :data:`UNDO_DB` or more lower (:func:`kept`): the few held-out samples overrule the prediction only clearly.

``Clip(0, b)`` stays ``Clip(0, b)``: channel ``c`` scaled would be clipped at ``s_c b``. Every scaled peak
``s_c m_c`` is at most ``M <= b`` and the quantizer reading the activation saturates at its range, which is at most
``b``: the int8 path is exact. Read float (``second`` left float later), a channel differs where it exceeds ``b /
s_c``, above its calibration peak ``m_c``.

What each front end does: find the pairs in its view (:func:`equalization_pairs`), measure the activation's
per-channel peaks and mean squares (:class:`ChannelStats`), plan, and write :func:`scaled_first` /
:func:`scaled_second` into its weights: :func:`equalize_modules` for PyTorch models (before ``auto`` collects its
statistics), :mod:`qdq.onnx_in.equalize` for ONNX files, :mod:`qdq.keras.equalize` for Keras models.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from qdq.calib.registry import make_calibrator
from qdq.graphs.view import GraphView, Op
from qdq.markdown import markdown_table
from qdq.quantizer import disabled_quantizers
from qdq.utils.modes import eval_mode
from qdq.workflow.collection import ForwardFn
from qdq.workflow.distributed import unwrap
from qdq.workflow.progress import Progress, counter

__all__ = [
    "ALPHAS",
    "MEASURED_BATCHES",
    "MIN_GAIN_DB",
    "SCALE_CAP",
    "UNDO_DB",
    "ChannelStats",
    "Pair",
    "Scaling",
    "equalization_pairs",
    "equalization_summary",
    "equalization_table",
    "equalize_modules",
    "kept",
    "levels_of",
    "plan_scaling",
    "predicted_noise",
    "scaled_first",
    "scaled_second",
    "stats_of",
    "swap_tensors",
]  # fmt: skip

#: the migration strengths tried (0: no scaling, the baseline)
ALPHAS = (0.25, 0.5)
#: the predicted drop of ``second``'s output noise (dB) a scaling must reach to be applied
MIN_GAIN_DB = 1.0
#: the held-out loss (dB) against the model as it was that undoes the scalings: the noise model predicted a gain for
#: each, so the few held-out samples overrule it only by a clear margin (the measurement behind this figure:
#: benchmarks/RESULTS.md, zoo, equalization's held-out check)
UNDO_DB = 2.0
#: the calibration batches the activations are measured on: a list's first ones (an iterator's first 8:
#: :func:`qdq.workflow.collection.first_batches`)
MEASURED_BATCHES = 32
#: a channel's scale is at most ``SCALE_CAP ** alpha``
SCALE_CAP = 32.0
#: activations ``f`` with ``f(s x) = s f(x)`` for ``s > 0`` (``Clip`` only from 0: module doc)
HOMOGENEOUS = frozenset({"Relu", "LeakyRelu", "Clip"})
_WEIGHT_LEVELS = 127  # per-channel int8 weights, symmetric


@dataclass(frozen=True, eq=False)
class Pair:
    """Two int8 convolutions with a positively homogeneous activation between them (module doc); ``norm``: a
    BatchNorm between ``first`` and the activation (a PyTorch model's; the ONNX front end folds them), whose affine
    weight and bias then take ``first``'s scaling."""

    first: Op
    activation: Op
    second: Op
    norm: Op | None = None

    @property
    def value(self) -> str:
        """The tensor whose channels are equalized: the activation's output, ``second``'s input."""
        return self.activation.outputs[0].name


@dataclass
class Scaling:
    """One pair's equalization: the ops' names, the ``alpha`` chosen, the scale of each channel (``first``'s output
    channels multiplied by it, ``second``'s input channels divided) and the predicted drop of ``second``'s output
    noise (dB, negative). ``originals``: the weights as they were, by the front end's name (to undo it exactly);
    ``histogram``: the calibrator of the activation as it was (its range where the scaling is undone)."""

    first: str
    second: str
    alpha: float
    scales: np.ndarray = field(repr=False)
    predicted_db: float
    originals: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    histogram: Any = field(default=None, repr=False, compare=False)
    handles: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the front end's objects


def kept(equalized_db: float, plain_db: float) -> bool:
    """Is equalization kept: does the model score on the held-out samples no more than :data:`UNDO_DB` below its
    score with the weights as they were (each with its own ranges)? A score that is not finite loses."""
    finite = [value if math.isfinite(value) else -math.inf for value in (equalized_db, plain_db)]
    return finite[0] > finite[1] - UNDO_DB


def equalization_pairs(view: GraphView, *, placed: bool = True) -> list[Pair]:
    """Every ``Conv -> [BatchNorm ->] activation -> Conv`` of ``view`` where both convolutions run int8 with weights
    of their own, the activation is positively homogeneous (:data:`HOMOGENEOUS`), each tensor between them has that
    one reader and no quantizer, and ``second`` reads the activation through a quantizer of its own.
    ``placed=False``: the pairs the graph joins so, whatever is quantized (an earlier call's scalings written again
    into a placement that leaves some of them float: the ranges it reuses were calibrated on the scaled tensors)."""
    pairs = []
    for activation in view.ops_of(*HOMOGENEOUS):
        if activation.type == "Clip" and not (activation.attrs.get("min") == 0 and activation.attrs.get("max", 1) > 0):
            continue
        first, norm = activation.inputs[0].producer, None
        if first is not None and first.type == "BatchNormalization" and not view.reads_quantized(first, 0):
            first, norm = first.inputs[0].producer, first
        second = view.single_reader(activation.outputs[0])
        if first is None or second is None or view.single_reader(first.outputs[0]) is not (norm or activation):
            continue
        if norm is not None and view.single_reader(norm.outputs[0]) is not activation:
            continue
        if _equalizable(view, first, activation, second, placed):
            pairs.append(Pair(first, activation, second, norm))
    return pairs


def _equalizable(view: GraphView, first: Op, activation: Op, second: Op, placed: bool) -> bool:
    convs = first.type == second.type == "Conv" and 1 in first.weights and 1 in second.weights
    if not convs or second.inputs[0] is not activation.outputs[0]:
        return False
    owned = [first.inputs[1], second.inputs[1], *first.inputs[2:3]]  # a weight or bias another op reads stays
    if any(len(value.readers) != 1 or not value.constant for value in owned):
        return False
    if not placed:
        return True
    quantizer = view.quantizer_at(second, 0)
    unquantized_between = view.output_quantizer(first.outputs[0]) is None and not view.reads_quantized(activation, 0)
    return (quantizer is not None and len(quantizer.sites) == 1 and unquantized_between
            and view.is_quantized(first) and view.is_quantized(second))  # fmt: skip


class ChannelStats:
    """The per-channel peak ``max |x|`` and mean square of a tensor over batches (channels on ``axis``)."""

    def __init__(self, axis: int = 1, histogram: Any = None) -> None:
        self.axis = axis
        self.histogram = histogram  # a calibrator the tensor is also collected into, or None
        self.peak: np.ndarray | None = None
        self._squares: np.ndarray | None = None
        self._count = 0

    def update(self, tensor: np.ndarray | torch.Tensor) -> None:
        """Add one batch (an empty tensor, from an ``If`` branch the batch did not take, adds nothing). A torch tensor
        off the CPU is reduced on its device: only the per-channel figures reach the host."""
        if math.prod(tensor.shape) == 0:
            return
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            peak, squares, count = _device_moments(tensor.float(), self.axis)
        else:
            array = tensor.detach().numpy() if isinstance(tensor, torch.Tensor) else tensor
            channels = np.moveaxis(np.asarray(array, np.float32), self.axis, 0).reshape(array.shape[self.axis], -1)
            peak = np.maximum(channels.max(axis=1), -channels.min(axis=1)).astype(np.float64)  # no |x| copy
            squares = np.einsum("ij,ij->i", channels, channels).astype(np.float64)  # no x**2 copy
            count = channels.shape[1]
        self.peak = peak if self.peak is None else np.maximum(self.peak, peak)
        self._squares = squares if self._squares is None else self._squares + squares
        self._count += count
        if self.histogram is not None:
            batch = tensor if isinstance(tensor, torch.Tensor) else np.ascontiguousarray(tensor, np.float32)
            self.histogram.collect(torch.as_tensor(batch))

    @property
    def mean_square(self) -> np.ndarray | None:
        return None if self._squares is None else self._squares / self._count


def _device_moments(tensor: torch.Tensor, axis: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-channel peak ``max |x|`` and sum of squares (float64 arrays) and the values per channel, of a float32
    tensor reduced where it lives."""
    axis %= tensor.dim()
    dims = [d for d in range(tensor.dim()) if d != axis]
    peak = tensor.abs().amax(dim=dims) if dims else tensor.abs()
    squares = tensor.square().sum(dim=dims) if dims else tensor.square()
    return peak.double().cpu().numpy(), squares.double().cpu().numpy(), tensor.numel() // tensor.shape[axis]


def predicted_noise(weight: np.ndarray, groups: int, peak: np.ndarray, mean_square: np.ndarray, scales: np.ndarray,
                    levels: int) -> float:  # fmt: skip
    """The output noise power of ``second`` (summed over its output channels, up to the common factor 1/12) with its
    input channels scaled by ``scales``: the activation's per-tensor step ``max_c s_c m_c / levels`` through the
    weights ``W / s``, plus each output channel's per-channel int8 weight step through the activation's mean square.
    ``weight``: ``second``'s ``[K, C / groups, *kernel]``; ``peak``, ``mean_square``, ``scales``: per channel ``C``."""
    kernel, per_group = int(np.prod(weight.shape[2:], dtype=np.int64)), weight.shape[1]
    scaled = weight.astype(np.float64).reshape(groups, -1, per_group, kernel) / scales.reshape(groups, 1, per_group, 1)
    activation_step = float(np.max(scales * peak)) / levels
    activation = activation_step**2 * float(np.square(scaled).sum())
    weight_steps = np.abs(scaled).max(axis=(2, 3)) / _WEIGHT_LEVELS  # [groups, K / groups]
    power = (mean_square * np.square(scales)).reshape(groups, 1, per_group).sum(axis=2)  # [groups, 1]
    return activation + float((np.square(weight_steps) * kernel * power).sum())


def plan_scaling(pair: Pair, stats: ChannelStats, weight: np.ndarray, groups: int, levels: int) -> Scaling | None:
    """The scaling of ``pair`` (module doc), or None: no ``alpha`` of :data:`ALPHAS` predicts :data:`MIN_GAIN_DB`,
    the channels do not match ``second``'s weight, or the activation never varied."""
    peak, mean_square = stats.peak, stats.mean_square
    if peak is None or mean_square is None or peak.size != weight.shape[1] * groups or not np.max(peak) > 0:
        return None
    largest = float(np.max(peak))
    ratio = largest / np.maximum(peak, largest / SCALE_CAP)
    base = predicted_noise(weight, groups, peak, mean_square, np.ones_like(peak), levels)
    best: Scaling | None = None
    for alpha in ALPHAS:
        scales = ratio**alpha
        noise = predicted_noise(weight, groups, peak, mean_square, scales, levels)
        gain = 10 * math.log10(noise / base) if noise > 0 and base > 0 else 0.0
        if gain <= -MIN_GAIN_DB and (best is None or gain < best.predicted_db):
            best = Scaling(pair.first.name, pair.second.name, alpha, scales.astype(np.float32), gain)
    return best


def scaled_first(weight: np.ndarray, bias: np.ndarray | None, scales: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """``first``'s weight ``[C, ...]`` and bias ``[C]`` with output channel ``c`` multiplied by ``scales[c]``."""
    rows = scales.reshape((-1,) + (1,) * (weight.ndim - 1))
    return (weight * rows).astype(weight.dtype), None if bias is None else (bias * scales).astype(bias.dtype)


def scaled_second(weight: np.ndarray, groups: int, scales: np.ndarray) -> np.ndarray:
    """``second``'s weight ``[K, C / groups, ...]`` with input channel ``c`` divided by ``scales[c]`` (channel ``c``
    is column ``c % (C / groups)`` of the output channels of group ``c // (C / groups)``)."""
    per_group = weight.shape[1]
    grouped = weight.reshape(groups, -1, per_group, *weight.shape[2:])
    divisor = scales.reshape(groups, 1, per_group, *([1] * (weight.ndim - 2)))
    return (grouped / divisor).reshape(weight.shape).astype(weight.dtype)


def equalization_summary(scalings: Sequence[Scaling]) -> str:
    """One line for a report: how many pairs were equalized and the largest predicted gain."""
    if not scalings:
        return ""
    best = min(scalings, key=lambda s: s.predicted_db)
    return (f"Cross-layer equalization: {len(scalings)} convolution pair(s) rescaled through their activation "
            f"(largest predicted drop of the second's output noise {best.predicted_db:.1f} dB, {best.first} -> "
            f"{best.second}).")  # fmt: skip


def equalization_table(scalings: Sequence[Scaling]) -> str:
    """One row per equalized pair: the ops, ``alpha``, the range of the scales and the predicted gain."""
    rows = [[s.first, s.second, f"{s.alpha:g}", f"{float(s.scales.min()):.3g}-{float(s.scales.max()):.3g}",
             f"{s.predicted_db:.1f}"] for s in scalings]  # fmt: skip
    return markdown_table(["first", "second", "alpha", "scales", "predicted dB"], rows)


def levels_of(view: GraphView, pair: Pair) -> int:
    """The steps of the activation's grid from 0 to its range: 255 where its quantizer is unsigned, else 127."""
    quantizer = view.quantizer_at(pair.second, 0)
    return 255 if quantizer is not None and quantizer.unsigned else 127


def equalize_modules(model: nn.Module, view: GraphView, batches: Sequence[Any], forward: ForwardFn,
                     progress: Progress = False) -> list[Scaling]:  # fmt: skip
    """Equalize every pair of ``view`` (the model's torch.fx view, :func:`qdq.graphs.fx_view.trace_view`) whose
    scaling predicts a gain, measured on ``batches`` with the quantizers off; the modules' parameters are rescaled
    in place (``first``'s weight rows and bias, or its BatchNorm's affine weight and bias; ``second``'s weight
    columns). A pair of modules some other call also runs (a shared module) is left as it is."""
    root = unwrap(model)
    calls = Counter(str(op.ref.target) for op in view.ops if op.ref.op == "call_module")
    pairs = [pair for pair in equalization_pairs(view) if _modules(root, pair, calls) is not None]
    if not pairs or not batches:
        return []
    stats = {pair.value: stats_of(view, pair) for pair in pairs}
    hooks = [_module(root, pair.second).register_forward_pre_hook(_observer(stats[pair.value])) for pair in pairs]
    bar = counter(progress, "equalization", len(batches))
    try:
        with disabled_quantizers(root), eval_mode(model), torch.no_grad():
            for batch in batches:
                forward(model, batch)
                bar.update()
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    scalings = []
    for pair in pairs:
        first, norm, second = _modules(root, pair, calls)  # type: ignore[misc]
        weight = cast(torch.Tensor, _tensor(second, "weight")).detach().cpu().numpy()
        scaling = plan_scaling(pair, stats[pair.value], weight, _groups(second), levels_of(view, pair))
        if scaling is not None:
            _record(scaling, root, view, pair, stats[pair.value])
            _write(first, norm, second, scaling.scales)
            scalings.append(scaling)
    return scalings


def stats_of(view: GraphView, pair: Pair, axis: int = 1) -> ChannelStats:
    """The statistics a pair's activation is measured into: per channel (on ``axis``), and a histogram of it as it is
    (with the grid's sign) for the range it keeps where the scaling is undone."""
    return ChannelStats(axis=axis, histogram=make_calibrator("histogram", unsigned=levels_of(view, pair) > 127))


def _record(scaling: Scaling, root: nn.Module, view: GraphView, pair: Pair, stats: ChannelStats) -> None:
    """What undoing ``scaling`` needs (the PyTorch door): the parameters it changes as they were, the activation's
    histogram, the quantizer reading it, the two modules whose weight ranges change."""
    paths = [str(op.ref.target) for op in (pair.norm or pair.first, pair.second)]
    scaling.originals = {f"{path}.{name}": tensor.detach().clone() for path in paths for name in ("weight", "bias")
                         if (tensor := _tensor(root.get_submodule(path), name)) is not None}  # fmt: skip
    scaling.histogram = stats.histogram
    quantizer = view.quantizer_at(pair.second, 0)
    scaling.handles = {"quantizer": view.handle_of(quantizer.sites[0]) if quantizer is not None else None,
                       "modules": [str(op.ref.target) for op in (pair.first, pair.second)]}  # fmt: skip


def swap_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Write ``tensors`` (by ``"<module path>.<parameter>"``) into ``model``'s parameters, in place; returns the
    values they replaced (swap them back to undo)."""
    root, replaced = unwrap(model), {}
    for key, value in tensors.items():
        path, _, name = key.rpartition(".")
        target = cast(torch.Tensor, _tensor(root.get_submodule(path), name))
        replaced[key] = target.detach().clone()
        with torch.no_grad():
            target.copy_(value)
    return replaced


def _module(root: nn.Module, op: Op) -> nn.Module:
    return root.get_submodule(str(op.ref.target))


def _modules(root: nn.Module, pair: Pair, calls: Counter[str]) -> tuple[nn.Module, nn.Module | None, nn.Module] | None:
    """The pair's modules (``first``, its BatchNorm or None, ``second``), or None: an op that is not a module call of
    its own, or a BatchNorm without affine parameters."""
    ops = [pair.first, pair.second, *([pair.norm] if pair.norm is not None else [])]
    if any(op.ref.op != "call_module" or calls[str(op.ref.target)] != 1 for op in ops):
        return None
    first, second = _module(root, pair.first), _module(root, pair.second)
    norm = _module(root, pair.norm) if pair.norm is not None else None
    if norm is not None and (_tensor(norm, "weight") is None or _tensor(norm, "bias") is None):
        return None
    if _tensor(first, "weight") is None or _tensor(second, "weight") is None or not hasattr(second, "groups"):
        return None
    return first, norm, second


def _observer(stats: ChannelStats) -> Any:
    def observe(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):  # the conv's input, given positionally as torch.fx traced it
            stats.update(args[0].detach().float())

    return observe


def _write(first: nn.Module, norm: nn.Module | None, second: nn.Module, scales: np.ndarray) -> None:
    """``scales`` into the modules' parameters, in place (module doc)."""
    owner = norm if norm is not None else first
    weight, bias = cast(torch.Tensor, _tensor(owner, "weight")), _tensor(owner, "bias")  # checked by _modules
    rows, shifted = scaled_first(weight.detach().cpu().numpy(), None if bias is None else bias.detach().cpu().numpy(),
                                 scales)  # fmt: skip
    columns = cast(torch.Tensor, _tensor(second, "weight"))
    with torch.no_grad():
        weight.copy_(torch.from_numpy(rows))
        if bias is not None and shifted is not None:
            bias.copy_(torch.from_numpy(shifted))
        columns.copy_(torch.from_numpy(scaled_second(columns.detach().cpu().numpy(), _groups(second), scales)))


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    found = getattr(module, name, None)
    return found if isinstance(found, torch.Tensor) else None


def _groups(module: nn.Module) -> int:
    return int(getattr(module, "groups", 1))

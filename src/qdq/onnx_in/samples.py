"""Where an ONNX model's batches hold their samples: the axis of each graph input and output along which a feed can
be cut into samples (held out from calibration, split in halves, cut to one sample for a latency).

An image or sequence model names its batch axis by making dimension 0 of every input dynamic (under one name, where
it has one: ``[batch, sequence]`` and ``[sequence]`` do not share an axis). A recurrent model
fed its state too (silero-vad: ``input [batch, sequence]``, ``state [2, batch, 128]``, ``sr []``) says it by a
name: the axis its first input's first dimension names, which each other input names exactly once, unless the graph
fixes its whole shape (a scalar, an initial state ``[1, 1, 128]`` of a sequence model whose first input is
``[sequence_length, 576]``): that one is fed whole to every part. A part of a sequence is a feed like any other;
what the float model computes on it is what its quantized copy is scored against. A model that says neither (a
batch axis nobody named) is fed whole: its batches cannot be cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from qdq.graphs.onnx import feed_inputs
from qdq.graphs.onnx_types import value_dims
from qdq.workflow.refinement import samples_of

__all__ = ["Feed", "Pair", "SampleAxes", "one_sample", "pair_samples", "split"]

Feed = dict[str, np.ndarray]
Pair = tuple[Feed, list[np.ndarray]]  # a feed and the float model's outputs on it


@dataclass(frozen=True)
class SampleAxes:
    """The sample axis of each graph input (None: fed whole, a scalar or a shape the graph fixes) and of each graph
    output, in the graph's order (``outputs`` None where the outputs do not say: a feed can still be cut, their values
    cannot)."""

    inputs: dict[str, int | None]
    outputs: tuple[int, ...] | None

    @classmethod
    def of(cls, model: onnx.ModelProto) -> SampleAxes | None:
        """The axes ``model`` declares (module doc), or None where it does not say where its samples lie."""
        declared = feed_inputs(model)
        names = [_dim_names(value) for value in declared]
        firsts = {dims[0] for dims in names if dims} - {""}  # what dimension 0 is called, where it has a name
        if declared and all((value_dims(v) or [0])[0] is None for v in declared) and len(firsts) <= 1:
            return cls({v.name: 0 for v in declared}, tuple(0 for _ in model.graph.output))  # dimension 0 everywhere
        batch = names[0][0] if names and names[0] else ""
        whole = [_fixed(value) for value in declared]  # a shape the graph fixes (a scalar too): fed whole
        if not batch or any(dims.count(batch) != 1 for dims, fixed in zip(names, whole) if not fixed):
            return None
        outputs = [_dim_names(value) for value in model.graph.output]
        return cls({value.name: None if fixed else dims.index(batch)
                    for value, dims, fixed in zip(declared, names, whole)},
                   tuple(dims.index(batch) for dims in outputs) if all(d.count(batch) == 1 for d in outputs)
                   else None)  # fmt: skip

    def samples(self, feed: Mapping[str, np.ndarray]) -> int | None:
        """How many samples ``feed`` holds (one size along every input's axis), or None."""
        sizes = {np.shape(feed[name])[axis] for name, axis in self.inputs.items() if axis is not None}
        return sizes.pop() if len(sizes) == 1 else None

    def cut(self, feed: Mapping[str, np.ndarray], part: slice) -> Feed:
        """The samples ``part`` of ``feed`` (a scalar whole)."""
        return {name: _take(array, self.inputs.get(name), part) for name, array in feed.items()}

    def halves(self, pair: Pair) -> tuple[Pair, Pair] | None:
        """A (feed, outputs) pair as its first and last samples, or None where it holds fewer than two or its outputs'
        axes are unknown or disagree with the feed's."""
        feed, outputs = pair
        size = self.samples(feed)
        if size is None or size < 2 or self.outputs is None or len(self.outputs) != len(outputs):
            return None
        if any(np.ndim(o) <= axis or np.shape(o)[axis] != size for o, axis in zip(outputs, self.outputs)):
            return None
        parts = slice(0, size // 2), slice(size // 2, size)
        return tuple((self.cut(feed, p), [_take(o, axis, p) for o, axis in zip(outputs, self.outputs)])
                     for p in parts)  # type: ignore[return-value]  # fmt: skip


def _dim_names(value: Any) -> list[str]:
    """The symbolic names of a ``ValueInfoProto``'s dimensions ("" for a fixed or unnamed one)."""
    return [dim.dim_param for dim in value.type.tensor_type.shape.dim]


def _fixed(value: Any) -> bool:
    """Whether a ``ValueInfoProto`` fixes every dimension (a scalar does)."""
    dims = value_dims(value)
    return dims is not None and None not in dims


def _take(array: np.ndarray, axis: int | None, part: slice) -> np.ndarray:
    """``part`` of ``array`` along ``axis`` (None: the array whole)."""
    if axis is None:
        return array
    index: list[Any] = [slice(None)] * np.ndim(array)
    index[axis] = part
    return np.asarray(array)[tuple(index)]


def split(axes: SampleAxes | None, feed: Feed, aside: int) -> tuple[Feed | None, Feed | None]:
    """``feed`` as (the samples kept, the last ``aside`` held out); None for an empty part. Where ``axes`` cannot cut
    it (None, or no one sample count), any ``aside`` holds the whole feed out."""
    size = axes.samples(feed) if axes is not None else None
    if not aside:
        return feed, None
    if axes is None or size is None or aside >= size:
        return None, feed
    return axes.cut(feed, slice(0, size - aside)), axes.cut(feed, slice(size - aside, size))


def one_sample(model: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> Feed | None:
    """``feed``'s first sample, as a deployed model runs (latency): cut along the axes the model declares, or the
    feed whole where every input's first dimension is fixed at one; None where the inputs do not say which axis holds
    the samples, or where an input of rank one or more is fed whole (a sequence model's state fixed at one stream:
    one step of its sequence is no sample of its own)."""
    declared = feed_inputs(model)
    axes = SampleAxes.of(model)
    if axes is not None and any(axes.inputs[v.name] is None and (value_dims(v) or []) for v in declared):
        return None
    if axes is not None:
        return axes.cut({value.name: np.asarray(feed[value.name]) for value in declared}, slice(0, 1))
    fixed_at_one = all((value_dims(value) or [None])[0] == 1 for value in declared)
    return {value.name: np.asarray(feed[value.name]) for value in declared} if fixed_at_one else None


def pair_samples(axes: SampleAxes | None, pair: Sequence[Any]) -> int:
    """The samples of a (feed, outputs) pair: its feed's along ``axes``, else its first output's first dimension
    (:func:`qdq.workflow.refinement.samples_of`)."""
    return (axes.samples(pair[0]) if axes is not None else None) or samples_of(pair[1])

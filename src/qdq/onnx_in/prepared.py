"""``PreparedModel``: an FP32 ONNX model loaded and prepared once, then placed as many times as asked.

:func:`qdq.quantize_onnx` loads and prepares its file (:mod:`qdq.onnx_in.load`), places it for a target,
calibrates and writes it; :func:`qdq.tune` writes tens of files from one FP32 model that differ only in the tensors
left float. Both go through this object:

* :meth:`PreparedModel.load`: load and prepare, once;
* :meth:`PreparedModel.place`: the view of the prepared graph (:mod:`qdq.onnx_in.view`) with the target's rules
  and the user's float ops and tensors, and the copy of the graph it is written into (:class:`Placement`; the
  view's ops refer to nodes by position, so any copy takes its decisions);
* :meth:`PreparedModel.view`: that view alone, to compare placements before one is written;
* :meth:`PreparedModel.units`: the tensors of each activation quantizer of the target's placement, the units
  :func:`qdq.tune` leaves float;
* :meth:`PreparedModel.values`: float tensors of the model on one batch (ONNX Runtime);
* :meth:`Placement.write`: the Q/DQ nodes at the placement's quantizers with the ranges given, then the end of every
  qdq export (:func:`qdq.export.onnx_export.finish_onnx`: the target's rewrite, ``onnx.checker``, an atomic write).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdq.errors import QdqConfigError
from qdq.export.onnx_export import finish_onnx
from qdq.graphs.onnx import feed_inputs
from qdq.graphs.onnx_session import ort_session
from qdq.graphs.view import GraphView, Quantizer
from qdq.onnx_in.attention import attention_shapes
from qdq.onnx_in.calibrate import probe_model
from qdq.onnx_in.load import load_float_model, prepare
from qdq.onnx_in.materialize import qdq_edit
from qdq.onnx_in.view import KeepFloat, build_view, keep_user_float, select_attention, select_weighted
from qdq.targets import Target
from qdq.targets.onnxruntime.passes.float_convs import float_convs_said
from qdq.targets.rules import apply_rules

__all__ = ["Placement", "PreparedModel", "activation_groups", "activation_values", "ranges_by_value", "values_ranges"]


class PreparedModel:
    """An FP32 ONNX model, loaded and prepared for placement once (:meth:`load`).

    Attributes:
        model: the prepared graph (``Constant`` weights as initializers, BatchNorm folded, opset >= 13...); every
            placement writes a copy of it, so it stays as prepared.
        changes: what preparing changed (``constant_weights``, ``batchnorms_folded``, ``opset``...).
    """

    def __init__(self, model: onnx.ModelProto, changes: Mapping[str, int]) -> None:
        self.model = model
        self.changes = dict(changes)
        self._taken = False

    @classmethod
    def load(cls, model: str | Path | onnx.ModelProto | PreparedModel) -> PreparedModel:
        """The model at a path (its external data read) or a ``ModelProto`` (copied), checked to be float and
        prepared; a :class:`PreparedModel` as it is.

        Raises:
            QdqConfigError: no such file, not an ONNX file, or a graph quantized already.
        """
        if isinstance(model, PreparedModel):
            return model
        proto = load_float_model(model)
        return cls(proto, prepare(proto))

    @property
    def inputs(self) -> list[str]:
        """The graph's inputs (initializers excepted), in order: the names a batch feeds."""
        return [i.name for i in feed_inputs(self.model)]

    def place(self, target: Target, keep_float: Sequence[str] = (), float_values: Sequence[str] = (),
              non_negative_inputs: Sequence[str] = (), *, copy: bool = True,
              batches: Sequence[Any] = ()) -> Placement:  # fmt: skip
        """``target``'s decisions on the prepared graph, then the user's: ``keep_float`` ops (names, ``"op:Type"``,
        patterns) and ``float_values`` tensors left float. ``non_negative_inputs``: graph inputs the data shows are
        >= 0 (images in [0, 1]); a target with unsigned activations gives them the uint8 grid ``[0, amax]``.
        ``copy=False``: the placement writes the prepared graph itself (one placement of a large model, no copy
        in memory); the model cannot be placed again after that. ``batches``: calibration batches, whose input
        shapes give each attention's head size and sequence length where the target's facts limit them (none: the
        shapes the graph declares).

        Raises:
            QdqConfigError: ``float_values`` names a tensor the graph does not have; a model placed without a copy.
        """
        if self._taken:
            raise QdqConfigError("this prepared model was placed with copy=False and written: load it again.")
        view = self.view(target, keep_float, float_values, non_negative_inputs, batches=batches)
        if copy:
            written = onnx.ModelProto()
            written.CopyFrom(self.model)
        else:
            written, self._taken = self.model, True
        return Placement(written, view, target)

    def view(self, target: Target, keep_float: Sequence[str] = (), float_values: Sequence[str] = (),
             non_negative_inputs: Sequence[str] = (), *, batches: Sequence[Any] = ()) -> GraphView:  # fmt: skip
        """The view :meth:`place` decides (the same arguments), without a copy of the graph: a placement compared
        with another before either is written (its ``Placement`` takes the graph of the one placed).

        Raises:
            QdqConfigError: ``float_values`` names a tensor the graph does not have.
        """
        view = self._view(target, keep_float, non_negative_inputs, batches)
        unknown = [name for name in float_values if name not in view.values]
        if unknown:
            raise QdqConfigError(f"float_values names tensors the graph does not have: {unknown[:5]}")
        for name in float_values:
            view.keep_value_float(view.values[name], "its input tensor is kept float")
        return view

    def units(self, target: Target, keep_float: Sequence[str] = ()) -> list[tuple[str, ...]]:
        """The tensors of each activation quantizer of ``target``'s placement (one range each), in placement order:
        what leaving one unit float switches (:meth:`qdq.graphs.view.GraphView.keep_value_float`)."""
        return activation_groups(self._view(target, keep_float, ()))

    def values(self, names: Sequence[str], feed: Mapping[str, np.ndarray], *,
               threads: int | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        """The float tensors ``names`` of the prepared model on one batch (``feed``: graph input name -> array),
        computed by ONNX Runtime (one session of the model with those tensors as outputs)."""
        listed = list(names)
        with tempfile.TemporaryDirectory(prefix="qdq-values-") as folder:
            session = ort_session(probe_model(self.model, listed), threads=threads, folder=Path(folder))
            return dict(zip(listed, session.run(listed, dict(feed))))

    def _view(self, target: Target, keep_float: Sequence[str], non_negative_inputs: Sequence[str],
              batches: Sequence[Any] = ()) -> GraphView:  # fmt: skip
        keep = KeepFloat.of(keep_float)
        view = build_view(self.model, target)
        view.non_negative_data.update(non_negative_inputs)
        select_weighted(view, keep)
        apply_rules(view, target.placement_rules)
        select_attention(view, keep, attention_shapes(self.model, view, batches))
        keep_user_float(view, keep)
        return view


@dataclass
class Placement:
    """One placement of a :class:`PreparedModel`: its view (the quantizers, what stays float and why) and the graph
    it is written into (a copy of the prepared graph, or the graph itself; bias correction edits it in place)."""

    model: onnx.ModelProto
    view: GraphView
    target: Target

    def units(self) -> list[tuple[str, ...]]:
        """The tensors of each activation quantizer of this placement, in placement order."""
        return activation_groups(self.view)

    def write(self, ranges: Mapping[int, np.ndarray], path: str | Path, *,
              target_options: Mapping[str, Any] | None = None) -> Path:  # fmt: skip
        """Write the Q/DQ nodes of every quantizer with its float32 amax (``ranges``: ``id(quantizer)`` -> amax, 0-d
        for an activation, per channel for a weight) and finish the file for the target at ``path``."""
        inputs, outputs = [i.name for i in self.model.graph.input], [o.name for o in self.model.graph.output]
        with float_convs_said(self._float_convs):  # the rewrite's advice is for a model quantized without its target
            written = finish_onnx(self.model, path, self.target, target_options=target_options,
                                  io_names=(inputs, outputs), edits=[qdq_edit(self.view, ranges)])  # fmt: skip
        return written

    def _float_convs(self, convs: list[str]) -> str:
        """One sentence: how many Convs stay float on the target and why (the placement's reason, where it has
        one)."""
        reasons = {op.name: why for op in self.view.ops_of("Conv") if (why := self.view.float_ops.get(op.name))}
        first = next(iter(reasons), convs[0])
        if first in reasons:
            return (f"{len(convs)} Conv(s) stay float on {self.target.name} (e.g. {first}: {reasons[first]}); the "
                    "result's float_ops says why for each.")  # fmt: skip
        return (f"{len(convs)} Conv(s) stay float on {self.target.name} (e.g. {first}): a tensor they read or write "
                "stays float in the file (float_values or keep_float, or a pool whose ranges the runtime's int8 "
                "kernel refuses).")  # fmt: skip


def activation_groups(view: GraphView) -> list[tuple[str, ...]]:
    """The tensors of each activation quantizer of ``view`` (one range each), in placement order."""
    return [tuple(activation_values(q)) for q in view.quantizers() if not q.per_channel and q.sites]


def activation_values(quantizer: Quantizer) -> list[str]:
    """The tensors ``quantizer`` reads, sorted."""
    return sorted({site.value.name for site in quantizer.sites})


def values_ranges(view: GraphView, value_ranges: Mapping[str, np.ndarray] | None) -> dict[int, np.ndarray] | None:
    """Every activation quantizer's amax (by ``id``) from ``value_ranges`` (tensor name -> amax; the largest over
    its tensors), or None when one of them has a tensor without a range (then everything is calibrated)."""
    if not value_ranges:
        return None
    found = {}
    for quantizer in view.quantizers():
        if quantizer.per_channel:
            continue
        values = activation_values(quantizer)
        if any(name not in value_ranges for name in values):
            return None
        found[id(quantizer)] = np.max([np.asarray(value_ranges[name], np.float32) for name in values], axis=0)
    return found


def ranges_by_value(view: GraphView, ranges: Mapping[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensor name -> the amax of the activation quantizer of ``view`` that reads it (``ranges`` by ``id``)."""
    found: dict[str, np.ndarray] = {}
    for quantizer in view.quantizers():
        if not quantizer.per_channel and id(quantizer) in ranges:
            for name in activation_values(quantizer):
                found[name] = np.asarray(ranges[id(quantizer)], np.float32)
    return found

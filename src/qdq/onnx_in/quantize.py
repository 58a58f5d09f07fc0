"""``quantize_onnx``: an FP32 ONNX file in, a Q/DQ file for a target out, placed by the target's rules.

The third front end, next to PyTorch (:func:`qdq.quantize_model`) and Keras (:func:`qdq.keras.quantize_model`),
on the same placement language (:mod:`qdq.graphs.view`):

1. load and prepare the file (:mod:`qdq.onnx_in.load`: ``Constant`` weights as initializers, BatchNorm folded,
   opset >= 13; an already quantized file is refused), once: a :class:`~qdq.onnx_in.prepared.PreparedModel` (passed
   instead of a file, it is placed again without loading: what :func:`qdq.tune` does for every file it writes);
2. build its view (:mod:`qdq.onnx_in.view`), quantize what module replacement quantizes on the PyTorch path (the
   inputs and per-channel weights of Conv, ConvTranspose, Gemm, MatMul, average pools), run the target's rules,
   then keep float what the user asked to;
3. calibrate on ONNX Runtime (:mod:`qdq.onnx_in.calibrate`: one pass, every quantizer's statistics streamed into
   qdq's calibrators; ``auto``: :mod:`qdq.onnx_in.auto`), and warn about ranges that clip;
4. write the Q/DQ nodes (:mod:`qdq.onnx_in.materialize`) and finish like every qdq export
   (:func:`qdq.export.onnx_export.finish_onnx`: the target's rewrite, ``qdq.target`` in the file, ``onnx.checker``,
   an atomic write).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from qdq.calib.methods import get_method
from qdq.errors import QdqCalibrationWarning, QdqConfigError
from qdq.graphs import ops as vocab
from qdq.markdown import markdown_table
from qdq.onnx_in import auto as auto_ranges
from qdq.onnx_in.bias_correction import BiasShift, correct_biases
from qdq.onnx_in.calibrate import Statistics, WeightCache, collect, kept_parts, weight_ranges
from qdq.onnx_in.equalize import equalize as equalize_pairs
from qdq.onnx_in.equalize import settle
from qdq.onnx_in.materialize import quantizer_names
from qdq.onnx_in.prepared import Placement, PreparedModel, ranges_by_value, values_ranges
from qdq.onnx_in.stem import Placing, float_stem
from qdq.quantizer import STEP_TYPES
from qdq.targets import DEFAULT_TARGET, Target, resolve_target
from qdq.targets.onnxruntime.passes.biases import WIDENED_METADATA_KEY
from qdq.tensor_quant import low_precision_amax
from qdq.workflow.auto_calibration import AUTO, AutoResult, held_out
from qdq.workflow.collection import first_batches
from qdq.workflow.diagnostics import CalibrationReport, diagnose_statistics
from qdq.workflow.equalization import MEASURED_BATCHES, Scaling, equalization_summary
from qdq.workflow.progress import Progress

__all__ = ["OnnxQuantizeResult", "quantize_onnx"]

_TRT_FLOAT_BATCHES = 4  # calibration batches kept for the TensorRT 11 float16 conversion's value ranges
_BIAS_BATCHES = 8  # calibration batches kept for bias correction (the first ones)


@dataclass
class OnnxQuantizeResult:
    """What :func:`quantize_onnx` did.

    Attributes:
        path: the Q/DQ file written.
        target: the target's name.
        method: the calibration method's label (``"percentile 99.99"``; ``"auto: mse"``: the method auto chose).
        quantizers: the quantizers written (one range each), activations and weights.
        int8_ops: op type -> how many ops read every data input quantized (the ops the target can run in int8).
        float_ops: op name -> why it stays float (kept by the user, a rule's decision, control flow, a custom
            domain), for the ops that decide it.
        float_op_types: op type -> how many weighted or unknown ops stay float.
        calibration: what each activation range clips (:class:`qdq.workflow.diagnostics.CalibrationReport`).
        prepared: what preparing the graph changed (``constant_weights``, ``batchnorms_folded``, ``opset``).
        batches: calibration batches seen.
        seconds: wall time of calibration and of the whole call.
        changes: one line per placement decision.
        ranges: quantizer name -> float32 amax (0-d for an activation, per channel for a weight).
        value_ranges: tensor name -> float32 amax of the activation quantizer that reads it (pass it back as
            ``quantize_onnx(..., value_ranges=...)`` to place again without calibrating).
        bias_shifts: the biases bias correction changed, with the shift subtracted from each.
        widened_weights: op name -> the factor its weight step grew by so that its int32 bias fits at ``s_x * s_w``
            (the ``onnxruntime`` target's rewrite; the op stays int8).
        auto: with ``method="auto"``, what every candidate method scored and which was chosen
            (:class:`qdq.workflow.auto_calibration.AutoResult`).
        equalized: the convolution pairs cross-layer equalization rescaled
            (:class:`qdq.workflow.equalization.Scaling`: pass them back with ``value_ranges``).
    """

    path: Path
    target: str
    method: str
    quantizers: int
    int8_ops: dict[str, int]
    float_ops: dict[str, str]
    float_op_types: dict[str, int]
    prepared: dict[str, int]
    batches: int
    seconds: dict[str, float]
    calibration: CalibrationReport = field(default_factory=CalibrationReport, repr=False)
    changes: list[str] = field(default_factory=list, repr=False)
    ranges: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    value_ranges: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    bias_shifts: list[BiasShift] = field(default_factory=list, repr=False)
    widened_weights: dict[str, float] = field(default_factory=dict, repr=False)
    auto: AutoResult | None = field(default=None, repr=False)
    equalized: list[Scaling] = field(default_factory=list, repr=False)

    def report(self) -> str:
        """A Markdown summary: what runs in int8, what stays float and why."""
        lines = [f"# {self.path.name}: quantized for {self.target} ({self.method})", "",
                 f"{self.quantizers} quantizers, {self.batches} calibration batches, calibration "
                 f"{self.seconds.get('calibration', 0.0):.1f} s.", ""]  # fmt: skip
        if self.auto is not None:
            lines += [self.auto.summary() + ".", "", self.auto.table(), ""]
        if self.equalized:
            lines += [equalization_summary(self.equalized), ""]
        applied = [shift for shift in self.bias_shifts if shift.applied]
        if applied:
            worst = max(applied, key=lambda s: s.relative)
            constant = sum(len(s.constant) for s in self.bias_shifts)
            unmeasured = sum(len(s.unmeasured) for s in self.bias_shifts)
            lines += [f"Bias correction: {len(applied)} biases shifted by the mean error of their layer's "
                      f"quantization (largest: {worst.op}, {worst.relative:.3f} of its output's spread)"
                      + (f"; {constant} constant channels (no output spread)" if constant else "")
                      + (f"; {unmeasured} channel shifts not significant against their sampling error, not "
                         "applied" if unmeasured else "") + ".", ""]  # fmt: skip
        if self.prepared.get("output_shapes"):
            lines += [f"{self.prepared['output_shapes']} graph output(s) declared with a rank the graph does not "
                      "compute: written with the computed shape (ONNX's shape inference refuses the declaration).",
                      ""]  # fmt: skip
        if self.widened_weights:
            name, factor = max(self.widened_weights.items(), key=lambda item: item[1])
            lines += [f"Weight steps widened so that int32 biases fit: {len(self.widened_weights)} op(s) kept int8 "
                      f"(largest: {name}, x{factor:.3g}).", ""]  # fmt: skip
        rows = [[op, str(n)] for op, n in sorted(self.int8_ops.items())]
        lines += [markdown_table(["op type", "ops reading int8"], rows), ""] if rows else []
        floats = [[name, why] for name, why in sorted(self.float_ops.items())]
        if floats:
            lines += [markdown_table(["op kept float", "why"], floats), ""]
        return "\n".join(lines)


def quantize_onnx(
    model: str | Path | onnx.ModelProto | PreparedModel,
    calibration_data: Iterable[Mapping[str, np.ndarray]],
    path: str | Path,
    *,
    target: str | Target = DEFAULT_TARGET,
    method: str = "auto",
    num_batches: int | None = None,
    weight_method: str = "max",
    keep_float: Sequence[str] = (),
    target_options: Mapping[str, Any] | None = None,
    threads: int | None = None,
    progress: Progress = True,
    value_ranges: Mapping[str, np.ndarray] | None = None,
    float_values: Sequence[str] = (),
    bias_correction: bool = True,
    bias_shifts: Sequence[BiasShift] | None = None,
    equalize: bool | None = None,
    equalized: Sequence[Scaling] | None = None,
    **method_options: Any,
) -> OnnxQuantizeResult:
    """Quantize the FP32 ONNX ``model`` for ``target`` and write the Q/DQ file at ``path``.

    Args:
        model: a path to an ONNX file (external data next to it is read), an ``onnx.ModelProto``, or a
            :class:`~qdq.onnx_in.prepared.PreparedModel` (loaded and prepared once, placed again by each call).
        calibration_data: batches, each a dict of graph input name -> array (any batch size; dynamic axes free);
            a one-input model also takes plain arrays. Needed: qdq never calibrates on random data.
        path: the file to write (replaced atomically).
        target: a registered target (``"tensorrt"``, the default, or ``"onnxruntime"``): its placement rules
            decide where Q/DQ go, its rewrite finishes the file.
        method: a registered calibration method (:mod:`qdq.calib.methods`): ``"auto"`` (the default: the method
            whose quantized outputs stay closest to the float model's on held-out calibration batches, among every
            registered method computed from statistics: :mod:`qdq.workflow.auto_calibration`), ``"max"``,
            ``"entropy"``, ``"mse"``, ``"percentile"`` (``percentile=99.99``), or one you registered.
        num_batches: use at most this many batches.
        weight_method: the range of the per-channel weights (``"max"``, ``"mse"``, ``"percentile"``).
        keep_float: node names, op types (``"op:Concat"``) and name patterns (``"head.*"``) to keep float.
        target_options: the target's export options (``"tensorrt"``: ``{"float": "float16"}`` writes the float
            part in FP16 for TensorRT 11, measured on the first calibration batches; ``"onnxruntime"``:
            ``{"weights": "int8" | "uint8" | "auto"}``).
        threads: ONNX Runtime threads for calibration (default: its own).
        progress: progress bars on stderr (a string names the run).
        value_ranges: activation ranges by tensor name from an earlier call on the same file and target
            (``result.value_ranges``): when every activation quantizer's tensors have one, nothing is calibrated
            (a quantizer over several tensors takes the largest); otherwise calibration runs as usual. Weights are
            always measured from the file.
        float_values: activation tensors to leave float for every reader (their quantizers go; the ops that read
            them quantized stay float): what :func:`qdq.tune` switches.
        bias_correction: shift the bias of each quantized Conv, Gemm and linear MatMul by the mean error its
            input and weight quantization add on the first calibration batches (:mod:`qdq.onnx_in.bias_correction`;
            one more pass of the float model over up to 8 batches, no more than ``num_batches``); with
            ``method="auto"`` only where the held-out batches score higher with it (``result.auto``). ``False`` keeps
            the file's biases.
        bias_shifts: the shifts of an earlier call with the same ranges (``result.bias_shifts``, with
            ``value_ranges``): applied again to the layers still quantized, without measuring.
        equalize: rescale the channels between two int8 convolutions through their ReLU-like activation where that
            predicts less output noise (:mod:`qdq.workflow.equalization`; one more float pass over the first 32
            batches of a list, 8 of an iterator). Default: with ``method="auto"``.
        equalized: the scalings of an earlier call on the same file (``result.equalized``, with its
            ``value_ranges``): written again to the same pairs, float ones included, without measuring.
        method_options: the method's options (``percentile=99.9``).

    Returns:
        An :class:`OnnxQuantizeResult` (``result.report()`` says what runs in int8 and what stays float).

    Raises:
        QdqConfigError: a file that is not ONNX or is quantized already, no calibration data, a batch missing a
            graph input, an unknown target or method.
    """
    started = time.perf_counter()
    chosen = resolve_target(target)
    calibration_method = get_method(method)
    if calibration_method.model_level and calibration_method.name != AUTO:
        raise QdqConfigError(f"quantize_onnx: method {method!r} chooses its ranges with a pass over a PyTorch model; "
                             f"for an ONNX file use 'auto' or a method computed from statistics.")  # fmt: skip
    source = PreparedModel.load(model)
    data, first, kept = _first_batches(calibration_data)
    minima = _minima(kept, [i.name for i in source.model.graph.input])
    nonnegative = [name for name, low in minima.items() if low >= 0]
    placement = source.place(chosen, keep_float, float_values, nonnegative, copy=source is model,
                             batches=kept)  # a model loaded here is written itself
    proto, view = placement.model, placement.view
    calibrating = time.perf_counter()
    scalings = _equalized(placement, first[:num_batches] if value_ranges is None and (
        calibration_method.model_level if equalize is None else equalize) else [], threads, progress, equalized)
    ranges = values_ranges(view, value_ranges)
    batches, calibration = 0, CalibrationReport()
    weights = weight_ranges(proto, view, weight_method, weight_cache := WeightCache())  # the call's: computed once
    auto: AutoResult | None = None
    fit: list[Any] = []
    label = calibration_method.label(method_options)
    if ranges is None:
        statistics = collect(proto, view, data, calibration_method.calibrator, num_batches=num_batches,
                             threads=threads, progress=progress,
                             held_out=held_out if calibration_method.model_level else None)  # fmt: skip
        if calibration_method.model_level:
            fit = kept_parts(proto, kept[:_BIAS_BATCHES], held_out) if bias_correction else fit
            ranges, auto, meter = auto_ranges.select(proto, view, statistics, weights, threads=threads,
                                                        progress=progress)
        else:
            ranges = statistics.ranges(method, **method_options)
        batches = statistics.batches
        label = f"auto: {auto.chosen}" if auto else label
        calibration = _clipping(view, statistics, ranges, label)
        if auto is not None:
            placing = Placing(keep_float, float_values, nonnegative, kept, weight_method, threads, progress,
                              weight_cache)  # fmt: skip
            placement, ranges, weights = _stem(auto, source, placement, placing, ranges, statistics, weights,
                                               meter)
            view = placement.view
            scalings, ranges, weights = _settled(auto, placement, scalings, ranges, weights, statistics, placing)
    by_value = ranges_by_value(view, ranges)
    ranges.update(weights)
    _on_step_grid(view, ranges, chosen.step_float_type(target_options))
    if auto is not None:
        if bias_correction and fit:
            auto_ranges.bias_corrected(proto, view, ranges, fit, statistics.scored, auto, threads)
        bias_correction = bias_correction and bool(auto.bias_correction)
    seconds = {"calibration": time.perf_counter() - calibrating}
    names = quantizer_names(view)
    shifts: list[BiasShift] = []
    if bias_correction:
        known = bias_shifts if bias_shifts is not None or auto is None else auto.bias_shifts
        shifts = correct_biases(proto, view, ranges, kept[:min(_BIAS_BATCHES, num_batches or _BIAS_BATCHES)],
                                threads=threads, progress=progress, known=known)  # fmt: skip
    written = placement.write(ranges, path, target_options=_write_options(target_options, kept))
    seconds["total"] = time.perf_counter() - started
    return OnnxQuantizeResult(
        path=written, target=chosen.name, method=label, quantizers=len(ranges),
        int8_ops=_int8_ops(view), float_ops=_float_ops(view), float_op_types=_float_types(view),
        prepared=dict(source.changes), batches=batches, seconds=seconds, calibration=calibration,
        changes=list(view.changes),
        ranges={names[k]: v for k, v in ranges.items() if k in names}, value_ranges=by_value, bias_shifts=shifts,
        widened_weights=_widened_weights(proto), auto=auto, equalized=scalings,
    )  # fmt: skip


_Ranges = dict[int, np.ndarray]  # by quantizer id


def _first_batches(data: Iterable[Any] | None) -> tuple[Iterable[Any], list[Any], list[Any]]:
    """``data`` to read once, its first batches for equalization, and the first of those kept for bias correction
    and the float16 conversion (:func:`qdq.workflow.collection.first_batches`)."""
    if data is None:
        raise QdqConfigError("quantize_onnx needs calibration data; qdq never calibrates on random data.")
    data, first = first_batches(data, MEASURED_BATCHES)
    return data, first, first[: max(_TRT_FLOAT_BATCHES, _BIAS_BATCHES)]


def _equalized(placement: Placement, batches: Sequence[Any], threads: int | None, progress: Progress,
               known: Sequence[Scaling] | None) -> list[Scaling]:  # fmt: skip
    """Cross-layer equalization of the placement's graph, in place (:mod:`qdq.onnx_in.equalize`): measured on
    ``batches`` (none: not measured), or ``known``'s scalings written again."""
    if known is None and not batches:
        return []
    return equalize_pairs(placement.model, placement.view, batches, threads=threads, progress=progress, known=known)


def _settled(auto: AutoResult, placement: Placement, scalings: list[Scaling], ranges: _Ranges, weights: _Ranges,
             statistics: Statistics, placing: Placing) -> tuple[list[Scaling], _Ranges, _Ranges]:  # fmt: skip
    """``auto``'s held-out check of the equalization (:func:`qdq.onnx_in.equalize.settle`, recorded in
    ``auto.equalized`` and ``auto.equalization``): the scalings kept, the activation and weight ranges to write."""
    kept, ranges, weights, auto.equalization = settle(placement.model, placement.view, scalings, ranges, weights,
                                                      statistics.scored, auto.chosen, placing.weight_method,
                                                      placing.threads, placing.weight_cache)  # fmt: skip
    auto.equalized = kept
    return kept, ranges, weights


def _stem(auto: AutoResult, source: PreparedModel, placement: Placement, placing: Placing, ranges: _Ranges,
          statistics: Statistics, weights: _Ranges,
          meter: auto_ranges.Meter | None) -> tuple[Placement, _Ranges, _Ranges]:  # fmt: skip
    """``auto``'s float stem (:func:`qdq.onnx_in.stem.float_stem`, recorded in ``auto.stem``): the placement, its
    activation ranges and its weight ranges, with the stem float where it is kept (``meter``: ``select``'s, which
    scores the placement as it is)."""
    auto.stem, stemmed = float_stem(source, placement, placing, ranges, auto_ranges.held_out_halves(statistics),
                                    None if meter is None else partial(meter, ranges))  # fmt: skip
    if stemmed is None:
        return placement, ranges, weights
    view, ranges = stemmed
    return Placement(placement.model, view, placement.target), ranges, weight_ranges(
        placement.model, view, placing.weight_method, placing.weight_cache)


def _write_options(target_options: Mapping[str, Any] | None, kept: Sequence[Any]) -> dict[str, Any]:
    """The target's options for the write: a float16/bfloat16 remainder gets the first calibration batches (which
    tensors stay float32 is measured on them) unless the options give their own."""
    options = dict(target_options or {})
    if "float" in options and "calibration_data" not in options and str(options["float"]) not in ("float32", "fp32"):
        options["calibration_data"] = list(kept[:_TRT_FLOAT_BATCHES])
    return options


def _widened_weights(model: onnx.ModelProto) -> dict[str, float]:
    """The weight steps the target's rewrite widened for their int32 biases, as the written file records them."""
    recorded = {p.key: p.value for p in model.metadata_props}.get(WIDENED_METADATA_KEY)
    return {str(k): float(v) for k, v in json.loads(recorded).items()} if recorded else {}


def _minima(batches: Sequence[Any], inputs: Sequence[str]) -> dict[str, float]:
    """Graph input name -> its least value over ``batches``."""
    found: dict[str, float] = {}
    for batch in batches:
        named = batch if isinstance(batch, Mapping) else dict(zip(inputs[:1], [batch])) if len(inputs) == 1 else {}
        for name in inputs:
            if name in named:
                found[name] = min(found.get(name, math.inf), float(np.min(np.asarray(named[name]))))
    return found


def _int8_ops(view: Any) -> dict[str, int]:
    found: Counter[str] = Counter()
    for op in view.ops:
        inputs = [i for i, _ in op.data_inputs if op.type != vocab.ATTENTION or i < 3]  # its mask is added in float
        if inputs and op.name not in view.float_ops and all(view.reads_quantized(op, i) for i in inputs):
            found[op.type] += 1
    return dict(found)


def _float_ops(view: Any) -> dict[str, str]:
    found = dict(view.float_ops)
    for op in view.ops:
        if op.type in vocab.WEIGHTED and op.name not in found and not view.is_quantized(op):
            found[op.name] = "no quantizer here: its inputs are not both activations and constant weights"
        elif op.type == "If":
            found.setdefault(op.name, "control flow: the If itself stays; its branches' ops are placed as the graph's")
        elif ":" in op.type or op.type in ("Loop", "Scan"):
            found.setdefault(op.name, "control flow or a custom domain: qdq leaves it float (a loop's body too)")
    return found


def _float_types(view: Any) -> dict[str, int]:
    found: Counter[str] = Counter()
    for op in view.ops:
        if (op.type in vocab.WEIGHTED and not view.is_quantized(op)) or op.name in view.float_ops:
            found[op.type] += 1
    return dict(found)


def _on_step_grid(view: Any, ranges: dict[int, np.ndarray], step_type: str) -> None:
    """Each range rounded (in place) so that its step is a number of ``step_type`` (TensorRT 11's FP16 scales), as
    the PyTorch path's quantizers do: the file then holds the grid that was calibrated."""
    dtype = STEP_TYPES[step_type]
    if dtype is None:
        return
    for quantizer in view.quantizers():
        amax = torch.from_numpy(np.asarray(ranges[id(quantizer)], np.float32))
        ranges[id(quantizer)] = low_precision_amax(amax, dtype, 8, quantizer.unsigned).numpy()


def _clipping(view: Any, statistics: Statistics, ranges: Mapping[int, np.ndarray], label: str) -> CalibrationReport:
    """The PyTorch path's clipping diagnostics for the ranges chosen here; one warning for the flagged ones."""
    names = quantizer_names(view)
    rows = [diagnose_statistics(names[key], calibrator, ranges[key], label)
            for key, calibrator in statistics.calibrators.items()]  # fmt: skip
    report = CalibrationReport([row for row in rows if row is not None])
    text = report.warning_text()
    if text is not None:
        warnings.warn(text.replace("qdq.calibration_report(model)", "result.calibration"), QdqCalibrationWarning,
                      stacklevel=3)  # fmt: skip
    return report

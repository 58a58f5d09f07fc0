"""``method="auto"``, the default calibration: one method for the whole model, chosen by how close the quantized
model's outputs stay to the float model's on calibration batches held out from setting the ranges.

No calibration method is right for every model: max keeps the outliers a detector's box coordinates need and
wastes the grid of a recognizer whose activations have a long sparse tail; percentile is the reverse on a sentence
encoder; entropy destroys a sparse tail where the signal lives. The choice is made by measuring, without labels:

0. **Equalization** (:mod:`qdq.workflow.equalization`): where two quantized convolutions have a ReLU-like
   activation between them, the channels of that activation are rescaled (the first convolution's output channels
   up, the second's input channels down: the same float function) where a noise model of the second predicts it
   pays, from the activation's per-channel peaks on the first batches; undone once the stem is settled where the
   held-out score is :data:`~qdq.workflow.equalization.UNDO_DB` or more lower with it than with the weights as they
   were (``AutoResult.equalized``, ``AutoResult.equalization``).
1. **Statistics**, one pass: the float model runs over the calibration batches and every activation quantizer
   collects its statistics (histograms). Samples are **held out** (:func:`held_out`): the last quarter of every
   batch the front end can split (its inputs say which axis holds the samples), one whole batch in
   :data:`HOLDOUT_EVERY` of those it cannot, from at most :data:`MAX_HOLDOUT` batches: their statistics are kept
   apart and the float model's outputs on them are recorded.
2. **Candidates**: every registered calibration method computed from statistics
   (:data:`qdq.calib.CALIBRATION_METHODS`: max, entropy, mse, percentile, and those registered with
   :func:`qdq.calib.register_method`), with its default options, sets every activation range from the statistics
   of the other batches (:func:`candidates`).
3. **Score**: the model quantized with each candidate's ranges runs on the held-out batches; its
   :func:`output_fidelity` against the float outputs is the candidate's score (dB, higher is closer).
4. **Choice** (:func:`choose`): the best score; scores within :data:`TIE_DB` of the best count as equal and the
   earliest candidate of the registry's order wins (max first: the widest ranges, which also cover data calibration
   did not see). A candidate whose ranges the diagnostics call destructive (one clips at least
   :data:`~qdq.workflow.diagnostics.CLIPPED_ENERGY_LIMIT` of its activation's energy) is kept only when it scores
   :data:`DESTRUCTIVE_MARGIN_DB` above the best candidate that is not, and never silently: the clipping warning
   names its quantizers (outliers that a saturating layer discards anyway carry energy, not signal).
5. **Refinement** (:mod:`qdq.workflow.refinement`): the quantizers whose candidate ranges disagree most each try
   the other candidates' ranges on the held-out batches, one at a time; a change is kept where the score measurably
   rises (``AutoResult.refinement``).
6. Each quantizer's method's ranges are then computed from the statistics of **every** batch, held-out ones
   included, with the options it was scored with.
7. **The stem** (:mod:`qdq.workflow.stem`): the weighted ops nearest the inputs stay float where int8 there costs
   the held-out score more than a cost per level (``AutoResult.stem``).
8. **Bias correction** (the PyTorch door here, the ONNX door in :mod:`qdq.onnx_in.auto`): each quantized layer's
   mean output error measured on the calibration samples not held out and taken out of its bias, kept where the
   held-out score rises by :data:`TIE_DB` (:mod:`qdq.workflow.bias_correction`).

When nothing can be held out (fewer than :data:`HOLDOUT_EVERY` batches, none of which can be split), the candidates
are scored on the first calibration batches themselves (:attr:`AutoResult.held_out` is False and the report says
so).

Every front end runs it with the same candidates, fidelity and choice: :func:`select_amax` for PyTorch models
(``qdq.calibrate(model, data)``), :func:`qdq.onnx_in.auto.select` for ONNX files (``qdq.quantize_onnx``),
:func:`qdq.keras.auto.select` for Keras models (``qdq.keras.calibrate(model, data)``).

Cost, in runs of the model: a float pass over the first batches (equalization); one statistics pass over the
calibration data (what any histogram method costs) and each candidate's ranges from the statistics; on the held-out
samples (a quarter at most, from :data:`MAX_HOLDOUT` batches at most) one quantized run per candidate, per
refinement trial (half the samples each) and per stem level tried, and two to judge equalization; bias correction's
pass over the batches not held out (each quantized Conv and Linear layer run twice) and one held-out run to judge
it. Every activation and output is reduced on the model's device. The measured phases: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qdq.calib.methods import CALIBRATION_METHODS, CalibrationMethod, get_method
from qdq.calib.weights import calibrate_weights
from qdq.graphs.fx_view import trace_view
from qdq.graphs.view import GraphView
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer
from qdq.utils.modes import eval_mode
from qdq.workflow.bias_correction import BiasShift, correct_biases, undo
from qdq.workflow.calibration import load_amax
from qdq.workflow.collection import ForwardFn, collect_split, default_forward, first_batches, named_quantizers
from qdq.workflow.diagnostics import CLIPPED_ENERGY_LIMIT, diagnose_statistics
from qdq.workflow.distributed import all_reduce_sum, unwrap, world_size
from qdq.workflow.equalization import MEASURED_BATCHES, Scaling, equalize_modules, kept, swap_tensors
from qdq.workflow.fidelity import FidelityMeter, output_fidelity
from qdq.workflow.progress import Progress, progress_bar
from qdq.workflow.refinement import Halves, Refinement, candidate_score, halves, refine, samples_of
from qdq.workflow.stem import StemChoice, StemTimer, StemTiming, choose_stem, stem_levels

__all__ = [
    "AUTO",
    "BIAS_CORRECTION",
    "DESTRUCTIVE_MARGIN_DB",
    "HOLDOUT_EVERY",
    "MAX_HOLDOUT",
    "TIE_DB",
    "AutoResult",
    "FidelityMeter",
    "candidate",
    "candidates",
    "choose",
    "held_out",
    "output_fidelity",
    "select_amax",
]

_log = logging.getLogger(__name__)

#: the method's name (``qdq.calibrate(model, data, method="auto")``, the default)
AUTO = "auto"
#: one calibration batch in this many is held out from setting the ranges, to score the candidates on
HOLDOUT_EVERY = 4
#: at most this many batches are held out (the scoring's cost is candidates x held-out batches)
MAX_HOLDOUT = 8
#: scores closer than this (dB) to the best count as equal: the earliest such candidate wins
TIE_DB = 0.1
#: a candidate whose ranges clip destructively is kept only when it scores this much (dB) above the best one that
#: does not (and the clipping warning then names its quantizers)
DESTRUCTIVE_MARGIN_DB = 3.0
#: how a candidate scored with its biases corrected is labelled: ``"<method> + bias correction"``
BIAS_CORRECTION = "bias correction"


def held_out(index: int, taken: int, samples: int | None = None) -> int:
    """How many of the last samples of calibration batch ``index`` (0-based) are held out, ``taken`` batches having
    given some before it. A batch of ``samples`` >= :data:`HOLDOUT_EVERY` samples (its front end can split it: None
    when it cannot) gives its last quarter; a batch that cannot be split is held out whole, one in
    :data:`HOLDOUT_EVERY` (``samples`` or 1 returned). At most :data:`MAX_HOLDOUT` batches give held-out samples."""
    if taken >= MAX_HOLDOUT:
        return 0
    if samples is not None and samples >= HOLDOUT_EVERY:
        return samples // HOLDOUT_EVERY
    return (samples or 1) if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else 0


#: the candidate bins a searching method tries: every 4th (of 4096 bins, 0.1 % of the range apart), when it is
#: scored and in the final ranges: mse's search over every bin was most of auto's cost (``benchmarks/RESULTS.md``)
SCORING_STRIDE = 4


def candidates() -> list[tuple[CalibrationMethod, dict[str, Any]]]:
    """The registered methods computed from statistics, in registration order, each with the options it is scored
    with: its defaults, except that a search over histogram bins (a ``stride`` option: mse, entropy) tries every
    :data:`SCORING_STRIDE`-th bin. The chosen method's final ranges use the options it was scored with."""
    return [(method, {"stride": SCORING_STRIDE} if "stride" in method.options else {})
            for method in map(get_method, CALIBRATION_METHODS)]  # fmt: skip


@dataclass
class AutoResult:
    """What ``auto`` chose, and what every candidate scored.

    Attributes:
        chosen: the label of the chosen method (``"mse"``, ``"percentile 99.99"``).
        scores: candidate label -> :func:`output_fidelity` of the model quantized with its ranges (dB, higher is
            closer to the float model).
        clipping: candidate label -> the quantizers whose range under it clips at least
            :data:`~qdq.workflow.diagnostics.CLIPPED_ENERGY_LIMIT` of their activation's energy (destructive).
        batches: the batches scored on.
        held_out: whether those batches were held out from setting the ranges (False with fewer than
            :data:`HOLDOUT_EVERY` calibration batches: scored on calibration batches).
        seconds: wall time of the statistics pass (``"statistics"``) and of the scoring (``"scoring"``).
        bias_correction: whether bias correction is kept (the ONNX front end scores the chosen method with it too,
            under the label ``"<method> + bias correction"``); None where it was not scored.
        refinement: the quantizers that took another method's range after the choice
            (:mod:`qdq.workflow.refinement`); None where the front end does not refine.
        stem: the weighted ops nearest the inputs left float where that measurably pays (:mod:`qdq.workflow.stem`);
            None where the front end does not try it.
        bias_base: the held-out score the bias correction row is compared with: the model as it is written without
            the correction (the refined ranges, the stem float); None where the correction was not scored.
        bias_shifts: the bias correction measured for its score (the ONNX front end: the file applies these
            shifts instead of measuring them again; each layer's shift depends on its own input and weight ranges
            only, measured on the calibration batches not held out); empty where none was measured.
        equalized: the convolution pairs rescaled before the statistics were collected
            (:mod:`qdq.workflow.equalization`), where that was kept.
        equalization: the held-out scores (dB) of the model with those pairs rescaled and with its weights as they
            were, each at its own ranges; None where it was not scored (no pair predicted a gain).
    """

    chosen: str
    scores: dict[str, float]
    clipping: dict[str, list[str]] = field(default_factory=dict)
    batches: int = 0
    held_out: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    bias_correction: bool | None = None
    refinement: Refinement | None = None
    stem: StemChoice | None = None
    bias_shifts: list[BiasShift] = field(default_factory=list, repr=False)
    bias_base: float | None = None
    equalized: list[Scaling] = field(default_factory=list, repr=False)
    equalization: tuple[float, float] | None = None

    def summary(self) -> str:
        """One line: the choice, its score and the runner-up's."""
        where = "held-out calibration batches" if self.held_out else "calibration batches (too few to hold one out)"
        row = f"{self.chosen} + {BIAS_CORRECTION}"
        ranked = sorted(self.scores, key=lambda label: -_finite(self.scores[label]))
        others = ", ".join(f"{label} {self.scores[label]:.1f} dB" for label in ranked
                           if label != self.chosen and (label != row or self.bias_base is None))  # fmt: skip
        corrected = {True: ", with bias correction", False: ", without bias correction", None: ""}[self.bias_correction]
        refined = f"; refined: {self.refinement.summary()}" if self.refinement is not None else ""
        stem = f"; {self.stem.summary()}" if self.stem is not None else ""
        if self.equalization is not None:
            scored = f"{self.equalization[0]:.1f} dB with it, {self.equalization[1]:.1f} dB without"
            stem += (f"; {len(self.equalized)} convolution pair(s) equalized ({scored})" if self.equalized
                     else f"; equalization not kept ({scored})")  # fmt: skip
        elif self.equalized:
            stem += f"; {len(self.equalized)} convolution pair(s) equalized"
        bias = ""
        if self.bias_correction is not None and self.bias_base is not None:
            bias = (f"; bias correction {'kept' if self.bias_correction else 'not kept'}: "
                    f"{self.scores.get(row, math.nan):.1f} dB with it, {self.bias_base:.1f} dB without")  # fmt: skip
        return (f"auto: {self.chosen}{corrected} ({self.scores[self.chosen]:.1f} dB output fidelity on {self.batches} "
                f"{where}; {others}{refined}{stem}{bias})")  # fmt: skip

    def table(self) -> str:
        """Markdown table: each candidate's fidelity, whether it clips destructively, and which was chosen."""
        kept = f"{self.chosen} + {BIAS_CORRECTION}" if self.bias_correction else self.chosen
        rows = [[label, f"{score:.2f}", _clips(self.clipping.get(label, [])), "chosen" if label == kept else ""]
                for label, score in self.scores.items()]  # fmt: skip
        legend = ("output fidelity: per output feature, 10 log10(variance of the float output / mean squared "
                  "error), averaged; higher is closer to the float model. destructive: quantizers whose range clips "
                  f">= {CLIPPED_ENERGY_LIMIT:.0%} of their activation's energy (chosen for the whole model only "
                  f"{DESTRUCTIVE_MARGIN_DB:g} dB above the best candidate that is not).")  # fmt: skip
        if self.bias_correction is not None:
            legend += (" The bias correction row is the model as it is written (the refined ranges, the stem float) "
                       "with its biases corrected" + (f", against {self.bias_base:.2f} dB without them." if
                                                      self.bias_base is not None else "."))  # fmt: skip
        table = markdown_table(["method", "output fidelity (dB)", "destructive", ""], rows) + "\n\n" + legend
        if self.refinement is not None and self.refinement.changes:
            table += f"\n\nRefined ({self.refinement.summary()}):\n\n{self.refinement.table()}"
        if self.stem is not None and self.stem.scores:
            table += f"\n\nThe stem ({self.stem.summary()}):\n\n{self.stem.table()}"
        return table


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def _clips(names: list[str]) -> str:
    if not names:
        return ""
    return f"{len(names)}: {', '.join(names[:3])}" + (", ..." if len(names) > 3 else "")


def candidate(label: str) -> tuple[CalibrationMethod, dict[str, Any]]:
    """The registered method of a candidate's label (``"percentile 99.99"`` -> percentile) and the options it is
    scored with: its final ranges use them too (what was scored is what is written)."""
    return next((method, options) for method, options in candidates() if method.label(options) == label)


def choose(scores: Mapping[str, float], clipping: Mapping[str, Sequence[str]]) -> str:
    """The label ``auto`` keeps (see the module docstring, 4.): ``scores`` in the candidates' order."""
    labels = list(scores)
    best = _earliest_best(labels, scores)
    safe = [label for label in labels if not clipping.get(label)]
    if not clipping.get(best) or not safe:
        return best
    fallback = _earliest_best(safe, scores)
    return best if _finite(scores[best]) >= _finite(scores[fallback]) + DESTRUCTIVE_MARGIN_DB else fallback


def _earliest_best(labels: Sequence[str], scores: Mapping[str, float]) -> str:
    top = max(_finite(scores[label]) for label in labels)
    if top == -math.inf:
        return labels[0]
    return next(label for label in labels if _finite(scores[label]) >= top - TIE_DB)


def destructive(named_calibrators: Mapping[str, Any], ranges: Mapping[str, Any], label: str) -> list[str]:
    """The quantizers (of ``named_calibrators``) whose range in ``ranges`` the diagnostics call destructive."""
    found = []
    for name, calibrator in named_calibrators.items():
        row = diagnose_statistics(name, calibrator, ranges.get(name), label)
        if row is not None and row.clipping_error is not None and row.clipping_error >= CLIPPED_ENERGY_LIMIT:
            found.append(name)
    return found


# -- the PyTorch front end -------------------------------------------------------------------------------------


def select_amax(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_batches: int | None = None,
    weight_method: str | None = "max",
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    strict: bool = True,
    bias_correction: bool = True,
    equalize: bool = True,
) -> AutoResult:
    """``auto`` on a PyTorch model: collect the statistics (holding batches out), score every candidate, load the
    chosen method's ranges from every batch's statistics, refine them, leave the stem float where that pays, and
    correct the quantized layers' biases where that scores higher (see the module docstring).

    Args:
        model: the quantized model (its activation quantizers' statistics are collected here, with histograms).
        data: calibration batches, read once (fed with ``forward_fn``).
        num_batches: use the first ``num_batches`` batches (None: all).
        weight_method: how weight quantizers get their range (:func:`qdq.load_amax`); None keeps them.
        progress: bars for the statistics pass and the scoring.
        strict: a quantizer that saw no data is an error (else it stays dynamic, with a warning).
        bias_correction: measure each quantized Conv and Linear layer's mean output shift on the calibration
            batches not held out and subtract it from its bias (:mod:`qdq.workflow.bias_correction`), kept when the
            held-out score rises by :data:`TIE_DB` (``qdq.calibrate(model, data, bias_correction=False)``: never).
        equalize: first rescale the channels between two quantized convolutions through their ReLU-like activation
            where that predicts less output noise (:mod:`qdq.workflow.equalization`; the modules' parameters change in
            place; a float pass over the first batches; not across several processes, whose data would scale each
            rank's copy differently).

    Returns:
        An :class:`AutoResult`; the model is left with the chosen method's ranges (each quantizer's
        ``amax_method`` reads ``"auto: <method>"``).
    """
    started = time.perf_counter()
    forward = forward_fn or default_forward
    module = unwrap(model)
    equalized: list[Scaling] = []
    if equalize and weight_method is not None and world_size() < 2:  # the weights' ranges are recomputed after it
        data, first = first_batches(data, min(MEASURED_BATCHES, num_batches or MEASURED_BATCHES))
        view, _ = _traced(model)
        equalized = equalize_modules(model, view, first, forward, progress) if view is not None else []
    held = collect_split(model, data, held_out, num_batches=num_batches, calibrator="histogram", forward_fn=forward,
                         progress=progress)  # fmt: skip
    statistics = time.perf_counter()
    scored = held.batches if held.batches else held.first
    fit = {name: q._calibrator for name, q in named_quantizers(module, weights=False) if q._calibrator is not None}
    scores: dict[str, float] = {}
    clipping: dict[str, list[str]] = {}
    grid = candidates()
    amaxes: dict[str, dict[str, torch.Tensor]] = {}
    parts = halves(scored, lambda pair: samples_of(_outputs(pair[1])), _rows)
    by_half: dict[str, Halves | None] = {}  # the refinement starts from the chosen one's

    def meter(pairs: Sequence[Any]) -> FidelityMeter:
        return _meter(model, pairs, forward)

    for method, options in progress_bar(grid, progress, f"auto: scoring {len(grid)} methods"):
        label = method.label(options)
        load_amax(model, method.name, weight_method=weight_method, strict=strict, warn=False, **options)
        amaxes[label] = {n: q.amax.detach().clone() for n, q in named_quantizers(module, weights=False)
                         if q.amax is not None}  # fmt: skip
        clipping[label] = destructive(fit, amaxes[label], label)
        scores[label], by_half[label] = candidate_score(meter, parts, scored)
    chosen = choose(scores, clipping)
    selection, refinement = _refine(model, amaxes, chosen, clipping, parts, forward, by_half.get(chosen))
    for name, calibrator in held.calibrators.items():
        if name in fit:  # not a quantizer the end of calibration switched off (attention outside a target's shapes)
            fit[name].merge(calibrator)
    _load_selection(model, chosen, selection, weight_method, strict)
    view, untraced = _traced(model)
    stem = _float_stem(model, view, untraced, parts, forward)
    before = stem.scores[stem.levels] if stem.scores else _score(model, scored, forward)  # the model as it is now
    equalized, before, equalization = _settled(model, equalized, scored, forward, before, chosen, weight_method)
    corrected = (_bias_correction(model, held.fit, scored, forward, before, scores, chosen, _norms_after(model, view))
                 if bias_correction else None)  # fmt: skip
    result = AutoResult(chosen, scores, clipping, len(scored), bool(held.batches),
                        {"statistics": statistics - started, "scoring": time.perf_counter() - statistics},
                        corrected, refinement=refinement, stem=stem,
                        bias_base=before if corrected is not None else None, equalized=equalized,
                        equalization=equalization)  # fmt: skip
    _log.info("%s", result.summary())
    return result


Scored = list[tuple[Any, Any]]  # held-out batches, each with the float model's output on it


def _settled(model: nn.Module, scalings: list[Scaling], scored: Scored, forward: ForwardFn, before: float,
             chosen: str, weight_method: str | None) -> tuple[list[Scaling], float, tuple[float, float] | None]:
    """Equalization kept unless the held-out samples clearly score it lower (:func:`qdq.workflow.equalization.kept`):
    the model as it is now against its parameters as they were, each pair's activation at the range the chosen
    method gives its own statistics, the two convolutions' weight ranges computed again. Returns the scalings kept,
    the model's score and both scores (None where nothing was scored)."""
    method, options = candidate(chosen)
    root = unwrap(model)  # ``before``: the model's score as the stem measured it, kept as bias correction's baseline
    activations: list[tuple[TensorQuantizer, Any]] = [
        (s.handles["quantizer"], s.histogram) for s in scalings
        if isinstance(s.handles.get("quantizer"), TensorQuantizer) and s.histogram is not None
    ]  # fmt: skip
    if not scalings or weight_method is None or len(activations) < len(scalings):
        return scalings, before, None
    ranges = [method.compute_amax(h, **method.resolve_options(options)) for _, h in activations]
    if any(amax is None for amax in ranges):
        return scalings, before, None
    modules = [root.get_submodule(path) for s in scalings for path in s.handles["modules"]]
    with_it = _score(model, scored, forward)  # the same measure as without: the whole of the held-out samples
    weights = [getattr(module, "weight_quantizer", None) for module in modules]
    quantizers = [q for q, _ in activations] + [w for w in weights if isinstance(w, TensorQuantizer)]
    saved = [(q, None if q.amax is None else q.amax.detach().clone(), q.amax_method) for q in quantizers]
    # a parameter two pairs changed (a conv without a BatchNorm, second of one pair and first of the next): the
    # earliest original wins
    equalized = swap_tensors(model, {key: value for s in reversed(scalings) for key, value in s.originals.items()})
    for (quantizer, _), amax in zip(activations, ranges, strict=True):
        quantizer.amax, quantizer.amax_method = amax, f"{AUTO}: {chosen}"
    for module in modules:
        calibrate_weights(module, method=weight_method)
    plain = _score(model, scored, forward)
    if not kept(with_it, plain):
        return [], plain, (with_it, plain)
    swap_tensors(model, equalized)
    for quantizer, amax, label in saved:
        quantizer.amax, quantizer.amax_method = amax, label
    return scalings, before, (with_it, plain)


def _refine(model: nn.Module, amaxes: Mapping[str, Mapping[str, torch.Tensor]], chosen: str,
            clipping: Mapping[str, list[str]], parts: tuple[Scored, Scored] | None, forward: ForwardFn,
            start: tuple[FidelityMeter, FidelityMeter] | None) -> tuple[dict[str, str], Refinement]:  # fmt: skip
    """:func:`qdq.workflow.refinement.refine` of the model's activation quantizers (each trial loads the selected
    ranges and runs the model on half of the held-out batches, ``parts``; ``start``: the chosen candidate's meters
    on them, already run)."""
    quantizers = dict(named_quantizers(unwrap(model), weights=False))

    def score(selection: Mapping[str, str], half: int) -> FidelityMeter:
        for name, label in selection.items():
            quantizers[name].amax = amaxes[label][name]
        return _meter(model, parts[half] if parts else [], forward)

    names = {name: name for name in amaxes[chosen]}
    return refine(amaxes, chosen, score if parts else None, names, clipping, start=start)


def _bias_correction(model: nn.Module, fit: Sequence[Any], scored: Scored, forward: ForwardFn, before: float,
                     scores: dict[str, float], chosen: str, norms: Mapping[str, str]) -> bool | None:  # fmt: skip
    """Correct the model's biases on ``fit`` (:func:`qdq.workflow.bias_correction.correct_biases`, ``norms`` as it
    takes them) and keep them where the score on ``scored`` rises by :data:`TIE_DB` above ``before`` (the model's
    score as it is; the correction's row in ``scores``); None where nothing was shifted."""
    shifts = correct_biases(model, fit, forward, norms=norms)
    if not any(shift.applied for shift in shifts):
        undo(model, shifts)
        return None
    after = scores[f"{chosen} + {BIAS_CORRECTION}"] = _score(model, scored, forward)
    if _finite(after) >= _finite(before) + TIE_DB:
        return True
    undo(model, shifts)
    return False


def _traced(model: nn.Module) -> tuple[GraphView | None, str]:
    """The torch.fx view of the model (:func:`qdq.graphs.fx_view.trace_view`), or None and why it does not trace."""
    try:
        with warnings.catch_warnings():  # a model torch.fx warns about is refused, or traced: nothing to say
            warnings.simplefilter("ignore")
            return trace_view(unwrap(model)), ""
    except Exception as err:  # torch.fx raises many kinds (TraceError, TypeError, NotImplementedError...)
        return None, f"torch.fx cannot trace the model ({type(err).__name__})"


def _norms_after(model: nn.Module, view: GraphView | None) -> dict[str, str]:
    """Layer name -> the BatchNorm (in eval mode) that alone reads its output, on the model's ``view`` ({} without
    one)."""
    if view is None:
        return {}
    root = unwrap(model)
    found = {}
    for op in view.ops:
        readers = [reader for value in op.outputs for reader, _ in value.readers]
        norm = readers[0] if len(readers) == 1 else None
        if (op.ref.op == "call_module" and norm is not None and norm.type == "BatchNormalization"
                and norm.ref.op == "call_module"):  # fmt: skip
            module = root.get_submodule(str(norm.ref.target))
            if not module.training and getattr(module, "running_mean", None) is not None:
                found[str(op.ref.target)] = str(norm.ref.target)
    return found


def _float_stem(model: nn.Module, view: GraphView | None, untraced: str, parts: tuple[Scored, Scored] | None,
                forward: ForwardFn) -> StemChoice:  # fmt: skip
    """:func:`qdq.workflow.stem.choose_stem` of the model's quantized modules on its ``view`` (None: it does not
    trace, ``untraced`` says why): a trial disables the quantizers the stem's ops read their inputs and weights
    through; the levels the scores keep are timed where the model's target can time a file here
    (:func:`_stem_timer`); those of the levels kept stay disabled (the modules run, and export, float)."""
    if parts is None:
        return choose_stem([], None)
    if view is None:
        return StemChoice(skipped=untraced)
    names = {op.name: str(op.ref.target) if op.ref.op == "call_module" else op.name for op in view.ops}
    handles: dict[str, list[TensorQuantizer]] = {}
    for op in view.ops:
        found = (view.quantizer_at(op, index) for index in range(len(op.inputs)))
        handles[names[op.name]] = [h for q in found if q is not None for h in q.handles if h.is_quantizing]

    def score(ops: list[str], half: int) -> FidelityMeter:
        off = [h for name in ops for h in handles[name]]
        for quantizer in off:
            quantizer.disable()
        try:
            return _meter(model, parts[half], forward)
        finally:
            for quantizer in off:
                quantizer.enable()

    levels = [[names[name] for name in level] for level in stem_levels(view)]
    choice = choose_stem(levels, score, _stem_timer(model, parts, lambda ops: [h for n in ops for h in handles[n]]))
    for name in choice.ops:
        for quantizer in handles[name]:
            quantizer.disable()
    return choice


def _stem_timer(model: nn.Module, parts: tuple[Scored, Scored],
                quantizers: Callable[[list[str]], list[TensorQuantizer]]) -> StemTimer | None:  # fmt: skip
    """``timer(ops)`` for :func:`~qdq.workflow.stem.choose_stem`, as the ONNX door times its stem: the calibrated
    model exported for its placed target twice (``quantizers(ops)`` off, then on) and the two files timed on one
    sample of the first held-out batch on the target's own runtime; None where that runtime cannot time a file here
    (not installed, an engine builder such as TensorRT), the model was not placed for a target, or under
    torch.distributed. A model that does not export is not timed (``timer`` returns None)."""
    from qdq.runtime.backend import timing_backend
    from qdq.targets import get_target
    from qdq.targets.marks import placed_target

    target = placed_target(model)
    backend = timing_backend(get_target(target).native_runtime) if target is not None else None
    first = parts[0][0][0] if parts[0] else None  # the first held-out (batch, float output) pair's batch
    if backend is None or first is None or world_size() > 1:
        return None
    example = _sliced(first, slice(0, 1))

    def timer(ops: list[str]) -> StemTiming | None:
        with tempfile.TemporaryDirectory(prefix="qdq-stem-") as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the files are timed, not used
            try:
                int8 = _exported(model, example, Path(folder) / "int8.onnx", [])
                stem = _exported(model, example, Path(folder) / "stem.onnx", quantizers(ops))
                return StemTiming.measure(int8, stem, backend.name)
            except Exception:  # a model that does not export, or whose file does not run, keeps what its scores chose
                return None

    return timer


def _exported(model: nn.Module, example: Any, path: Path, off: list[TensorQuantizer]) -> Path:
    """``model`` exported for its target at ``example``'s shapes, with the quantizers ``off`` disabled meanwhile (by
    the TorchScript exporter: much faster than torch.export, and as fast a file once the target's rewrite has run;
    benchmarks/RESULTS.md, zoo)."""
    from qdq.export.onnx_export import export_onnx

    try:
        for quantizer in off:
            quantizer.disable()
        return export_onnx(model, example, path, dynamic_batch=False, dynamic_sequence=False, dynamo=False)
    finally:
        for quantizer in off:
            quantizer.enable()


def _rows(pair: tuple[Any, Any]) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
    """A held-out (batch, float output) pair as its first and last samples, where every tensor of both (in tuples,
    lists and dicts) holds them along dimension 0; else None."""
    batch, reference = pair
    tensors = [t for t in (*_tensors(batch), *_outputs(reference)) if torch.is_tensor(t)]
    sizes = {int(t.shape[0]) if t.dim() else None for t in tensors}
    size = sizes.pop() if len(sizes) == 1 else None
    if size is None or size < 2:
        return None
    cut = size // 2
    halves_ = [(_sliced(batch, part), [t[part] for t in _outputs(reference)])
               for part in (slice(0, cut), slice(cut, size))]  # fmt: skip
    return halves_[0], halves_[1]


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return [value]


def _sliced(value: Any, part: slice) -> Any:
    if torch.is_tensor(value):
        return value[part]
    if isinstance(value, Mapping):
        return {k: _sliced(v, part) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_sliced(v, part) for v in value)
    return value


def _load_selection(model: nn.Module, chosen: str, selection: Mapping[str, str], weight_method: str | None,
                    strict: bool) -> None:  # fmt: skip
    """Every quantizer's final range from every batch's statistics by its method in ``selection`` (``chosen``
    elsewhere), with the options it was scored with; each activation quantizer's ``amax_method`` reads
    ``"auto: <method>"``."""
    quantizers = dict(named_quantizers(unwrap(model), weights=False))
    methods = {label: candidate(label) for label in {chosen, *selection.values()}}
    final: dict[str, torch.Tensor] = {}
    for label in methods.keys() - {chosen}:
        method, options = methods[label]
        load_amax(model, method.name, weight_method=weight_method, strict=strict, warn=False, **options)
        final.update({name: amax.detach().clone() for name, kept in selection.items()
                      if kept == label and (amax := quantizers[name].amax) is not None})  # fmt: skip
    method, options = methods[chosen]
    load_amax(model, method.name, weight_method=weight_method, strict=strict, warn=False, **options)
    for name, quantizer in quantizers.items():
        label = selection.get(name, chosen)
        if name in final:
            quantizer.amax = final[name]
            quantizer.amax_method = label
        if quantizer.amax_method == label:
            quantizer.amax_method = f"{AUTO}: {label}"


def _score(model: nn.Module, scored: Sequence[tuple[Any, Any]], forward: ForwardFn) -> float:
    """The fidelity of ``model`` (quantizing) on ``scored`` (batch, float output) pairs, over every rank's."""
    return _meter(model, scored, forward).score()


def _meter(model: nn.Module, scored: Sequence[tuple[Any, Any]], forward: ForwardFn) -> FidelityMeter:
    """A :class:`~qdq.workflow.fidelity.FidelityMeter` of ``model`` (quantizing) on ``scored`` (batch, float output)
    pairs, summed over the ranks."""
    meter = FidelityMeter()
    with eval_mode(model), torch.no_grad():
        for batch, reference in scored:
            meter.add(_outputs(reference), _outputs(forward(model, batch)))
    return meter.reduced(all_reduce_sum)


def _outputs(value: Any) -> list[Any]:
    """The tensors of a model's output (a tensor, a tuple or list, a dict, a Hugging Face ``ModelOutput``), in order."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _outputs(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _outputs(v)]
    return []

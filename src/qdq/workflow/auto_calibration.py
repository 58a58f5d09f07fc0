"""``method="auto"``: per activation quantizer, the candidate range whose quantized layer is closest to the float one.

A global method can be right for most quantizers and destroy one (entropy cutting off the sparse tail that
carries the signal). ``auto`` decides per quantizer, without labels:

1. **Candidates**: the ranges every histogram method gives from the statistics already collected (max,
   entropy, mse, percentiles 99.99 and 99.999: :data:`CANDIDATES`); ranges within one quantization step of
   each other quantize alike up to rounding and are merged.
2. **Criterion**: the squared error between the output of the layer the quantizer feeds, quantized, and the
   same layer's float output on the same input. The layer is the model's real quantized module: the nearest
   enclosing :class:`~qdq.nn.base.QuantModule` that declares the quantizer
   (:meth:`~qdq.nn.base.QuantModule.quantizers`; Conv, Linear, MatMul, LSTM, pooling, QuantAdd, QuantConcat),
   run with its weight quantizers (``role == "weight"``) quantizing as they will be exported (the ranges of
   ``weight_method``) and the quantizer's own settings from the target's placement (unsigned, per channel).
3. **Sequential, in the order the model runs its layers**: each layer's input is the activation the
   quantized model computes, every layer before it at its best range so far and its weights quantized, so a
   choice sees the error already accumulated and the layer hands on the error it adds (a layer with two
   quantized inputs, MatMul, an add, LSTM, tunes the second with the first at its choice). The best range so far
   is the candidate with the smallest error summed over the samples scored so far; the final choice is that over
   all of them. On the MNIST digits CNNs and transformers (4 models, 5 seeds, 2 targets), with the model check of
   6., its mean top-1 per model is within 0.1 point of the FP32 model's and, in two runs that trained the models on
   two machines, within 0.1 of the best global method's on 3 of 4 models (-0.11 on the MobileNet, 11 images,
   p = 0.23) and on 4 of 4 (MobileNet -0.07); case by case it is -0.4 to +0.1 from the best of the seven chosen on
   the test labels themselves (within 0.1 in 27 and 28 of 40), never significantly worse (McNemar p >= 0.12;
   benchmarks/RESULTS.md, ``calibration_quality``).
4. A quantizer no quantized module declares (what placement adds in the graph: an output or sigmoid
   quantizer, a residual operand's) is measured at its own output. The operation that reads it (an add, a
   runtime's fused int8 kernel) passes the quantization error on unchanged, so the tensor's own error is that
   of the operation's output; for ``QuantAdd`` and ``QuantConcat`` the module's forward gives the same.
5. **One range per tensor**: quantizers that read the same tensor (equal statistics, so every candidate range
   equal: a conv's output read by the next conv and by a residual add) get one range, the candidate with the
   smallest sum of their relative errors. A runtime quantizes a tensor once: ONNX Runtime fuses a Conv with the
   QuantizeLinear after it only if there is one (two ranges left 2 of 17 convs of the digits MobileNet in float).
6. **The model check** (``model_check``, on by default): each layer's error is local, and a range that is best for
   its layer's output can cost the model's (a softmax output clipped at mse's range: the attention's peaks). So
   the whole model runs once more on the scored samples with the chosen ranges and once with every compared
   quantizer at its widest candidate (``max``), and the ranges whose model output is closer to the float model's
   (squared error over the output's energy) are kept; on a tie, the chosen ones. On 24 such cases (3 seeds) it
   lifted the cases within 0.1 point of the best global method from 13 to 15 and the mean top-1 from 97.51 to
   97.54 %, and left the sparse-tail head of the same benchmark as it was.

Cost: the candidates are compared on a share of the calibration samples, :data:`SCORE_FRACTION` (a quarter; the
statistics use them all; ``score_fraction`` changes it): the first samples of each batch, so that after ``n`` samples
``ceil(n / 4)`` were scored (batches of one: one batch in four). The pass runs the model once on those samples (the
sequential stream of 3.) and each quantized layer once more with all its candidates as one batch: its input repeated
once per candidate, each copy quantized with its own range, its weights quantized once (layers with several quantized
inputs, or a per-channel activation range, run once per candidate). With 5 candidates (about 4 after merging on the
digits CNNs) that is about (1 + 4) / 4 model runs over the calibration data, plus the quantization and the error
sums; the memory is that of the layer's input and output times the number of candidates for one scored sub-batch. The
model check adds three model runs on the scored samples (float, chosen, widest): 3 / 4 of a model run over the
calibration data. ``benchmarks/calibration.py`` measures it (resnet18, 4 batches of 16 at 224x224, 4 samples of each
scored; medians of paired ratios, interleaved, on the shared 2-core VM): the comparison pass costs 1.3x an FP32
forward over the 4 batches (spread 1.1-1.6; 1.6-1.9x in earlier runs) and 0.9x the histogram calibration pass, the
model check 0.7x an FP32 forward more; against 5.6x for the comparison pass when it scored the first 2 batches whole
with 7 candidates. Computing each method's candidate ranges from the histograms comes on top (what
:func:`qdq.load_amax` costs per method: a few ms per quantizer and method on a quiet machine, 10 to 100x that under
load). Statistics and errors are summed across processes under ``torch.distributed``, so every rank chooses the same
ranges; each rank scores its own share of its batches (and its layers see its own choices so far), so the ranges can
differ from those one process chooses over the whole stream. The pass reads no device value on the host per batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.calib.methods import get_method
from qdq.errors import QdqConfigError
from qdq.markdown import markdown_table
from qdq.validate import check_range
from qdq.workflow.auto_passes import Errors, Layer, compare, layers_of, model_errors
from qdq.workflow.calibration import calibrate, load_amax
from qdq.workflow.collection import ForwardFn, default_forward, named_quantizers
from qdq.workflow.distributed import unwrap
from qdq.workflow.progress import Progress

__all__ = ["AUTO", "CANDIDATES", "MAX", "SCORE_FRACTION", "AmaxChoice", "AutoResult", "calibrate_auto", "select_amax"]

_log = logging.getLogger(__name__)

#: the method name (``qdq.calibrate(model, data, method="auto")``, ``qdq quantize --calib auto``)
AUTO = "auto"
#: the model check's alternative: every compared quantizer at its widest candidate
MAX = "max"
#: share of the calibration samples the comparison pass scores by default (the statistics use them all): the
#: first samples of each batch, so that after ``n`` samples ``ceil(n * SCORE_FRACTION)`` were scored
SCORE_FRACTION = 0.25
#: candidate ranges, as (registered method, options), each computed from the statistics collected (histograms);
#: the first of ranges within a quantization
#: step of each other names them. Percentiles 99.9 and 99.9999 were candidates too: on the 12 digits CNN cases of
#: benchmarks/calibration_quality.py (219 quantizers) 99.9 was chosen 0 times of 206 offered, 99.9999 once of
#: 81 (max or 99.999 next to it), so they cost a layer run each for nothing
CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("max", {}),
    ("mse", {}),
    ("entropy", {}),
    *(("percentile", {"percentile": p}) for p in (99.999, 99.99)),
)


@dataclass
class AmaxChoice:
    """The range ``auto`` chose for one quantizer.

    Attributes:
        quantizer: the quantizer's module name.
        layer: the module whose output was compared (the quantizer itself when it is not an input quantizer).
        chosen: the label of the chosen candidate (``"mse"``, ``"percentile 99.99"``...).
        amax: candidate label -> range (largest channel).
        error: candidate label -> squared error of the layer's output over the batches, relative to the
            float output's energy (``sum((y_q - y)**2) / sum(y**2)``).
    """

    quantizer: str
    layer: str
    chosen: str
    amax: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)


@dataclass
class AutoResult:
    """What ``auto`` chose, and what it cost.

    Attributes:
        choices: one :class:`AmaxChoice` per activation quantizer, in model order.
        batches: calibration batches of the comparison pass (those of which it scored samples).
        layer_runs: quantized-layer evaluations of that pass (candidates x layers x batches).
        samples: samples it scored (a batch of no tensor counts as one).
        seconds: wall time of :func:`select_amax` (without the histogram pass).
        compare_seconds: of which the comparison pass (the rest computes each method's candidate ranges from
            the histograms, as :func:`qdq.load_amax` would for each method).
        model_error: the model check (module docstring, 6.): ``"auto"`` (the ranges chosen per quantizer) and
            ``"max"`` (every compared quantizer at its widest candidate) -> the model output's squared error
            against the float model's over the output's energy, on the scored samples; empty when not run.
        kept: which of the two the model was left with (``"auto"`` or ``"max"``).
        check_seconds: wall time of the model check (included in ``seconds``).
    """

    choices: list[AmaxChoice]
    batches: int
    layer_runs: int
    seconds: float
    compare_seconds: float = 0.0
    samples: int = 0
    model_error: dict[str, float] = field(default_factory=dict)
    kept: str = AUTO
    check_seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """How many quantizers got each candidate."""
        found: dict[str, int] = {}
        for choice in self.choices:
            found[choice.chosen] = found.get(choice.chosen, 0) + 1
        return found

    def table(self) -> str:
        """Markdown table: quantizer, compared at, chosen range, and each candidate's relative output error."""
        labels = list(dict.fromkeys(label for c in self.choices for label in c.error))
        rows = [[c.quantizer, c.layer, c.chosen, f"{c.amax[c.chosen]:.4g}",
                 *(_error(c.error.get(label)) for label in labels)] for c in self.choices]  # fmt: skip
        return markdown_table(["quantizer", "compared at", "chosen", "amax", *labels], rows)


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def calibrate_auto(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_batches: int | None = None,
    weight_method: str | None = "max",
    forward_fn: ForwardFn | None = None,
    progress: Progress = True,
    strict: bool = True,
) -> nn.Module:
    """``qdq.calibrate(model, data, method="auto")``: histogram statistics, then :func:`select_amax`, then the
    clipping warning (:func:`qdq.workflow.diagnostics.warn_clipping`)."""
    return calibrate(model, data, AUTO, num_batches=num_batches, weight_method=weight_method, forward_fn=forward_fn,
                     progress=progress, strict=strict)  # fmt: skip


def select_amax(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_batches: int | None = None,
    weight_method: str | None = "max",
    forward_fn: ForwardFn | None = None,
    candidates: Iterable[tuple[str, dict[str, Any]]] = CANDIDATES,
    score_fraction: float = SCORE_FRACTION,
    model_check: bool = True,
    progress: Progress = True,
    strict: bool = True,
) -> AutoResult:
    """Choose each activation quantizer's range among ``candidates`` by the error of its layer's output.

    Call it after :func:`qdq.collect_stats` with histogram statistics (``calibrator="histogram"``); see the
    module docstring for the criterion. Each quantizer gets the candidate with the smallest error (the larger
    range among equals) and records it as ``amax_method = "auto: <candidate>"``.

    Args:
        model: the quantized model, statistics collected.
        data: calibration batches (the ones the statistics came from), fed with ``forward_fn``.
        num_batches: the statistics came from the first ``num_batches`` batches of ``data`` (None: all).
        score_fraction: compare the candidates on this share of those batches' samples (0 < share <= 1): the
            first samples of each batch (:data:`SCORE_FRACTION`; a batch :func:`qdq.utils.batches.sample_count`
            cannot count is one sample, scored whole or skipped).
        weight_method: how weight quantizers get their range first (:func:`qdq.load_amax`); None keeps them.
        candidates: (method, options) pairs of the calibrators' ``compute_amax``.
        model_check: keep the chosen ranges only if the model's output is no further from the float model's than
            with every compared quantizer at its widest candidate (module docstring, 6.).
        progress: show a progress bar.
        strict: a quantizer that saw no data is an error (else it stays dynamic, with a warning).

    Returns:
        An :class:`AutoResult`; the model is left with the chosen ranges.
    """
    if not 0 < score_fraction <= 1:
        raise QdqConfigError(f"score_fraction must be in (0, 1], got {score_fraction}.")
    started = time.perf_counter()
    module = unwrap(model)
    load_amax(model, "max", weight_method=weight_method, strict=strict, warn=False)  # also syncs the statistics
    options = _candidates(module, list(candidates))
    layers = layers_of(module, list(options))
    comparing = time.perf_counter()
    errors = compare(model, module, data, layers, options, (num_batches, score_fraction),
                     forward_fn or default_forward, progress)  # fmt: skip
    compared = time.perf_counter() - comparing
    choices = _choose(module, layers, options, errors)
    model_error: dict[str, float] = {}
    checking = time.perf_counter()
    if model_check and options:
        widest = {name: ranges[_widest(ranges)] for name, ranges in options.items()}
        errors_of = model_errors(model, module, data, widest, (num_batches, score_fraction),
                                 forward_fn or default_forward, progress)  # fmt: skip
        model_error = {} if errors_of is None else dict(zip((AUTO, MAX), errors_of))
    kept = MAX if model_error and model_error[MAX] < model_error[AUTO] else AUTO
    if kept == MAX:
        _keep_widest(module, options, choices)
    checked = time.perf_counter() - checking
    result = AutoResult(choices, errors.batches, errors.layer_runs, time.perf_counter() - started, compared,
                        errors.samples, model_error, kept, checked)  # fmt: skip
    _log.info("auto calibration: %s in %.2f s", result.counts(), result.seconds)
    return result


# -- candidates ---------------------------------------------------------------------------------------


def _candidates(model: nn.Module, grid: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, torch.Tensor]]:
    """Quantizer name -> {label: range}, for every quantizer with a loaded range: each registered method of
    ``grid`` whose range its statistics give. A range within one quantization step of an earlier candidate (in every
    channel) is left out: the two quantize alike up to rounding."""
    methods = [(get_method(name, who="auto: candidate: "), opts) for name, opts in grid]
    if any(method.model_level for method, _ in methods):
        raise QdqConfigError("auto: a candidate must be a method computed from statistics, not a model-level one.")
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, quantizer in named_quantizers(model, weights=False):
        calibrator = quantizer._calibrator
        if calibrator is None or quantizer.amax is None or quantizer.learn_amax:  # a learned range is QAT's
            continue
        ranges: dict[str, torch.Tensor] = {}
        for method, opts in methods:
            if method.accepts is not None and not method.accepts(calibrator):
                continue  # statistics that cannot give it: a max calibrator's, for a histogram method
            value = check_range("amax", method.compute_amax(calibrator, **opts), quantizer.amax.device)
            if not any(_within_a_step(value, seen, quantizer.maxbound) for seen in ranges.values()):
                ranges[method.label(opts)] = value
        found[name] = ranges
    return found


def _within_a_step(a: torch.Tensor, b: torch.Tensor, max_bound: int) -> bool:
    return bool(((a - b).abs() * max_bound <= torch.maximum(a, b)).all())


# -- the choice ---------------------------------------------------------------------------------------


def _choose(
    model: nn.Module, layers: list[Layer], options: dict[str, dict[str, torch.Tensor]], errors: Errors
) -> list[AmaxChoice]:
    layer_of = {name: layer.name for layer in layers for name, _ in layer.tuned}
    modules = dict(model.named_modules())
    relative = {name: _relative_errors(errors, name) for name in options}
    chosen: dict[str, str] = {}
    for group in _same_tensor_groups(options):
        labels = list(options[group[0]])
        largest = [float(options[group[0]][label].max()) for label in labels]
        total = [sum(relative[name][k] for name in group) for k in range(len(labels))]
        # the smallest error; among equal errors the larger range (it also covers data calibration did not see)
        best = labels[min(range(len(labels)), key=lambda k: (total[k], -largest[k]))]
        chosen.update(dict.fromkeys(group, best))
    choices = []
    for name, ranges in options.items():
        quantizer = modules[name]
        quantizer.amax = ranges[chosen[name]]
        quantizer.amax_method = f"{AUTO}: {chosen[name]}"
        shown = dict(zip(ranges, relative[name])) if len(ranges) > 1 else {}
        choices.append(AmaxChoice(name, layer_of[name], chosen[name],
                                  {label: float(r.max()) for label, r in ranges.items()}, shown))  # fmt: skip
    return choices


def _relative_errors(errors: Errors, name: str) -> list[float]:
    """The quantizer's squared output error per candidate over its float output's energy."""
    energy = float(errors.energy[name])
    return [s / energy if energy > 0 else 0.0 for s in errors.sums[name].cpu().tolist()]


def _same_tensor_groups(options: dict[str, dict[str, torch.Tensor]]) -> list[list[str]]:
    """Quantizer names grouped by their candidate ranges: equal in every candidate means equal statistics, i.e.
    quantizers reading one tensor (each name in one group, groups in the order of their first member)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, ranges in options.items():
        key = tuple((label, tuple(r.detach().cpu().flatten().tolist())) for label, r in ranges.items())
        groups.setdefault(key, []).append(name)
    return list(groups.values())


# -- the model check's alternative ----------------------------------------------------------------------


def _widest(ranges: dict[str, torch.Tensor]) -> str:
    """The label of the widest candidate: ``max`` when it is one (it always is for histogram statistics)."""
    return MAX if MAX in ranges else max(ranges, key=lambda label: float(ranges[label].max()))


def _keep_widest(module: nn.Module, options: dict[str, dict[str, torch.Tensor]], choices: list[AmaxChoice]) -> None:
    """Leave every compared quantizer at its widest candidate, and say so in its choice and method."""
    quantizers = dict(module.named_modules())
    for choice in choices:
        label = _widest(options[choice.quantizer])
        quantizers[choice.quantizer].amax = options[choice.quantizer][label]
        quantizers[choice.quantizer].amax_method = f"{AUTO}: {label} (model check)"
        choice.chosen = label

"""``tune``: an accuracy budget met at the lowest measured latency, by choosing which tensors stay float.

The search runs on an FP32 ONNX file (the ONNX front end). A PyTorch model is exported to one first (its FP32 graph,
which the two-doors test shows is placed the same way as the model itself); a float Keras model is exported to one by
:func:`qdq.keras.export_onnx`. Its unit of choice is one activation quantizer of the
target's placement: the tensors that share one range, which the runtime's int8 kernels read and write. Leaving
such a unit float drops its Q/DQ pair and keeps every op that read it quantized in float, so the runtime loses
exactly the fused kernels that depended on it (:meth:`qdq.graphs.view.GraphView.keep_value_float`). Every file is
scored and timed on one runtime the target supports (ONNX Runtime, OpenVINO, TensorRT, or one registered), so both
the accuracy and the latency are what that runtime computes; the FP32 reference is the float file on ONNX Runtime.

1. Calibrate once (full INT8 with the chosen method); every later file reuses those ranges (no recalibration).
2. The sensitivity pass: for each unit (or the ``max_candidates`` noisiest: lowest SQNR of their tensors against
   their fake-quantized values), the file with that unit alone left float, scored by its output SQNR against FP32
   on the first tuning batch: a continuous score (a task metric such as F1 moves in steps of one detection).
3. Greedy: try the units of the largest gain one by one, keeping a unit only when the budget's own score improves,
   until the budget holds on the tuning data and on the held-out data. A score that moves in coarse steps (F1 over
   a few images) can leave every single step without a gain; then the leading units of the ranking (every unit:
   those that gained first, then the others by their proxy, so its end is the FP32 computation) go float together,
   2, 4, 8, ... of them until the budget holds, and a bisection between the last count that missed and the first
   that met finds the fewest. Last, drop again the units the budget does not need: the least useful half first,
   then quarters, down to single units.
4. Precision variants (where the runtime has the kernels): the configuration that met with the fewest units, its
   float MatMuls on constant weights run as ONNX Runtime's ``MatMulNBits`` (8-bit, then 4-bit block weights; int8
   activations per block at run time).
5. Time FP32, full INT8 and every configuration tried in interleaved rounds on the runtime; time FP32, INT8, the
   three fastest that meet the budget and the one that meets it with the fewest float units again in fresh rounds
   (the minimum of many noisy timings is biased low), and return the fastest of that confirmation, or one with
   fewer float units that is as fast within the timing's spread.
"""

from __future__ import annotations

import ast
import contextlib
import math
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from qdq.atomic import atomic_open
from qdq.errors import QdqConfigError
from qdq.export.onnx_export import export_onnx
from qdq.graphs.onnx import atomic_save
from qdq.markdown import markdown_table
from qdq.onnx_in.bias_correction import BiasShift
from qdq.onnx_in.calibrate import ort_session, probe_model
from qdq.onnx_in.data import graph_inputs
from qdq.onnx_in.load import load_float_model, prepare
from qdq.onnx_in.quantize import activation_groups, place, quantize_onnx
from qdq.runtime import Backend, Runtime, get_backend
from qdq.runtime.benchmark import compare_models
from qdq.runtime.ort import inference_session, session_options
from qdq.targets import Target, resolve_target
from qdq.targets.onnxruntime.passes.matmul_nbits import float_weight_matmuls, matmul_nbits
from qdq.tensor_quant import fake_tensor_quant
from qdq.utils.batches import split_labels
from qdq.workflow.progress import Progress, counter
from qdq.workflow.verification import onnx_feed, sqnr_db

__all__ = ["Budget", "Trial", "TuneResult", "tune"]

Outputs = list[np.ndarray]
"""A file's outputs over a data split: one array per graph output, batches concatenated on axis 0."""
Batch = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Budget:
    """What the tuned file must keep; make one with :meth:`agreement`, :meth:`sqnr`, :meth:`drop` or
    :meth:`minimum`. Every score is higher-is-better.

    Attributes:
        name: the score's name in reports.
        score: ``score(reference_outputs, outputs, batches) -> float`` on one data split.
        threshold: the least score that meets the budget (for :meth:`drop`: set from FP32's score).
        max_drop: :meth:`drop`'s allowed loss against FP32's score, else None.
        proxy: what orders the sensitivity pass, ``proxy(reference_outputs, outputs) -> float`` (higher is better,
            continuous); None: the SQNR of all outputs against FP32's. A detector's budget passes the SQNR of its
            score rows, which the box coordinates would otherwise outweigh.
    """

    name: str
    score: Callable[[Outputs, Outputs, Sequence[Batch]], float]
    threshold: float = -math.inf
    max_drop: float | None = None
    proxy: Callable[[Outputs, Outputs], float] | None = None

    @classmethod
    def agreement(cls, min_percent: float, class_axis: int = -1) -> Budget:
        """Top-1 agreement with FP32 (%, the arg-max of the first output on ``class_axis``) of at least
        ``min_percent``: no labels needed."""

        def score(reference: Outputs, outputs: Outputs, _: Sequence[Batch]) -> float:
            same = reference[0].argmax(axis=class_axis) == outputs[0].argmax(axis=class_axis)
            return 100.0 * float(np.mean(same))

        return cls("top-1 agreement %", score, float(min_percent))

    @classmethod
    def sqnr(cls, min_db: float) -> Budget:
        """SQNR of the outputs against FP32's (dB, all outputs together) of at least ``min_db``."""

        def score(reference: Outputs, outputs: Outputs, _: Sequence[Batch]) -> float:
            return _sqnr(reference, outputs)

        return cls("output SQNR dB", score, float(min_db))

    @classmethod
    def drop(cls, metric: Callable[[Outputs, Sequence[Batch]], float], max_drop: float, name: str = "metric") -> Budget:
        """``metric(outputs, batches)`` (higher is better; e.g. accuracy against labels the batches carry under a
        key that is not a graph input) at most ``max_drop`` below FP32's."""
        return cls(name, lambda _, outputs, batches: float(metric(outputs, batches)), max_drop=float(max_drop))

    @classmethod
    def minimum(cls, metric: Callable[[Outputs, Outputs], float], min_value: float, name: str = "metric") -> Budget:
        """``metric(reference_outputs, outputs)`` (higher is better; e.g. detections' F1 against FP32's) of at
        least ``min_value``."""
        return cls(name, lambda reference, outputs, _: float(metric(reference, outputs)), float(min_value))

    def describe(self) -> str:
        if self.max_drop is not None:
            return f"{self.name} >= {self.threshold:.4g} (FP32 - {self.max_drop:g})"
        return f"{self.name} >= {self.threshold:.4g}"


@dataclass
class Trial:
    """One configuration tried.

    Attributes:
        name: ``"FP32"``, ``"INT8"``, ``"greedy k"`` (``"(undone)"`` when the step did not improve the score and
            was taken back), ``"top k"`` (the ``k`` units of the largest gain float together) or ``"prune k"``.
        floated: the units left float, each a tuple of tensor names.
        score / holdout: the budget's score on the tuning and the held-out data (holdout None: not evaluated).
        ms / low / high: measured latency (median of the interleaved rounds' block medians, and the 25th-75th
            percentile), ms per batch; None where it was not timed.
        confirmed: (median, 25th, 75th percentile) ms per batch of the confirmation timing, fresh interleaved
            rounds of FP32, INT8 and the fastest configurations that meet the budget, made after they were
            picked; the choice is made on it (not on ``ms``, whose minimum over many noisy trials is biased low).
            None where it was not re-timed.
        matmul_bits: for a precision variant, the bits of the block-quantized weights its float MatMuls got
            (``MatMulNBits``, :mod:`qdq.targets.onnxruntime.passes.matmul_nbits`); None for the others.
        path: its file in the work folder.
    """

    name: str
    floated: tuple[tuple[str, ...], ...]
    score: float
    holdout: float | None = None
    ms: float | None = None
    low: float | None = None
    high: float | None = None
    confirmed: tuple[float, float, float] | None = None
    matmul_bits: int | None = None
    path: Path | None = None

    @property
    def latency(self) -> float | None:
        """The latency to compare (ms per batch): the confirmation's median where there is one, else ``ms``."""
        return self.confirmed[0] if self.confirmed is not None else self.ms

    def meets(self, budget: Budget) -> bool:
        return self.score >= budget.threshold and self.holdout is not None and self.holdout >= budget.threshold


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        path: the chosen file (written atomically), or None when no configuration met the budget.
        budget: the budget, its threshold resolved.
        fp32, int8, chosen: the FP32 file, full INT8 and the chosen configuration (chosen None: none met it).
        trials: every configuration tried, in order.
        gains: unit -> the budget's proxy (default: output SQNR in dB against FP32) on the first tuning batch gained
            by leaving it float alone (the sensitivity pass, which orders the greedy search).
        evaluations: files scored (tuning and held-out splits counted once each); files: files written;
            builds: files loaded on the runtime (sessions; engine builds on TensorRT), for scoring and timing;
            calibrations: calibration passes (1); seconds: wall time.
        advice: the next step when the result is no faster than FP32 or nothing met the budget.
        runtime: where the latencies were measured; batch: the timed batch size.
        unit_ms: unit -> the latency it adds (ms per batch: the difference of the medians, and the lowest and
            highest difference the two 25th-75th percentile ranges allow), measured between two timed configurations
            that differ by that unit alone; units without such a pair are absent.
        made_by: tensor -> what computes it in the FP32 file: the op type, and the module it belongs to where the
            exporter recorded one (``"Softmax in blocks.2.attn"``), or ``"graph input"``.
    """

    path: Path | None
    budget: Budget
    fp32: Trial
    int8: Trial
    chosen: Trial | None
    trials: list[Trial]
    gains: dict[tuple[str, ...], float]
    evaluations: int
    files: int
    calibrations: int
    seconds: float
    builds: int = 0
    advice: str | None = None
    runtime: str = "onnxruntime"
    batch: int = 1
    unit_ms: dict[tuple[str, ...], tuple[float, float, float]] = field(default_factory=dict)
    made_by: dict[str, str] = field(default_factory=dict)

    def describe(self, unit: tuple[str, ...]) -> str:
        """``unit``'s tensors, each with what computes it (``made_by``) where known."""
        return ", ".join(f"{name} ({self.made_by[name]})" if name in self.made_by else name for name in unit)

    def report(self) -> str:
        """A Markdown report: the budget, every configuration (score, held-out score, measured latency), the
        units left float with their gain and measured cost, and the search's cost."""
        fp32_ms = self.fp32.ms or math.nan
        lines = [f"# tune: {self.budget.describe()} on {self.runtime}", ""]
        rows = []
        for trial in [self.fp32, *self.trials]:
            speed = f"{fp32_ms / trial.ms:.2f}x" if trial.ms else "-"
            timed = f"{trial.ms:.2f} ({trial.low:.2f}-{trial.high:.2f})" if trial.ms else "-"
            held = "-" if trial.holdout is None else f"{trial.holdout:.4g}"
            verdict = "PASS" if trial.meets(self.budget) else "FAIL"
            mark = " (chosen)" if trial is self.chosen else ""
            rows.append([trial.name + mark, str(len(trial.floated)), f"{trial.score:.4g}", held, verdict, timed, speed])
        lines += [markdown_table(["configuration", "units float", "score (tuning)", "score (held-out)", "budget",
                                  f"ms per batch of {self.batch}", "speed-up vs FP32"], rows), ""]  # fmt: skip
        if any(t.matmul_bits for t in self.trials):
            lines += ["- N MatMul(s) k-bit: the configuration named with its float MatMuls on constant weights run as "
                      "ONNX Runtime's MatMulNBits (k-bit weights in blocks of 32, activations quantized to int8 per "
                      "block at run time).", ""]  # fmt: skip
        lines += [
            "- score: " + self.budget.name + " on the tuning data and on the held-out data ('-': not evaluated, the "
            "tuning score already misses). budget: PASS when both reach the threshold.",
            "- ms: median of interleaved rounds (25th-75th percentile), measured on the runtime; speed-up: FP32 ms "
            "/ this ms (> 1: faster than FP32).",
            "",
        ]
        if self.chosen is not None and self.chosen.floated:
            stepped = any(unit in self.unit_ms for unit in self.chosen.floated)
            unit_rows = [[self.describe(unit), f"{self.gains.get(unit, math.nan):+.2f}"]
                         + ([_cost(self.unit_ms[unit]) if unit in self.unit_ms else "-"] if stepped else [])
                         for unit in self.chosen.floated]  # fmt: skip
            header = ["tensors left float", "proxy gained alone"] + (["measured ms added"] if stepped else [])
            lines += [markdown_table(header, unit_rows), ""]
            if stepped:
                lines += ["- measured ms added: the latency difference between two timed configurations that differ "
                          "by that unit alone (a pruning try without it, else the greedy step that added it): the "
                          "difference of their medians, and in brackets the range their 25th-75th percentiles allow; "
                          "a range across zero is below the timing's resolution."]  # fmt: skip
            if self.chosen.latency is not None and self.int8.latency is not None:
                lines += [f"- together they cost {self.chosen.latency - self.int8.latency:+.2f} ms per batch against "
                          "full INT8 (measured, interleaved)."]  # fmt: skip
            lines.append("")
        lines += self._confirmation()
        top = sorted(self.gains.items(), key=lambda item: -item[1])[:8]
        lines += ["- proxy: what ranks the units, " + ("the budget's own proxy" if self.budget.proxy else
                  "the output SQNR against FP32 (dB)") + ", on the first tuning batch.", ""]  # fmt: skip
        if top:
            lines += [markdown_table(["most sensitive units (tensors)", "proxy gained alone"],
                                     [[self.describe(unit), f"{gain:+.2f}"] for unit, gain in top]), ""]  # fmt: skip
        lines.append(f"Search cost: {self.evaluations} evaluations, {self.files} files written, {self.builds} "
                     f"builds on {self.runtime}, {self.calibrations} calibration, {self.seconds:.0f} s.")  # fmt: skip
        if self.advice:
            lines += ["", self.advice]
        return "\n".join(lines)

    def _confirmation(self) -> list[str]:
        confirmed = [t for t in [self.fp32, *self.trials] if t.confirmed is not None]
        if not confirmed or self.fp32.confirmed is None:
            return []
        fp32_ms = self.fp32.confirmed[0]
        rows = [[t.name + (" (chosen)" if t is self.chosen else ""), f"{t.confirmed[0]:.2f} ({t.confirmed[1]:.2f}-"
                 f"{t.confirmed[2]:.2f})", f"{fp32_ms / t.confirmed[0]:.2f}x"] for t in confirmed if t.confirmed]
        return [markdown_table(["confirmation", f"ms per batch of {self.batch}", "speed-up vs FP32"], rows), "",
                "- confirmation: FP32, INT8, the fastest configurations that meet the budget and the one with the "
                "fewest float units timed again in fresh interleaved rounds; the choice is the fastest of these (the "
                "fastest of many noisy timings is biased low), or one with fewer float units as fast within the "
                "spread (its 25th percentile at most the fastest's 75th).",
                ""]  # fmt: skip

    def plot(self, path: str | Path) -> Path:
        """A Pareto plot (latency against score of every timed configuration) saved at ``path`` (matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise QdqConfigError("the Pareto plot needs matplotlib: pip install 'qdq[app]'.") from err
        timed = [t for t in [self.fp32, *self.trials] if t.ms and math.isfinite(t.score)]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([t.ms or 0.0 for t in timed], [t.score for t in timed], c=["C2" if t.meets(self.budget) else "C3"
                                                                         for t in timed])  # fmt: skip
        for t in timed:
            ax.annotate(t.name, (t.ms or 0.0, t.score), fontsize=7)
        ax.axhline(self.budget.threshold, color="grey", linestyle="--", label="budget")
        ax.set_xlabel(f"ms per batch of {self.batch} ({self.runtime})")
        ax.set_ylabel(self.budget.name)
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        with atomic_open(out) as stream:
            fig.savefig(stream, format=out.suffix.lstrip(".") or "png")
        plt.close(fig)
        return out


def tune(
    model: str | Path | nn.Module,
    calibration_data: Iterable[Any],
    eval_data: Sequence[Any],
    path: str | Path,
    *,
    budget: Budget,
    target: str | Target = "onnxruntime",
    runtime: str | None = None,
    runtime_options: Mapping[str, Any] | None = None,
    method: str = "percentile",
    holdout_data: Sequence[Any] | None = None,
    max_candidates: int | None = None,
    max_steps: int = 12,
    rounds: int = 5,
    iters: int = 10,
    max_loaded: int = 24,
    threads: int | None = None,
    progress: Progress = True,
    **quantize_options: Any,
) -> TuneResult:
    """Quantize the FP32 ONNX file ``model`` and leave float the fewest tensors that make ``budget`` hold on
    ``eval_data`` and ``holdout_data``, choosing among the configurations tried the one of the lowest latency
    measured on ``runtime``; write it at ``path``.

    Args:
        model: the FP32 ONNX file, or a float PyTorch model: it is exported to FP32 ONNX
            (:func:`qdq.export_onnx`, the first calibration batch as the example) and every batch is read by
            qdq's batch convention (:mod:`qdq.utils.batches`: a tensor, positional inputs, keyword inputs,
            ``(inputs, labels)`` pairs) into a dict of graph input name -> array, its labels under
            ``"labels"`` (what a budget's metric reads); or a float Keras model: exported by
            :func:`qdq.keras.export_onnx`, its batches arrays, lists of arrays (several inputs, in the model's
            order) or ``(inputs, labels)`` pairs.
        calibration_data: batches (dicts of graph input name -> array) for the one calibration.
        eval_data: the batches the budget is scored on during the search (keys that are not graph inputs, such as
            labels, are passed to the budget's metric only).
        path: where the chosen file goes.
        budget: what must hold (:class:`Budget`).
        target: the placement target (``"onnxruntime"``, ``"tensorrt"`` or one you registered); its placement gives
            the units of choice. For ``"tensorrt"``, ``target_options={"float": "float16"}`` (a quantize option)
            makes every unit left float run in FP16, as TensorRT 11 builds it.
        runtime: where every configuration is scored and timed: a registered runtime the target supports
            (:attr:`qdq.targets.Target.runtimes`, not one that refuses its files); default: the target's first
            native runtime (``"onnxruntime"`` for ``"onnxruntime"``, ``"tensorrt"`` for ``"tensorrt"``). The FP32
            reference outputs are the float file's on ONNX Runtime.
        runtime_options: the runtime's load options (:meth:`qdq.runtime.Backend.open`: ``precision`` for
            OpenVINO, ``workspace_mib`` for TensorRT, ...).
        method: the calibration method of the one calibration.
        holdout_data: batches the chosen configuration must also meet the budget on; default: every other batch
            of ``eval_data`` is held out (then ``eval_data`` needs at least two batches).
        max_candidates: how many units the sensitivity pass measures (the noisiest on one batch: lowest SQNR of
            their tensors against their fake-quantized values); None: every unit.
        max_steps: the most units the greedy search tries (each one evaluation), and the most pruning tries of
            the last phase; the doubling and bisection over the ranking add at most ``2 log2(units)``.
        rounds: interleaved timing rounds (each runs a block of every file).
        iters: timed runs per block.
        max_loaded: the most files loaded on the runtime at once while timing (each a session, or an engine on the
            GPU): more configurations are timed in groups of that many, each group with FP32 and INT8 beside them.
        threads: the runtime's threads, for evaluation and timing (and ONNX Runtime's for the FP32 reference).
        progress: progress bars on stderr.
        quantize_options: passed to :func:`qdq.quantize_onnx` (``weight_method``, ``keep_float``, method options).

    Returns:
        A :class:`TuneResult`; ``result.report()`` is the Markdown report, ``result.plot(png)`` the Pareto plot.

    Raises:
        QdqConfigError: a model that is not an ONNX file, a PyTorch or a Keras model, too little evaluation data, a
            runtime the target does not support or that is not installed.
    """
    started = time.perf_counter()
    if max_loaded < 3:
        raise QdqConfigError(f"max_loaded={max_loaded}: timing needs at least 3 files loaded at once (FP32, INT8 and "
                             "one configuration).")  # fmt: skip
    place_for = resolve_target(target)
    backend = _runtime_for(place_for, runtime)
    with tempfile.TemporaryDirectory(prefix="qdq-tune-") as folder:
        source, calibration_data, eval_data, holdout_data = _onnx_source(model, calibration_data, eval_data,
                                                                         holdout_data, Path(folder))  # fmt: skip
        tuning, holdout = _splits(eval_data, holdout_data)
        search = _Search(source, calibration_data, tuning, holdout, budget, Path(folder), method,
                         _Engine(place_for, backend, threads, dict(runtime_options or {})), progress,
                         quantize_options)  # fmt: skip
        search.run(max_candidates, max_steps)
        search.precision_variants()
        search.time(rounds, iters, max_loaded)
        search.confirm(rounds, iters)
        chosen = search.choose()
        written = None
        if chosen is not None and chosen.path is not None:
            with atomic_open(path) as out, open(chosen.path, "rb") as chosen_file:
                shutil.copyfileobj(chosen_file, out)
            written = Path(path)
        for trial in search.trials:
            trial.path = None
        return TuneResult(
            path=written, budget=search.budget, fp32=search.fp32, int8=search.trials[0], chosen=chosen,
            trials=search.trials, gains=search.gains, evaluations=search.evaluations, files=search.files,
            made_by=search.made_by, runtime=backend.name, builds=search.builds,
            calibrations=1, seconds=time.perf_counter() - started, batch=search.batch, unit_ms=search.unit_ms(chosen),
            advice=_advice(search.fp32, search.trials[0], chosen),
        )  # fmt: skip


def _onnx_source(model: str | Path | nn.Module, calibration: Iterable[Any], evaluation: Sequence[Any],
                 holdout: Sequence[Any] | None, folder: Path) -> tuple[Path, Iterable[Batch], list[Batch],
                                                                   list[Batch] | None]:  # fmt: skip
    """The FP32 ONNX file the search runs on, and the batches as its feeds: ``model`` as it is when it is a path;
    a PyTorch or Keras model exported (into ``folder``) with its batches converted."""
    if isinstance(model, str | Path):
        return Path(model), calibration, list(evaluation), None if holdout is None else list(holdout)
    batches = list(calibration)
    if _is_keras(model):
        from qdq.keras import export_onnx as keras_export

        def export(out: Path) -> Path:
            return keras_export(model, None, out, target="onnxruntime")

        convert: Callable[[Any, list[str]], Batch] = _keras_feed
    elif isinstance(model, nn.Module):

        def export(out: Path) -> Path:
            return export_onnx(model, batches[0], out, target="onnxruntime")

        def convert(batch: Any, names: list[str]) -> Batch:
            return _feed(batch, model, names)
    else:
        raise QdqConfigError(f"tune takes an FP32 ONNX file, a float torch.nn.Module or a float Keras model, not "
                             f"{type(model).__name__}.")  # fmt: skip
    if not batches:
        raise QdqConfigError("tune needs calibration data: pass at least one batch.")
    with _float_convs_expected():  # the FP32 graph has no quantizer by design
        source = export(folder / "fp32.onnx")
    names = [value.name for value in graph_inputs(source)]

    def feeds(data: Iterable[Any]) -> list[Batch]:
        return [convert(batch, names) for batch in data]

    return source, feeds(batches), feeds(evaluation), None if holdout is None else feeds(holdout)


@contextlib.contextmanager
def _float_convs_expected() -> Iterator[None]:
    """Silence the warning that convs will run in float: a file tune writes leaves them float on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Conv\(s\) will run in float", category=UserWarning)
        yield


def _is_keras(model: Any) -> bool:
    """Whether ``model`` is a Keras model (keras is imported already where a user holds one)."""
    model_class = getattr(sys.modules.get("keras"), "Model", None)
    return isinstance(model_class, type) and isinstance(model, model_class)


def _keras_feed(batch: Any, names: list[str]) -> dict[str, Any]:
    """A Keras batch as the graph's feed: inputs (an array, or a list of arrays in the model's input order) or an
    ``(inputs, labels)`` pair, its labels under ``"labels"``."""
    labels = None
    pair = isinstance(batch, tuple | list) and len(batch) == 2
    if pair and (len(names) == 1 or isinstance(batch[0], tuple | list | dict)):
        batch, labels = batch
    if isinstance(batch, dict):
        arrays = [batch[name] for name in names if name in batch]
    else:
        arrays = list(batch) if isinstance(batch, tuple | list) else [batch]
    if len(arrays) != len(names):
        raise QdqConfigError(f"a batch gives {len(arrays)} input(s) but the Keras model's export has {names}: pass "
                             "an array, a list of arrays in the model's input order, or (inputs, labels).")  # fmt: skip
    feed: dict[str, Any] = {name: np.asarray(array, np.float32) for name, array in zip(names, arrays)}
    if labels is not None:
        feed["labels"] = np.asarray(labels)
    return feed


def _feed(batch: Any, model: nn.Module, names: list[str]) -> dict[str, Any]:
    """``batch`` (qdq's batch convention) as the graph's feed (``names``: its inputs), its labels (if any) under
    ``"labels"``."""
    inputs, labels = split_labels(batch, model)
    feed: dict[str, Any] = onnx_feed(inputs, names)
    if labels is not None:
        feed["labels"] = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else labels
    return feed


def _splits(eval_data: Sequence[Batch], holdout: Sequence[Batch] | None) -> tuple[list[Batch], list[Batch]]:
    data = list(eval_data)
    if holdout is not None:
        if not data or not list(holdout):
            raise QdqConfigError("tune needs evaluation and held-out batches: pass at least one of each.")
        return data, list(holdout)
    if len(data) < 2:
        raise QdqConfigError("tune holds out every other batch of eval_data: pass at least two batches, or "
                             "holdout_data=.")  # fmt: skip
    return data[0::2], data[1::2]


class _Search:
    """The state of one search: the data, the reference outputs, every trial and what it cost."""

    def __init__(self, source: Path, calibration: Iterable[Batch], tuning: list[Batch], holdout: list[Batch],
                 budget: Budget, work: Path, method: str, engine: _Engine, progress: Progress,
                 options: dict[str, Any]) -> None:  # fmt: skip
        self.source, self.work, self.engine, self.progress = source, work, engine, progress
        self.tuning, self.holdout, self.options, self.method = tuning, holdout, options, method
        self.trials: list[Trial] = []
        self.gains: dict[tuple[str, ...], float] = {}
        self.evaluations = self.files = self.builds = 0
        proto = load_float_model(source)
        self.made_by = _made_by(proto)
        self.inputs = [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
        self.largest = max(len(next(iter(self._feed(b).values()))) for b in [*tuning, *holdout])
        self.reference = dict(zip((id(tuning), id(holdout)), self._reference(source, [tuning, holdout])))
        fp32_scores = [budget.score(self.reference[id(s)], self.reference[id(s)], s) for s in (tuning, holdout)]
        if budget.max_drop is not None:
            budget = Budget(budget.name, budget.score, min(fp32_scores) - budget.max_drop, budget.max_drop,
                            budget.proxy)
        self.budget = budget
        self.fp32 = Trial("FP32", (), fp32_scores[0], fp32_scores[1], path=source)
        self.value_ranges: dict[str, np.ndarray] | None = None  # set by the one calibration, reused after it
        self.bias_shifts: list[BiasShift] | None = None  # the same: a layer's bias shift depends on its own ranges only
        base = self._quantize((), calibration=calibration)
        self.value_ranges, self.bias_shifts = base[1], base[2]
        prepare(proto)
        self.prepared = proto
        self.units = activation_groups(place(proto, engine.target, options.get("keep_float", ())))
        self.calibration_batch = tuning[0]
        self.batch = int(next(iter(self._feed(tuning[0]).values())).shape[0])
        self._add("INT8", (), base[0])

    # --- files and scores ----------------------------------------------------------------------------------
    def _feed(self, batch: Batch) -> dict[str, np.ndarray]:
        return {name: np.asarray(batch[name]) for name in self.inputs}

    def _reference(self, path: Path, splits: Sequence[Sequence[Batch]]) -> list[Outputs]:
        """The FP32 file's outputs on each split, computed by ONNX Runtime in float32: the float model's own."""
        session = inference_session(path, session_options(threads=self.engine.threads))
        return [_joined([session.run(None, self._feed(b)) for b in split]) for split in splits]

    @contextlib.contextmanager
    def _loaded(self, path: Path) -> Iterator[Runtime]:
        """``path`` built on the runtime (counted in ``builds``) for the largest evaluation batch."""
        self.builds += 1
        with self.engine.open(path, self.largest) as loaded:
            yield loaded

    def _run(self, loaded: Runtime, split: Sequence[Batch]) -> Outputs:
        return _joined([loaded.run(self._feed(b)) for b in split])

    def _outputs(self, path: Path, split: Sequence[Batch]) -> Outputs:
        """``path``'s outputs on ``split``, computed by the runtime (one build of the file)."""
        with self._loaded(path) as loaded:
            return self._run(loaded, split)

    def _quantize(self, floated: tuple[tuple[str, ...], ...], calibration: Iterable[Batch] | None = None
                  ) -> tuple[Path, dict[str, np.ndarray], list[BiasShift]]:  # fmt: skip
        out = self.work / f"config_{self.files}.onnx"
        self.files += 1
        values = sorted({name for unit in floated for name in unit})
        with _float_convs_expected():  # the convs a configuration leaves float are its point, not a mistake
            result = quantize_onnx(self.source, calibration if calibration is not None else [self.tuning[0]], out,
                                   target=self.engine.target, method=self.method, float_values=values,
                                   value_ranges=self.value_ranges, bias_shifts=self.bias_shifts, progress=False,
                                   threads=self.engine.threads, **self.options)  # fmt: skip
        return result.path, result.value_ranges, result.bias_shifts

    def _score(self, split: list[Batch], outputs: Outputs) -> float:
        self.evaluations += 1
        return self.budget.score(self.reference[id(split)], outputs, split)

    def _add(self, name: str, floated: tuple[tuple[str, ...], ...], path: Path | None = None) -> Trial:
        """Score a configuration (its file, written here when ``path`` is None) on the tuning data, and on the
        held-out data where the tuning score meets the budget; both on one build of the file."""
        if path is None:
            path = self._quantize(floated)[0]
        with self._loaded(path) as loaded:
            trial = Trial(name, floated, self._score(self.tuning, self._run(loaded, self.tuning)), path=path)
            if trial.score >= self.budget.threshold:
                trial.holdout = self._score(self.holdout, self._run(loaded, self.holdout))
        self.trials.append(trial)
        return trial

    # --- the search -----------------------------------------------------------------------------------------
    def run(self, max_candidates: int | None, max_steps: int) -> None:
        base = self.trials[0]
        if base.meets(self.budget):
            return
        candidates = self.units if max_candidates is None else self._noisiest(max_candidates)
        screen = [self.tuning[0]]
        proxy = self.budget.proxy or _sqnr
        rows = len(next(iter(self._feed(screen[0]).values())))
        reference = [r[:rows] for r in self.reference[id(self.tuning)]]
        base_sqnr = proxy(reference, self._outputs(base.path, screen)) if base.path else -math.inf
        bar = counter(self.progress, "tune: sensitivity", len(candidates))
        for unit in candidates:
            path = self._quantize((unit,))[0]
            self.evaluations += 1
            self.gains[unit] = proxy(reference, self._outputs(path, screen)) - base_sqnr
            path.unlink()
            bar.update()
        bar.close()
        order = sorted((u for u in candidates if self.gains[u] > 0), key=lambda u: -self.gains[u])
        floated: tuple[tuple[str, ...], ...] = ()
        best = base.score
        met: Trial | None = None
        for step, unit in enumerate(order[:max_steps]):
            trial = self._add(f"greedy {step + 1}", (*floated, unit))
            if trial.meets(self.budget):
                met = trial
                break
            if trial.score > best:  # a step is kept only when the budget's own score improves
                floated, best = trial.floated, trial.score
            else:
                trial.name += " (undone)"
        if met is None:
            met = self._leading(self._ranking(order))
        if met is not None:
            self._prune(met, max_steps)

    def _ranking(self, gaining: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
        """Every unit, best first: those that gained alone (largest gain first), then the other measured units
        (least loss first), then the units the sensitivity pass did not measure. Its end is every unit float: the
        FP32 computation, which a budget FP32 meets is met by."""
        first = set(gaining)
        rest = sorted((u for u in self.gains if u not in first), key=lambda u: -self.gains[u])
        return gaining + rest + [u for u in self.units if u not in self.gains]

    def _leading(self, order: list[tuple[str, ...]]) -> Trial | None:
        """The fewest leading units of ``order`` that meet the budget together: ``k`` doubling from 2 until the
        budget holds, then a bisection between the last ``k`` that missed and the first that met; None when even
        every unit of ``order`` misses."""
        missed, k, met = 1, 2, None  # greedy tried the first unit alone
        while met is None and missed < len(order):
            k = min(k, len(order))
            trial = self._add(f"top {k}", tuple(order[:k]))
            if trial.meets(self.budget):
                met = trial
            else:
                missed, k = k, 2 * k
        while met is not None and len(met.floated) - missed > 1:
            middle = (missed + len(met.floated)) // 2
            trial = self._add(f"top {middle}", tuple(order[:middle]))
            if trial.meets(self.budget):
                met = trial
            else:
                missed = middle
        return met

    def _prune(self, met: Trial, max_tries: int) -> None:
        """Drop from the met configuration the units the budget does not need, at most ``max_tries`` tries: the
        least useful half (smallest gain) first, then quarters, and so on down to single units (each try keeps
        its removal when the budget still holds), so a large set shrinks in a few evaluations."""
        floated = sorted(met.floated, key=lambda u: self.gains.get(u, 0.0))
        size, tries = max(len(floated) // 2, 1), 0
        while tries < max_tries:
            start = 0
            while start < len(floated) and tries < max_tries:
                chunk = set(floated[start : start + size])
                keep = set(floated) - chunk
                if not keep:  # nothing float is plain INT8, which misses
                    start += size
                    continue
                trial = self._add(f"prune {len(self.trials)}", tuple(u for u in met.floated if u in keep))
                tries += 1
                if trial.meets(self.budget):
                    floated = [u for u in floated if u in keep]
                else:
                    start += size
            if size == 1:
                break
            size = max(size // 2, 1)

    def precision_variants(self) -> None:
        """The configuration that met the budget with the fewest float units, its float MatMuls on constant
        weights run at a precision between int8 and float: ``MatMulNBits`` with block weights of each width the
        runtime runs (:attr:`qdq.runtime.Backend.block_weight_bits`; ONNX Runtime: 8 and 4 bits) and int8
        activations quantized per block at run time (one evaluation each; none without such a MatMul)."""
        bits = self.engine.backend.block_weight_bits
        passing = [t for t in self.trials if t.meets(self.budget) and t.path is not None]
        if not passing or not bits:
            return
        base = min(reversed(passing), key=lambda t: len(t.floated))  # the last of the fewest: the pruned one
        model = onnx.load(str(base.path))
        names = float_weight_matmuls(model)
        if not names:
            return
        for width in bits:
            out = self.work / f"config_{self.files}.onnx"
            self.files += 1
            atomic_save(matmul_nbits(model, names, bits=width), out)
            trial = self._add(f"{base.name}, {len(names)} MatMul(s) {width}-bit", base.floated, out)
            trial.matmul_bits = width

    def _noisiest(self, count: int) -> list[tuple[str, ...]]:
        """The ``count`` units whose tensors lose the most to their quantization on one batch (lowest SQNR)."""
        tensors = sorted({name for unit in self.units for name in unit})
        probe = probe_model(self.prepared, tensors)
        session = ort_session(probe, self.work, self.engine.threads)
        values = dict(zip(tensors, session.run(tensors, self._feed(self.calibration_batch))))
        ranges = self.value_ranges or {}
        noise = {unit: _unit_sqnr([values[n] for n in unit], ranges.get(unit[0])) for unit in self.units}
        return sorted(self.units, key=lambda u: noise[u])[:count]

    # --- timing and the choice ------------------------------------------------------------------------------
    def time(self, rounds: int, iters: int, max_loaded: int) -> None:
        """Time FP32 and every configuration tried in interleaved rounds (``Trial.ms``), at most ``max_loaded`` files
        loaded at once: beyond that, in groups that each hold FP32 and INT8 too (their figures: the first group's)."""
        anchors = [t for t in (self.fp32, self.trials[0]) if t.path is not None]
        rest = [t for t in self.trials[1:] if t.path is not None]
        size = max(max_loaded - len(anchors), 1)
        groups = [rest[start : start + size] for start in range(0, len(rest), size)] or [[]]
        for index, group in enumerate(groups):
            step = "tune: timing" + (f" ({index + 1}/{len(groups)})" if len(groups) > 1 else "")
            timed = anchors + group
            for trial, blocks in zip(timed, self._timings(timed, rounds, iters, step)):
                if index == 0 or any(trial is member for member in group):
                    trial.ms, trial.low, trial.high = _spread(blocks)

    def confirm(self, rounds: int, iters: int, count: int = 3) -> None:
        """Time again, in fresh interleaved rounds, FP32, INT8, the ``count`` fastest configurations that meet the
        budget and the one that meets it with the fewest float units (``Trial.confirmed``): the choice among them
        rests on measurements it did not select on."""
        meeting = [t for t in self.trials if t.meets(self.budget) and t.ms is not None]
        if not meeting:
            return
        passing = sorted(meeting, key=lambda t: t.ms or math.inf)[:count]
        fewest = min(reversed(meeting), key=lambda t: len(t.floated))  # the last of the fewest: the pruned one
        passing += [] if any(t is fewest for t in passing) else [fewest]
        int8 = self.trials[0]
        timed = [t for t in [self.fp32, int8, *(t for t in passing if t is not int8)] if t.path is not None]
        for trial, blocks in zip(timed, self._timings(timed, rounds, iters, "tune: confirming")):
            trial.confirmed = _spread(blocks)

    def _timings(self, trials: list[Trial], rounds: int, iters: int, step: str) -> list[np.ndarray]:
        models = {f"{i}": t.path for i, t in enumerate(trials) if t.path is not None}  # all have one here
        bar = counter(self.progress, step, rounds * len(models))
        self.builds += len(models)
        with self.engine.once():
            comparison = compare_models(models, self.engine.backend.name, threads=self.engine.threads, rounds=rounds,
                                        iters=iters, warmup=2, batch=self.batch,
                                        inputs=self._feed(self.calibration_batch), progress=bar.update,
                                        **self.engine.options)  # fmt: skip
        bar.close()
        return [np.asarray(comparison.block_ms[key]) for key in models]

    def choose(self) -> Trial | None:
        """The configuration that meets the budget at the lowest latency (confirmed where re-timed); where one with
        fewer float units is as fast within the timing's spread (its 25th percentile at most the fastest's 75th),
        the one with the fewest float units."""
        passing = [t for t in self.trials if t.meets(self.budget) and t.latency is not None]
        confirmed = [t for t in passing if t.confirmed is not None]
        if not confirmed:
            return min(passing, key=lambda t: t.latency or math.inf) if passing else None
        fastest = min(confirmed, key=lambda t: t.latency or math.inf)
        ceiling = fastest.confirmed[2] if fastest.confirmed is not None else math.inf
        level = [t for t in confirmed if t.confirmed is not None and t.confirmed[1] <= ceiling]
        return min(level, key=lambda t: (len(t.floated), t.latency or math.inf))

    def unit_ms(self, chosen: Trial | None) -> dict[tuple[str, ...], tuple[float, float, float]]:
        """Unit -> the latency it adds, measured: the difference between two timed configurations that differ by
        that unit alone (the difference of their medians, and the range their 25th-75th percentiles allow),
        preferring the pair whose larger side is ``chosen`` (a pruning try without the unit), then a greedy step
        that added it."""
        timed = [(t, set(t.floated), (t.ms, t.low, t.high)) for t in self.trials if t.matmul_bits is None
                 and t.ms is not None and t.low is not None and t.high is not None]  # fmt: skip
        found: dict[tuple[str, ...], tuple[float, float, float]] = {}
        for trial, units, (ms, low, high) in timed:
            for _, fewer, (other_ms, other_low, other_high) in timed:
                if len(units) == len(fewer) + 1 and fewer < units:
                    (unit,) = units - fewer
                    if unit not in found or trial is chosen:
                        found[unit] = (ms - other_ms, low - other_high, high - other_low)
        return found


@dataclass(frozen=True)
class _Engine:
    """Where the search's files are placed, scored and timed: the target, the runtime's backend, its options."""

    target: Target
    backend: Backend
    threads: int | None
    options: dict[str, Any]
    said: set[str] = field(default_factory=set)

    def open(self, path: Path, batch: int) -> Runtime:
        with self.once():
            return self.backend.open(path, threads=self.threads, batch=batch, **self.options)

    @contextlib.contextmanager
    def once(self) -> Iterator[None]:
        """Pass on each warning the runtime gives while loading the search's files once, not once per file (the
        file's name, which a warning starts with, removed)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for warning in caught:
            text = re.sub(r"^config_\d+\.onnx: ", "", str(warning.message))
            key = re.sub(r"\d+", "#", text)  # "3 int8 weight(s) ..." and "4 int8 weight(s) ..." are one warning
            if key not in self.said:
                self.said.add(key)
                warnings.warn(f"tune: {text}", warning.category, stacklevel=3)


def _runtime_for(target: Target, runtime: str | None) -> Backend:
    """The backend of ``runtime`` (default: ``target``'s first native runtime), checked: ``target`` supports it and
    it is installed here."""
    usable = [support for support in target.runtimes if support.verdict != "refuses"]
    if runtime is None:
        native = [support for support in usable if support.verdict == "native"]
        if not native:
            raise QdqConfigError(f"target {target.name!r} names no native runtime to time its files on: pass "
                                 f"runtime= (one of {[s.runtime for s in usable]}).")  # fmt: skip
        runtime = str(native[0].runtime)
    backend = get_backend(runtime)
    support = target.support(backend.name)
    if support is None or support.verdict == "refuses":
        why = f": {support.reason}" if support is not None else ""
        raise QdqConfigError(f"target {target.name!r} does not run on {backend.name!r}{why}. tune scores and times "
                             f"on a runtime the target supports: {[s.runtime for s in usable]}.")  # fmt: skip
    if not backend.available():
        raise QdqConfigError(f"tune scores and times every configuration on runtime {backend.name!r}, which is not "
                             f"installed here: {backend.install or 'install its package'}; or pass runtime= one of "
                             f"{[s.runtime for s in usable]}.")  # fmt: skip
    return backend


def _joined(runs: list[list[np.ndarray]]) -> Outputs:
    """Per-batch outputs as one array per graph output, batches concatenated on axis 0."""
    return [np.concatenate([np.asarray(run[i], np.float32) for run in runs]) for i in range(len(runs[0]))]


def _spread(blocks: np.ndarray) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) of interleaved block timings, ms."""
    low, high = np.percentile(blocks, [25, 75])
    return float(np.median(blocks)), float(low), float(high)


def _cost(cost: tuple[float, float, float]) -> str:
    return f"{cost[0]:+.2f} ({cost[1]:+.2f} to {cost[2]:+.2f})"


def _made_by(model: onnx.ModelProto) -> dict[str, str]:
    """Tensor name -> what computes it: its node's op type, with the module it belongs to where the exporter
    recorded its name scopes (torch's dynamo exporter: ``pkg.torch.onnx.name_scopes``), e.g.
    ``"Softmax in blocks.2.attn"``; ``"graph input"`` for an input."""
    found = {value.name: "graph input" for value in model.graph.input}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        module = ""
        if scopes:
            try:
                path = ast.literal_eval(scopes)
            except (ValueError, SyntaxError):
                path = []
            module = str(path[-2]) if isinstance(path, list) and len(path) >= 2 else ""
        for output in node.output:
            found[output] = f"{node.op_type} in {module}" if module else node.op_type
    return found


def _sqnr(reference: Outputs, outputs: Outputs) -> float:
    """SQNR (dB) of ``outputs`` against ``reference``, all outputs together."""
    signal = sum(float(np.sum(np.square(r, dtype=np.float64))) for r in reference)
    noise = sum(float(np.sum(np.square(r - o, dtype=np.float64))) for r, o in zip(reference, outputs))
    return sqnr_db(signal, noise)


def _unit_sqnr(arrays: list[np.ndarray], amax: np.ndarray | None) -> float:
    """SQNR (dB) of ``arrays`` fake-quantized on the signed 8-bit grid of ``amax`` (or uint8 where >= 0)."""
    if amax is None:
        return math.inf
    bound = torch.tensor(float(np.max(amax)))
    if bound <= 0:
        return -math.inf
    signal = noise = 0.0
    for x in arrays:
        values = torch.from_numpy(np.asarray(x, np.float32))
        quantized = fake_tensor_quant(values, bound, 8, unsigned=bool((values >= 0).all()))
        signal += float(values.double().square().sum())
        noise += float((values - quantized).double().square().sum())
    return sqnr_db(signal, noise)


def _advice(fp32: Trial, int8: Trial, chosen: Trial | None) -> str | None:
    if int8.latency is not None and fp32.latency is not None and int8.latency >= fp32.latency:
        return ("Even the full INT8 file runs no faster than FP32 on this runtime and machine (an x86 CPU without "
                "VNNI, or a model too small for int8 kernels to pay): keep FP32 here, or deploy where int8 kernels "
                "are fast (a VNNI/AMX CPU, TensorRT).")  # fmt: skip
    if chosen is None:
        return ("No configuration met the budget: raise max_steps (or max_candidates), or fine-tune with "
                "quantization-aware training (docs/guides/qat.md).")  # fmt: skip
    if chosen.latency is not None and fp32.latency is not None and chosen.latency >= fp32.latency:
        return ("The configuration that meets the budget is no faster than FP32: quantization-aware training "
                "(docs/guides/qat.md) is the next step.")  # fmt: skip
    return None

"""The entry point: :func:`tune`."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from qdq.atomic import atomic_open
from qdq.errors import QdqConfigError
from qdq.targets import Target, resolve_target
from qdq.targets.registry import CPU_DEFAULT_TARGET
from qdq.tuning.budget import Budget
from qdq.tuning.engine import Engine, runtime_for
from qdq.tuning.evaluation import Evaluator
from qdq.tuning.result import TuneResult, advice
from qdq.tuning.search import precision_variants, search
from qdq.tuning.sources import onnx_source, splits
from qdq.tuning.timing import choose, confirm, time_trials, unit_costs
from qdq.workflow.progress import Progress

__all__ = ["tune"]


def tune(
    model: str | Path | nn.Module,
    calibration_data: Iterable[Any],
    eval_data: Sequence[Any],
    path: str | Path,
    *,
    budget: Budget,
    target: str | Target = CPU_DEFAULT_TARGET,
    runtime: str | None = None,
    runtime_options: Mapping[str, Any] | None = None,
    method: str = "auto",
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
        model: the FP32 ONNX file, or a float PyTorch model: it is exported to FP32 ONNX for ``target``
            (:func:`qdq.export.export_float_onnx`, the first calibration batch as the example) and every batch is
            read by qdq's batch convention (:mod:`qdq.utils.batches`: a tensor, positional inputs, keyword inputs,
            ``(inputs, labels)`` pairs) into a dict of graph input name -> array, its labels under
            ``"labels"`` (what a budget's metric reads); or a float Keras model: exported for ``target`` by
            :func:`qdq.keras.export_float_onnx`, its batches arrays, lists of arrays (several inputs, in the model's
            order) or ``(inputs, labels)`` pairs.
        calibration_data: batches (dicts of graph input name -> array) for the one calibration.
        eval_data: the batches the budget is scored on during the search (keys that are not graph inputs, such as
            labels, are passed to the budget's metric only).
        path: where the chosen file goes.
        budget: what must hold (:class:`~qdq.tuning.budget.Budget`).
        target: the placement target (``"onnxruntime"``, the default as on the command line since every file is
            timed on this machine; ``"tensorrt"`` or one you registered); its placement gives the units of choice.
            For ``"tensorrt"``, ``target_options={"float": "float16"}`` (a quantize option) makes every unit left
            float run in FP16, as TensorRT 11 builds it.
        runtime: where every configuration is scored and timed: a registered runtime the target supports
            (:attr:`qdq.targets.Target.runtimes`, not one that refuses its files); default: the target's first
            native runtime (``"onnxruntime"`` for ``"onnxruntime"``, ``"tensorrt"`` for ``"tensorrt"``). The FP32
            reference outputs are the float file's on ONNX Runtime (its backend).
        runtime_options: the runtime's load options (:meth:`qdq.runtime.Backend.open`: ``precision`` for
            OpenVINO, ``workspace_mib`` for TensorRT, ...).
        method: the calibration method of the one calibration; default ``"auto"``, :func:`qdq.quantize_onnx`'s own
            (the ops its stem leaves float stay float in every configuration).
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
        A :class:`~qdq.tuning.result.TuneResult`; ``result.report()`` is the Markdown report, ``result.plot(png)``
        the Pareto plot.

    Raises:
        QdqConfigError: a model that is not an ONNX file, a PyTorch or a Keras model, too little evaluation data, a
            runtime the target does not support or that is not installed.
    """
    started = time.perf_counter()
    if max_loaded < 3:
        raise QdqConfigError(f"max_loaded={max_loaded}: timing needs at least 3 files loaded at once (FP32, INT8 and "
                             "one configuration).")  # fmt: skip
    place_for = resolve_target(target)
    backend = runtime_for(place_for, runtime)
    with tempfile.TemporaryDirectory(prefix="qdq-tune-") as folder:
        work = Path(folder)
        source, calibration_data, eval_data, holdout_data = onnx_source(model, calibration_data, eval_data,
                                                                        holdout_data, work, place_for)  # fmt: skip
        tuning, holdout = splits(eval_data, holdout_data)
        ev = Evaluator(source, calibration_data, tuning, holdout, budget, work, method,
                       Engine(place_for, backend, threads, dict(runtime_options or {})), progress,
                       quantize_options)  # fmt: skip
        search(ev, max_candidates, max_steps)
        precision_variants(ev)
        time_trials(ev, rounds, iters, max_loaded)
        confirm(ev, rounds, iters)
        chosen = choose(ev.trials, ev.budget)
        written = None
        if chosen is not None and chosen.path is not None:
            with atomic_open(path) as out, open(chosen.path, "rb") as chosen_file:
                shutil.copyfileobj(chosen_file, out)
            written = Path(path)
        for trial in ev.trials:
            trial.path = None
        return TuneResult(
            path=written, budget=ev.budget, fp32=ev.fp32, int8=ev.trials[0], chosen=chosen, trials=ev.trials,
            gains=ev.gains, evaluations=ev.evaluations, files=ev.files, made_by=ev.made_by, runtime=backend.name,
            builds=ev.builds, calibrations=1, seconds=time.perf_counter() - started, batch=ev.batch,
            unit_ms=unit_costs(ev.trials, chosen), advice=advice(ev.fp32, ev.trials[0], chosen),
        )  # fmt: skip

"""One search's state: the prepared FP32 model, the data, the FP32 reference, the one calibration, every configuration
written and scored (:class:`Evaluator`), and what it cost."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qdq.export.onnx_export import float_graph_export
from qdq.onnx_in.bias_correction import BiasShift
from qdq.onnx_in.prepared import PreparedModel
from qdq.onnx_in.quantize import quantize_onnx
from qdq.runtime import Runtime
from qdq.tuning.budget import Batch, Budget, Outputs
from qdq.tuning.engine import Engine
from qdq.tuning.result import Trial
from qdq.tuning.sources import made_by
from qdq.workflow.equalization import Scaling
from qdq.workflow.progress import Progress

__all__ = ["Evaluator", "joined"]


class Evaluator:
    """The data, the reference outputs, every trial and what it cost; writes and scores each configuration.

    The FP32 file is loaded and prepared once (:class:`~qdq.onnx_in.prepared.PreparedModel`) and calibrated once (the
    plain INT8 file): every later file is that prepared model placed again with other tensors float, reusing the
    calibration's ranges and bias shifts.
    """

    def __init__(self, source: Path, calibration: Iterable[Batch], tuning: list[Batch], holdout: list[Batch],
                 budget: Budget, work: Path, method: str, engine: Engine, progress: Progress,
                 options: dict[str, Any]) -> None:  # fmt: skip
        self.source, self.work, self.engine, self.progress = source, work, engine, progress
        self.tuning, self.holdout, self.options, self.method = tuning, holdout, options, method
        self.trials: list[Trial] = []
        self.gains: dict[tuple[str, ...], float] = {}
        self.evaluations = self.files = self.builds = 0
        self.prepared = PreparedModel.load(source)
        self.made_by = made_by(source)
        self.inputs = self.prepared.inputs
        self.largest = max(len(next(iter(self.feed(b).values()))) for b in [*tuning, *holdout])
        self.reference = dict(zip((id(tuning), id(holdout)), self._reference(source, [tuning, holdout])))
        fp32_scores = [budget.score(self.reference[id(s)], self.reference[id(s)], s) for s in (tuning, holdout)]
        self.budget = budget.against(fp32_scores)
        self.fp32 = Trial("FP32", (), fp32_scores[0], fp32_scores[1], path=source)
        self.value_ranges: dict[str, np.ndarray] | None = None  # set by the one calibration, reused after it
        self.bias_shifts: list[BiasShift] | None = None  # the same: a layer's bias shift depends on its own ranges only
        self.equalized: list[Scaling] | None = None  # the same: the weights those ranges were calibrated with
        base = self.quantize((), calibration=calibration)
        self.value_ranges, self.bias_shifts, self.equalized = base[1], base[2], base[4]
        if base[3]:  # the stem auto left float stays float in every later file (their ranges are those of this one)
            self.options = {**options, "keep_float": [*options.get("keep_float", ()), *base[3]]}
        self.units = self.prepared.units(engine.target, self.options.get("keep_float", ()))
        self.calibration_batch = tuning[0]
        self.batch = int(next(iter(self.feed(tuning[0]).values())).shape[0])
        self.add("INT8", (), base[0])

    def feed(self, batch: Batch) -> dict[str, np.ndarray]:
        """``batch``'s graph inputs (its other keys, such as labels, are for the budget only)."""
        return {name: np.asarray(batch[name]) for name in self.inputs}

    def _reference(self, path: Path, splits: Sequence[Sequence[Batch]]) -> list[Outputs]:
        """The FP32 file's outputs on each split, computed by ONNX Runtime in float32: the float model's own."""
        with self.engine.open_reference(path) as reference:
            return [joined([reference.run(self.feed(b)) for b in split]) for split in splits]

    @contextlib.contextmanager
    def loaded(self, path: Path) -> Iterator[Runtime]:
        """``path`` built on the runtime (counted in ``builds``) for the largest evaluation batch."""
        self.builds += 1
        with self.engine.open(path, self.largest) as loaded:
            yield loaded

    def run(self, loaded: Runtime, split: Sequence[Batch]) -> Outputs:
        return joined([loaded.run(self.feed(b)) for b in split])

    def outputs(self, path: Path, split: Sequence[Batch]) -> Outputs:
        """``path``'s outputs on ``split``, computed by the runtime (one build of the file)."""
        with self.loaded(path) as loaded:
            return self.run(loaded, split)

    def quantize(self, floated: tuple[tuple[str, ...], ...], calibration: Iterable[Batch] | None = None
                 ) -> tuple[Path, dict[str, np.ndarray], list[BiasShift], list[str], list[Scaling]]:  # fmt: skip
        """The prepared model placed with the tensors of ``floated`` float, written into the work folder: calibrated
        on ``calibration`` the first time, with that calibration's ranges, bias shifts and equalization after it; the
        ops the calibration's ``auto`` kept float as the model's stem (:mod:`qdq.workflow.stem`)."""
        out = self.work / f"config_{self.files}.onnx"
        self.files += 1
        values = sorted({name for unit in floated for name in unit})
        with float_graph_export():  # the convs a configuration leaves float are its point, not a mistake
            result = quantize_onnx(self.prepared, calibration if calibration is not None else [self.tuning[0]], out,
                                   target=self.engine.target, method=self.method, float_values=values,
                                   value_ranges=self.value_ranges, bias_shifts=self.bias_shifts,
                                   equalized=self.equalized, progress=False,
                                   threads=self.engine.threads, **self.options)  # fmt: skip
        stem = result.auto.stem.ops if result.auto is not None and result.auto.stem is not None else []
        return result.path, result.value_ranges, result.bias_shifts, list(stem), result.equalized

    def score(self, split: list[Batch], outputs: Outputs) -> float:
        self.evaluations += 1
        return self.budget.score(self.reference[id(split)], outputs, split)

    def add(self, name: str, floated: tuple[tuple[str, ...], ...], path: Path | None = None) -> Trial:
        """Score a configuration (its file, written here when ``path`` is None) on the tuning data, and on the
        held-out data where the tuning score meets the budget; both on one build of the file."""
        if path is None:
            path = self.quantize(floated)[0]
        with self.loaded(path) as loaded:
            trial = Trial(name, floated, self.score(self.tuning, self.run(loaded, self.tuning)), path=path)
            if trial.score >= self.budget.threshold:
                trial.holdout = self.score(self.holdout, self.run(loaded, self.holdout))
        self.trials.append(trial)
        return trial


def joined(runs: list[list[np.ndarray]]) -> Outputs:
    """Per-batch outputs as one array per graph output, batches concatenated on axis 0."""
    return [np.concatenate([np.asarray(run[i], np.float32) for run in runs]) for i in range(len(runs[0]))]

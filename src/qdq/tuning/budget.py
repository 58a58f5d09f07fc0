"""What a tuned file must keep: :class:`Budget` (a score, its threshold, the proxy that ranks the units)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qdq.workflow.verification import sqnr_db

__all__ = ["Batch", "Budget", "Outputs", "output_sqnr"]

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
            return output_sqnr(reference, outputs)

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

    def against(self, fp32_scores: Sequence[float]) -> Budget:
        """The budget with its threshold resolved: for :meth:`drop`, ``max_drop`` below the least of FP32's scores
        on the data splits; the others as they are."""
        if self.max_drop is None:
            return self
        return Budget(self.name, self.score, min(fp32_scores) - self.max_drop, self.max_drop, self.proxy)


def output_sqnr(reference: Outputs, outputs: Outputs) -> float:
    """SQNR (dB) of ``outputs`` against ``reference``, all outputs together."""
    signal = sum(float(np.sum(np.square(r, dtype=np.float64))) for r in reference)
    noise = sum(float(np.sum(np.square(r - o, dtype=np.float64))) for r, o in zip(reference, outputs))
    return sqnr_db(signal, noise)

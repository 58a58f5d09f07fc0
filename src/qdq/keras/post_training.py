"""Post-training quantization of a Keras model: one calibration pass, every method evaluated, the best kept.

The Keras counterpart of :func:`qdq.ptq`, with its result type (:class:`~qdq.workflow.post_training.PTQResult`,
ranges as ``{"<wrapper>/input_<i>": amax}``), so reports and summaries read both alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from qdq.calib.methods import CALIBRATION_METHODS
from qdq.keras.calibration import collect_stats, forget_traced_functions, set_ranges, statistics_method
from qdq.workflow.post_training import DEFAULT_PERCENTILES, MethodResult, PTQResult, method_grid, ptq_statistics

__all__ = ["bypassed", "ptq"]


@contextlib.contextmanager
def bypassed(model: Any) -> Iterator[Any]:
    """Run ``model`` as its float original inside the block (every wrapper's Q/DQ bypassed)."""
    from qdq.keras.wrappers import wrappers_of

    wrappers = wrappers_of(model)
    previous = [w.bypass for w in wrappers]
    try:
        for wrapper in wrappers:
            wrapper.bypass = True
        forget_traced_functions(model)
        yield model
    finally:
        for wrapper, was in zip(wrappers, previous):
            wrapper.bypass = was
        forget_traced_functions(model)


def ptq(
    model: Any,
    calib_data: Iterable[Any],
    eval_fn: Callable[[Any], float],
    methods: Sequence[str] = CALIBRATION_METHODS,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    num_batches: int | None = None,
) -> PTQResult[float]:
    """Calibrate ``model`` (from :func:`qdq.keras.quantize_model`) with every method from one histogram pass
    over ``calib_data``, score each with ``eval_fn(model)`` (higher is better), and keep the best.

    ``methods`` are registered methods computed from statistics (default: :data:`qdq.calib.CALIBRATION_METHODS`,
    read when called); one histogram pass serves those that read histograms, a method that reads other statistics
    gets a pass for them. A model-level method (``auto``) is refused before any work.

    Returns:
        A :class:`~qdq.workflow.post_training.PTQResult`; the model is left with the best method's ranges.

    Raises:
        QdqConfigError: an unknown method (listing every registered one), or a model-level method.
    """
    grid = [(statistics_method(name), options) for name, options in method_grid(methods, percentiles)]
    with bypassed(model):
        float_score = float(eval_fn(model))
    passes = {kind: collect_stats(model, calib_data, kind, num_batches=num_batches)
              for kind in dict.fromkeys(ptq_statistics(method) for method, _ in grid)}  # fmt: skip
    results: list[MethodResult[float]] = []
    for method, options in grid:
        stats = passes[ptq_statistics(method)]
        ranges = stats.load(method.name, **options)
        results.append(MethodResult(method.name, options, float(eval_fn(model)), ranges))
    best = max(results, key=lambda r: r.score)  # first of equals: the grid's order breaks ties
    set_ranges(model, best.amax)
    return PTQResult(float_score, results, best)

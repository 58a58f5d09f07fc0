"""Post-training quantization of a Keras model: one calibration pass, every method evaluated, the best kept.

The Keras counterpart of :func:`qdq.ptq`, with its result type (:class:`~qdq.workflow.post_training.PTQResult`,
ranges as ``{"<wrapper>/input_<i>": amax}``), so reports and summaries read both alike.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from qdq.calib.methods import CALIBRATION_METHODS
from qdq.errors import QdqCalibrationWarning
from qdq.keras.calibration import collect_stats, forget_traced_functions, keras_method, record_auto, set_ranges
from qdq.keras.equalize import assign, restore
from qdq.workflow.auto_calibration import AutoResult
from qdq.workflow.collection import check_reiterable
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
    gets a pass for them. ``"auto"`` (:mod:`qdq.keras.auto`: the method whose outputs stay closest to the float
    model's on held-out calibration batches) runs its own pass, so ``calib_data`` must then be re-iterable (a
    list, an array, a ``tf.data.Dataset``); its row's ``quantizer_methods`` read ``"auto: <method>"``. Its
    equalization of the kernels and the stem it leaves float are kept only where it wins: the methods scored after it,
    and the model returned when another wins, have the kernels as given and their stem int8. Another model-level
    method is refused before any work.

    Returns:
        A :class:`~qdq.workflow.post_training.PTQResult`; the model is left with the best method's ranges (when
        that is ``"auto"``, :func:`qdq.keras.auto_result` says what it chose, and a
        :class:`~qdq.errors.QdqCalibrationWarning` names the ranges it chose that clip destructively).

    Raises:
        QdqConfigError: an unknown method (listing every registered one), another model-level method, or
            ``"auto"`` with other methods on a one-shot iterator.
    """
    from qdq.keras.auto import run

    grid = [(keras_method(name), options) for name, options in method_grid(methods, percentiles)]
    kinds = list(dict.fromkeys(ptq_statistics(method) for method, _ in grid if not method.model_level))
    if any(method.model_level for method, _ in grid) and kinds:
        check_reiterable(calib_data, "auto")
    with bypassed(model):
        float_score = float(eval_fn(model))
    passes = {kind: collect_stats(model, calib_data, kind, num_batches=num_batches) for kind in kinds}
    results: list[MethodResult[float]] = []
    autos: dict[int, tuple[AutoResult, str | None, dict]] = {}  # index -> auto's result, warning, equalized kernels
    for method, options in grid:
        if method.model_level:
            ranges, auto, text = run(model, calib_data, num_batches=num_batches)
            used: dict[str, str | None] = dict.fromkeys(ranges, f"auto: {auto.chosen}")
            results.append(MethodResult(method.name, options, float(eval_fn(model)), ranges, quantizer_methods=used))
            autos[len(results) - 1] = (auto, text, restore(auto.equalized))
            _keep_stem_float(model, auto, False)  # the methods scored after it: the model as given
            continue
        stats = passes[ptq_statistics(method)]
        ranges = stats.load(method.name, **options)
        results.append(MethodResult(method.name, options, float(eval_fn(model)), ranges))
    best_at = max(range(len(results)), key=lambda i: results[i].score)  # first of equals: the grid's order
    best = results[best_at]
    set_ranges(model, best.amax)
    if best_at in autos:
        auto, text, equalized = autos[best_at]
        assign(auto.equalized, equalized)
        _keep_stem_float(model, auto, True)
        record_auto(model, auto)
        if text is not None:
            warnings.warn(text, QdqCalibrationWarning, stacklevel=2)
    return PTQResult(float_score, results, best)


def _keep_stem_float(model: Any, auto: AutoResult, kept: bool) -> None:
    """The wrappers of the stem ``auto`` left float (``auto.stem.ops``) set float for good or quantizing again."""
    for name in auto.stem.ops if auto.stem is not None else []:
        model.get_layer(name).kept_float = kept
    forget_traced_functions(model)

"""Activation ranges of a quantized Keras model from data, with qdq's calibrators (``qdq.calib``).

``calibrate(qmodel, data, method)`` runs the float computation (every wrapper bypassed) over the data,
feeds each quantized input tensor to the calibrator the method reads (a :class:`~qdq.calib.MaxCalibrator` or
:class:`~qdq.calib.HistogramCalibrator` for the built-ins, with the wrapper's bit width and sign), and stores the
range the method picks in the wrappers' ``input_amax`` variables. The methods are the registered ones
(:mod:`qdq.calib.methods`: max, entropy, mse, percentile on power-of-two histograms, and any registered method
computed from statistics), the PyTorch path's, bit for bit: one implementation for both front ends. A model-level
method (``auto``) runs a pass over a PyTorch model and is refused here. ``collect_stats`` +
``CalibrationStats.load`` split the two steps (one pass, several methods: :func:`ptq`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from qdq.calib.methods import CALIBRATION_METHODS, CalibrationMethod, get_method
from qdq.calib.registry import calibrator_parameters, make_calibrator
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError, did_you_mean
from qdq.keras.graph import check_graph_model

__all__ = [
    "CALIBRATION_METHODS",
    "CalibrationStats",
    "calibrate",
    "collect_stats",
    "forget_traced_functions",
    "set_ranges",
    "statistics_method",
]


def statistics_method(method: str) -> CalibrationMethod:
    """The registered method ``method``, when the Keras front end can compute it (from statistics alone).

    Raises:
        QdqConfigError: an unknown method (listing every registered one), or a model-level method (``auto``).
    """
    chosen = get_method(method)
    if chosen.model_level:
        raise QdqConfigError(
            f"method {chosen.name!r} is not available for Keras models yet: it chooses ranges with a pass over a "
            f"PyTorch model. Use one computed from statistics: {list(CALIBRATION_METHODS)}."
        )
    return chosen


def calibrate(
    model: Any,
    data: Iterable[Any],
    method: str = "max",
    *,
    num_batches: int | None = None,
    percentile: float | None = None,
    num_bins: int | None = None,
) -> dict[str, float]:
    """Set the activation ranges of ``model`` (from :func:`qdq.keras.quantize_model`) from ``data``.

    Args:
        model: the quantized model; its wrappers are marked calibrated (static ranges from now on).
        data: batches of inputs, or ``(inputs, labels)`` pairs (a ``tf.data.Dataset`` works), or one array
            (split into batches of 32).
        method: a registered method computed from statistics (:data:`qdq.calib.CALIBRATION_METHODS`: ``"max"``,
            or on a histogram ``"entropy"``, ``"mse"``, ``"percentile"``); its statistics are collected with the
            calibrator it reads first.
        num_batches: use at most this many batches.
        percentile: for a method with a ``percentile`` option (``"percentile"``; None: its default, 99.99).
        num_bins: histogram bins, for a calibrator that takes them (default:
            :data:`qdq.calib.histogram.DEFAULT_NUM_BINS`).

    Returns:
        ``{"<wrapper>/input_<i>": amax}`` for every range set.

    Raises:
        QdqConfigError: an unknown or model-level method, no data, or a model without quantize wrappers.
        QdqCalibrationError: NaN/Inf in the activations.
    """
    chosen = statistics_method(method)
    stats = collect_stats(model, data, chosen.calibrator, num_batches=num_batches, num_bins=num_bins)
    options = {"percentile": percentile} if percentile is not None and "percentile" in chosen.options else {}
    return stats.load(chosen.name, **options)


class CalibrationStats:
    """The statistics :func:`collect_stats` gathered: one calibrator per quantized tensor and grid.

    :meth:`load` sets the model's ranges by one method; call it again with another method to compare (what
    :func:`qdq.keras.ptq` does), the statistics stay.
    """

    def __init__(self, model: Any, sites: list[tuple[Any, tuple[Any, int, int]]], calibrators: dict) -> None:
        self.model = model
        self._sites = sites
        self.calibrators = calibrators

    def ranges(self, method: str, **options: Any) -> dict[str, float]:
        """``{"<wrapper>/input_<i>": amax}`` by the registered ``method`` (``"max"``, ``"entropy"``, ``"mse"``,
        ``"percentile"`` with ``percentile=``...) with ``options`` over its defaults, without setting them.

        Raises:
            QdqConfigError: an unknown or model-level method, or statistics that cannot give it.
        """
        chosen = statistics_method(method)
        options = chosen.resolve_options(options)
        by_key = {key: _amax(cal, chosen, options) for key, cal in self.calibrators.items()}
        ranges = {f"{w.name}/input_{p}": by_key[_key(t, w, p)] for t, (w, _, p) in self._sites}
        for names, keys in self._shared():  # one range from the statistics of all the tied inputs
            merged = copy.deepcopy(self.calibrators[keys[0]])
            for key in keys[1:]:
                merged.merge(self.calibrators[key])
            amax = _amax(merged, chosen, options)
            ranges.update(dict.fromkeys(names, amax))
        return ranges

    def _shared(self) -> list[tuple[list[str], list[tuple]]]:
        """The groups of inputs that share one range (a wrapper's ``range_ties``, or all inputs of a
        ``shared_input_range`` wrapper): their ``"<wrapper>/input_<i>"`` names and the keys of their distinct
        calibrators; inputs on different grids (signed and unsigned) keep their own ranges."""
        groups: dict[Any, tuple[list[str], dict[tuple, None]]] = {}
        for tensor, (wrapper, _, position) in self._sites:
            tie = getattr(wrapper, "range_ties", {}).get(position)
            if tie is None and getattr(wrapper, "shared_input_range", False):
                tie = wrapper.name
            if tie is not None:
                names, keys = groups.setdefault(tie, ([], {}))
                names.append(f"{wrapper.name}/input_{position}")
                keys[_key(tensor, wrapper, position)] = None
        return [(names, list(keys)) for names, keys in groups.values()
                if len(keys) > 1 and len({k[1:] for k in keys}) == 1]  # fmt: skip

    def load(self, method: str, **options: Any) -> dict[str, float]:
        """Set the model's ranges by ``method`` (see :meth:`ranges`) and mark its wrappers calibrated."""
        return set_ranges(self.model, self.ranges(method, **options))

    def histograms(self) -> dict[str, Any]:
        """The histogram calibrator of each quantized input, by ``"<wrapper>/input_<i>"`` (histogram stats)."""
        return {f"{w.name}/input_{p}": self.calibrators[_key(t, w, p)] for t, (w, _, p) in self._sites}


def collect_stats(
    model: Any,
    data: Iterable[Any],
    calibrator: str = "histogram",
    *,
    num_batches: int | None = None,
    num_bins: int | None = None,
) -> CalibrationStats:
    """Run the float computation of ``model`` (wrappers bypassed) over ``data`` and gather the statistics
    of every quantized input with the registered ``calibrator`` (``"max"``, or ``"histogram"``, which serves every
    built-in method; ``num_bins`` goes to a calibrator that takes it).

    Raises:
        QdqConfigError: an unknown calibrator (listing the registered ones), no data, or a model without quantize
            wrappers.
    """
    from qdq.keras.wrappers import wrappers_of

    check_graph_model(model, "calibrate")
    bins = {"num_bins": num_bins} if num_bins is not None and "num_bins" in calibrator_parameters(calibrator) else {}
    sites = _sites(model, wrappers_of(model))
    if not sites:
        raise QdqConfigError("calibrate found no quantized inputs: quantize the model with qdq.keras.quantize_model.")
    tensors = list({id(t): t for t, _ in sites}.values())
    # one calibrator per tensor and grid: a tensor two wrappers read the same way gets one range
    calibrators = {_key(t, w, p): _calibrator(calibrator, bins, *_key(t, w, p)[1:]) for t, (w, _, p) in sites}
    n_batches = _collect(model, tensors, calibrators, data, num_batches)
    if n_batches == 0:
        raise QdqConfigError("calibrate got no data: pass at least one batch.")
    return CalibrationStats(model, sites, calibrators)


def set_ranges(model: Any, ranges: dict[str, float]) -> dict[str, float]:
    """Set input ranges by ``"<wrapper>/input_<i>"`` (as :func:`calibrate` returns them); those wrappers are
    marked calibrated. Returns ``ranges``.

    Raises:
        QdqConfigError: a name that is no quantized input of ``model``.
    """
    from qdq.keras.wrappers import wrappers_of

    slots = {}
    for wrapper in wrappers_of(model):
        n_inputs = len(wrapper._inbound_nodes[0].input_tensors)
        for slot, position in enumerate(wrapper.quantized_positions(n_inputs)):
            slots[f"{wrapper.name}/input_{position}"] = (wrapper, slot)
    unknown = [name for name in ranges if name not in slots]
    if unknown:
        hint = did_you_mean(unknown[0], slots)
        raise QdqConfigError(f"no quantized input {unknown[0]!r} in model {model.name!r}.{hint}")
    newly_static = False
    for name, amax in ranges.items():
        wrapper, slot = slots[name]
        wrapper.input_amax[slot].assign(amax)
        newly_static |= not wrapper.calibrated
        wrapper.calibrated = True
    if newly_static:  # traced functions read the ranges' values at run time, but whether they are static at trace time
        forget_traced_functions(model)
    return dict(ranges)


def _amax(calibrator: Any, method: CalibrationMethod, options: dict[str, Any]) -> float:
    amax = method.compute_amax(calibrator, **options)
    if amax is None:
        raise QdqCalibrationError(f"a quantized input saw no data: method {method.name!r} has no range to give.")
    return float(amax)


def _sites(model: Any, wrappers: list[Any]) -> list[tuple[Any, tuple[Any, int, int]]]:
    """``(input tensor, (wrapper, variable slot, input position))`` of every quantized input."""
    sites = []
    for wrapper in wrappers:
        node = wrapper._inbound_nodes[0]
        inputs = list(node.input_tensors)
        for slot, position in enumerate(wrapper.quantized_positions(len(inputs))):
            sites.append((inputs[position], (wrapper, slot, position)))
    return sites


def _key(tensor: Any, wrapper: Any, position: int) -> tuple[int, int, bool]:
    """The calibrator of a site: its tensor, its bit width and whether it is unsigned."""
    return id(tensor), wrapper.num_bits, position in wrapper.unsigned_indices


def _calibrator(kind: str, bins: dict[str, int], num_bits: int, unsigned: bool) -> Any:
    return make_calibrator(kind, num_bits=num_bits, unsigned=unsigned, **bins)


def _batches(data: Any) -> Iterable[Any]:
    if isinstance(data, np.ndarray):
        return (data[i : i + 32] for i in range(0, len(data), 32))
    return data


def _inputs_of(batch: Any) -> Any:
    if isinstance(batch, tuple) and len(batch) in (2, 3):
        return batch[0]
    return batch


def _collect(model: Any, tensors: list[Any], calibrators: dict[tuple, Any], data: Any, limit: int | None) -> int:
    """Run the float model over the batches, feeding each site's calibrator; the number of batches."""
    from qdq.keras.wrappers import wrappers_of

    if isinstance(data, (str, bytes)) or not hasattr(_batches(data), "__iter__"):
        raise QdqTypeError(f"calibrate needs an iterable of batches, got {type(data).__name__}.")
    probe = _probe_of(model, tensors)
    by_tensor: dict[int, list[Any]] = {}
    for key, calibrator in calibrators.items():
        by_tensor.setdefault(key[0], []).append(calibrator)
    probe.targets = [by_tensor[id(tensor)] for tensor in tensors]
    probe.failures = []
    wrappers = wrappers_of(model)
    for wrapper in wrappers:
        wrapper.bypass = True
    count = 0
    try:
        for batch in itertools.islice(_batches(data), limit):
            try:
                probe.forward(_inputs_of(batch))
            except Exception:
                if probe.failures:  # a calibrator's own error, not TensorFlow's wrapping of it
                    raise probe.failures[0] from None
                raise
            count += 1
    finally:
        probe.targets = []
        for wrapper in wrappers:
            wrapper.bypass = False
    return count


class _Probe:
    """The traced float forward of a quantized model that hands every quantized input to its calibrators.

    One traced function in which every quantized input, once computed, goes to the calibrators of the
    current pass (``targets``, one list per tensor) through a ``tf.py_function`` as a torch tensor over
    the same memory (DLPack, no copy): the statistics are :mod:`qdq.calib`'s own, computed by the code the
    PyTorch path runs. Collecting inside the graph lets TensorFlow free each activation after use and go
    on with the next layers while a histogram is counted (returning the 55 activations of a ResNet50 and
    counting them afterwards was measured 0.4-0.7 s slower per batch of 32 at 224x224 on 2 cores). The
    probe is kept on the model (:func:`_probe_of`), so later passes do not trace again; it runs with every
    wrapper bypassed, so nothing it traced depends on the ranges.
    """

    def __init__(self, model: Any, tensors: list[Any]) -> None:
        from qdq.keras._backend import keras, tf

        self.targets: list[list[Any]] = []
        self.failures: list[BaseException] = []
        probe = keras().Model(model.inputs, tensors)
        feeds = [self._feeder(index) for index in range(len(tensors))]

        @tf().function(reduce_retracing=True, autograph=False)  # a Keras graph: nothing for AutoGraph to convert
        def forward(inputs: Any) -> list[Any]:
            outputs = probe(inputs, training=False)
            outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
            return [
                tf().py_function(feed, [tf().cast(value, tf().float32)], tf().int32)
                for feed, value in zip(feeds, outputs)
            ]

        self.forward = forward

    def _feeder(self, index: int) -> Any:
        """The eager function a ``tf.py_function`` calls with activation ``index``: collect it."""
        import torch

        from qdq.keras._backend import tf

        def feed(value: Any) -> Any:
            try:
                shared = torch.from_dlpack(tf().experimental.dlpack.to_dlpack(value))
                for calibrator in self.targets[index]:
                    calibrator.collect(shared)
            except BaseException as error:
                self.failures.append(error)
                raise
            return np.int32(0)

        return feed


_PROBE_ATTRIBUTE = "_qdq_calibration_probe"


def _probe_of(model: Any, tensors: list[Any]) -> _Probe:
    """The model's calibration probe over ``tensors``, built (and traced) on first use."""
    key = tuple(id(tensor) for tensor in tensors)
    cached = getattr(model, _PROBE_ATTRIBUTE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    probe = _Probe(model, tensors)
    object.__setattr__(model, _PROBE_ATTRIBUTE, (key, probe))  # not a Keras-tracked attribute: never saved
    return probe


def forget_traced_functions(model: Any) -> None:
    """Make Keras re-trace fit/predict/evaluate: wrapper settings read at trace time (static ranges, bypass)
    changed."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)

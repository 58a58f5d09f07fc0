"""Activation ranges of a quantized Keras model from data, with qdq's calibrators (``qdq.calib``).

``calibrate(qmodel, data, method)`` runs the float computation (every wrapper bypassed) over the data,
feeds each quantized input tensor to the calibrator the method reads (a :class:`~qdq.calib.MaxCalibrator` or
:class:`~qdq.calib.HistogramCalibrator` for the built-ins, with the wrapper's bit width and sign), and stores the
range the method picks in the wrappers' ``input_amax`` variables. The methods are the registered ones
(:mod:`qdq.calib.methods`: max, entropy, mse, percentile on power-of-two histograms, and any registered method
computed from statistics), the PyTorch path's, bit for bit: one implementation for both front ends.
``method="auto"`` (the default, as in the other doors) chooses one of them for the whole model by the fidelity of its
outputs on calibration samples held out from setting the ranges (:mod:`qdq.keras.auto`); what it chose and what
every candidate scored is :func:`auto_result`. Another model-level method (one registered with a pass over a PyTorch
model) is refused. ``collect_stats`` + ``CalibrationStats.load`` split the two steps (one pass, several methods:
:func:`ptq`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from qdq.calib.methods import CALIBRATION_METHODS, CalibrationMethod, get_method
from qdq.calib.registry import calibrator_parameters, make_calibrator
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqTypeError, did_you_mean
from qdq.keras.graph import check_graph_model
from qdq.workflow.auto_calibration import AUTO, AutoResult
from qdq.workflow.collection import MAX_KEPT

#: ``held_out(batch index, batches held out so far, samples or None) -> samples held out`` (the last ones):
#: :func:`qdq.workflow.auto_calibration.held_out`
HeldOutRule = Callable[[int, int, int | None], int]

__all__ = [
    "CALIBRATION_METHODS",
    "CalibrationStats",
    "auto_result",
    "batches_of",
    "calibrate",
    "collect_stats",
    "forget_traced_functions",
    "inputs_of",
    "set_ranges",
    "statistics_method",
]


def statistics_method(method: str) -> CalibrationMethod:
    """The registered method ``method``, when the Keras front end can compute it from statistics alone.

    Raises:
        QdqConfigError: an unknown method (listing every registered one), or a model-level method (``auto``: it
            runs the model, :func:`calibrate` and :func:`qdq.keras.ptq` take it).
    """
    chosen = get_method(method)
    if chosen.name == AUTO:
        raise QdqConfigError(
            f"method {AUTO!r} chooses among the methods by running the quantized model: use "
            f"qdq.keras.calibrate(model, data) or qdq.keras.ptq. From statistics alone: {list(CALIBRATION_METHODS)}."
        )
    _check_keras_method(chosen)
    return chosen


def _check_keras_method(method: CalibrationMethod) -> None:
    """Refuse a model-level method other than ``auto``: its pass runs on a PyTorch model."""
    if method.model_level and method.name != AUTO:
        raise QdqConfigError(
            f"method {method.name!r} is not available for Keras models: it chooses ranges with a pass over a "
            f"PyTorch model. Use {AUTO!r} or one computed from statistics: {list(CALIBRATION_METHODS)}."
        )


def keras_method(method: str) -> CalibrationMethod:
    """The registered method ``method``, when the Keras front end runs it: ``auto`` or one computed from
    statistics.

    Raises:
        QdqConfigError: an unknown method (listing every registered one), or another model-level method.
    """
    chosen = get_method(method)
    _check_keras_method(chosen)
    return chosen


def calibrate(
    model: Any,
    data: Iterable[Any],
    method: str = "auto",
    *,
    num_batches: int | None = None,
    percentile: float | None = None,
    num_bins: int | None = None,
    equalize: bool = True,
) -> dict[str, float]:
    """Set the activation ranges of ``model`` (from :func:`qdq.keras.quantize_model`) from ``data``.

    Args:
        model: the quantized model; its wrappers are marked calibrated (static ranges from now on).
        data: batches of inputs, or ``(inputs, labels)`` pairs (a ``tf.data.Dataset`` works), or one array
            (split into batches of 32).
        method: ``"auto"`` (the default): the method whose quantized outputs stay closest to the float model's on
            calibration samples held out from setting the ranges (:mod:`qdq.keras.auto`: the last quarter of each
            batch, of 8 at most; :func:`auto_result` says what it chose and why); or a registered method
            computed from statistics (:data:`qdq.calib.CALIBRATION_METHODS`: ``"max"``, or on a histogram
            ``"entropy"``, ``"mse"``, ``"percentile"``), whose statistics are collected with the calibrator it reads
            first.
        num_batches: use at most this many batches.
        percentile: for a method with a ``percentile`` option (``"percentile"``; None: its default, 99.99);
            ignored by ``"auto"``, whose candidates take their defaults.
        num_bins: histogram bins, for a calibrator that takes them (default:
            :data:`qdq.calib.histogram.DEFAULT_NUM_BINS`).
        equalize: with ``"auto"``, first rescale the channels between two quantized convolutions through their
            ReLU-like activation where that predicts less output noise (:mod:`qdq.keras.equalize`: the kernels,
            or a BatchNormalization's gamma and beta, change in place; undone where the held-out samples clearly
            score it lower).

    Returns:
        ``{"<wrapper>/input_<i>": amax}`` for every range set.

    With ``"auto"``, a :class:`~qdq.errors.QdqCalibrationWarning` names the quantizers whose chosen range clips a
    large share of their activation's energy (the diagnostics call it destructive; auto keeps such a range only when
    it scores well above every range that does not).

    Raises:
        QdqConfigError: an unknown method or a model-level one other than ``"auto"``, no data, or a model without
            quantize wrappers.
        QdqCalibrationError: NaN/Inf in the activations.
    """
    chosen = keras_method(method)
    if chosen.model_level:
        from qdq.keras.auto import select

        ranges, _ = select(model, data, num_batches=num_batches, num_bins=num_bins, equalize=equalize)
        return ranges
    stats = collect_stats(model, data, chosen.calibrator, num_batches=num_batches, num_bins=num_bins)
    options = {"percentile": percentile} if percentile is not None and "percentile" in chosen.options else {}
    return stats.load(chosen.name, **options)


class CalibrationStats:
    """The statistics :func:`collect_stats` gathered: one calibrator per quantized tensor and grid.

    :meth:`load` sets the model's ranges by one method; call it again with another method to compare (what
    :func:`qdq.keras.ptq` does), the statistics stay.

    With samples held out (``collect_stats(..., held_out=...)``, what ``method="auto"`` scores on): ``held_out``
    has the statistics of those samples apart (same keys as ``calibrators``, which have the other samples'; the
    ranges come from ``calibrators`` alone until :meth:`merge_held_out`), and ``scored`` the held-out inputs, batch
    by batch, each with the float model's outputs on them (a flat list of arrays, in ``model.outputs`` order); when
    nothing was held out (too few batches that cannot be split), ``held_out`` is empty and ``scored`` has the first
    batches (at most :data:`qdq.workflow.collection.MAX_KEPT`) with theirs.
    """

    def __init__(
        self,
        model: Any,
        sites: list[tuple[Any, tuple[Any, int, int]]],
        calibrators: dict,
        held_out: dict | None = None,
        scored: list[tuple[Any, list[np.ndarray]]] | None = None,
    ) -> None:
        self.model = model
        self._sites = sites
        self.calibrators = calibrators
        self.held_out = held_out or {}
        self.scored = scored or []

    def merge_held_out(self) -> None:
        """Add the held-out samples' statistics to the others' (the ranges then come from every sample)."""
        for key, calibrator in self.held_out.items():
            self.calibrators[key].merge(calibrator)
        self.held_out = {}

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
    held_out: HeldOutRule | None = None,
) -> CalibrationStats:
    """Run the float computation of ``model`` (wrappers bypassed) over ``data`` and gather the statistics
    of every quantized input with the registered ``calibrator`` (``"max"``, or ``"histogram"``, which serves every
    built-in method; ``num_bins`` goes to a calibrator that takes it).

    ``held_out(index, batches held out so far, samples)`` says how many of a batch's last samples (along dimension 0
    of its inputs, when the model's inputs have a batch axis; else the whole batch) have their statistics kept apart
    and their inputs and float outputs kept (:class:`CalibrationStats` ``held_out`` and ``scored``;
    ``method="auto"`` passes :func:`qdq.workflow.auto_calibration.held_out`: the last quarter of a batch).

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
    stats = CalibrationStats(model, sites, calibrators)
    if held_out is not None:
        stats.held_out = {key: _calibrator(calibrator, bins, *key[1:]) for key in calibrators}
    n_batches = _collect(model, tensors, stats, data, num_batches, held_out)
    if n_batches == 0:
        raise QdqConfigError("calibrate got no data: pass at least one batch.")
    return stats


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
    record_auto(model, None)  # these ranges are not (or not yet) auto's choice
    newly_static = False
    for name, amax in ranges.items():
        wrapper, slot = slots[name]
        wrapper.input_amax[slot].assign(amax)
        newly_static |= not wrapper.calibrated
        wrapper.calibrated = True
    if newly_static:  # traced functions read the ranges' values at run time, but whether they are static at trace time
        forget_traced_functions(model)
    return dict(ranges)


_AUTO_ATTRIBUTE = "_qdq_auto_result"


def auto_result(model: Any) -> AutoResult | None:
    """What ``method="auto"`` chose for ``model``'s current ranges, and what every candidate scored.

    :func:`calibrate` (``method="auto"``, the default) and :func:`qdq.keras.ptq` (when ``"auto"`` is the best)
    record it on the model; ranges set any other way (another method, :func:`set_ranges`) clear it. It lives on this
    model object only (it is not saved with the model).

    Returns:
        A :class:`qdq.workflow.auto_calibration.AutoResult` (``chosen``, ``scores`` in dB, ``clipping``: the
        quantizers each candidate clips destructively, ``summary()``, ``table()``), or None.

    Example:
        >>> qk.calibrate(qmodel, batches)
        >>> print(qk.auto_result(qmodel).table())
    """
    return getattr(model, _AUTO_ATTRIBUTE, None)


def record_auto(model: Any, result: AutoResult | None) -> None:
    """Record ``result`` as what chose ``model``'s ranges (:func:`auto_result`); None forgets it."""
    object.__setattr__(model, _AUTO_ATTRIBUTE, result)  # not a Keras-tracked attribute: never saved


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


def _targets(tensors: list[Any], calibrators: dict[tuple, Any]) -> list[list[Any]]:
    """The calibrators each tensor feeds (one per grid it is read on), in ``tensors`` order."""
    by_tensor: dict[int, list[Any]] = {}
    for key, calibrator in calibrators.items():
        by_tensor.setdefault(key[0], []).append(calibrator)
    return [by_tensor.get(id(tensor), []) for tensor in tensors]


def batches_of(data: Any) -> Iterable[Any]:
    """``data`` as batches: one array split into batches of 32, anything else as it is."""
    if isinstance(data, np.ndarray):
        return (data[i : i + 32] for i in range(0, len(data), 32))
    return data


def inputs_of(batch: Any) -> Any:
    """A batch's model inputs: the first of an ``(inputs, labels[, weights])`` tuple, else the batch."""
    if isinstance(batch, tuple) and len(batch) in (2, 3):
        return batch[0]
    return batch


def _collect(
    model: Any,
    tensors: list[Any],
    stats: CalibrationStats,
    data: Any,
    limit: int | None,
    held_out: HeldOutRule | None,
) -> int:
    """Run the float model over the batches, feeding each site's calibrator; the number of batches. With
    ``held_out``, the samples it picks (the last ones of a batch) feed those of ``stats.held_out`` instead, and their
    inputs and float outputs go to ``stats.scored``."""
    from qdq.keras.wrappers import wrappers_of

    if isinstance(data, (str, bytes)) or not hasattr(batches_of(data), "__iter__"):
        raise QdqTypeError(f"calibrate needs an iterable of batches, got {type(data).__name__}.")
    probe = _probe_of(model, tensors)
    targets = {id(c): _targets(tensors, c) for c in (stats.calibrators, stats.held_out)}
    batched = all(tensor.shape[0] is None for tensor in model.inputs)  # dimension 0 is the batch axis
    probe.failures = []
    wrappers = wrappers_of(model)
    for wrapper in wrappers:
        wrapper.bypass = True
    count = 0
    kept: list[tuple[Any, list[np.ndarray]]] = []
    first: list[tuple[Any, list[np.ndarray]]] = []
    try:
        for batch in itertools.islice(batches_of(data), limit):
            inputs = inputs_of(batch)
            aside = held_out(count, len(kept), _samples(inputs, batched)) if held_out is not None else 0
            for part, into in zip(_split(inputs, aside), (stats.calibrators, stats.held_out)):
                if part is None:
                    continue
                keep = into is stats.held_out or (held_out is not None and not kept and len(first) < MAX_KEPT)
                probe.targets = targets[id(into)]
                try:
                    outputs = probe.forward_with_outputs(part)[1] if keep else probe.forward(part)
                except Exception:
                    if probe.failures:  # a calibrator's own error, not TensorFlow's wrapping of it
                        raise probe.failures[0] from None
                    raise
                if keep:
                    (kept if into is stats.held_out else first).append((part, [np.asarray(v) for v in outputs]))
            count += 1
        stats.scored = kept or first
        if not kept:  # nothing was held out (too few batches that cannot be split): nothing apart
            stats.held_out = {}
    finally:
        probe.targets = []
        for wrapper in wrappers:
            wrapper.bypass = False
    return count


def _samples(inputs: Any, batched: bool) -> int | None:
    """The samples of a batch's ``inputs``: dimension 0 of every array, of one size, where the model's inputs have a
    batch axis; else None (a batch that cannot be split)."""
    from qdq.keras._backend import keras

    sizes = {tuple(value.shape[:1]) for value in keras().tree.flatten(inputs) if hasattr(value, "shape")}
    if not batched or len(sizes) != 1:
        return None
    (size,) = sizes
    return int(size[0]) if size and size[0] is not None else None


def _split(inputs: Any, aside: int) -> tuple[Any | None, Any | None]:
    """``inputs`` as (the samples kept, the last ``aside`` held out); None for an empty part. Inputs that cannot be
    split are held out whole when ``aside`` > 0."""
    from qdq.keras._backend import keras

    size = _samples(inputs, True)
    if not aside:
        return inputs, None
    if size is None or aside >= size:
        return None, inputs
    cut = size - aside
    return (keras().tree.map_structure(lambda value: value[:cut], inputs),
            keras().tree.map_structure(lambda value: value[cut:], inputs))  # fmt: skip


class _Probe:
    """The traced float forward of a quantized model that hands every quantized input to its calibrators.

    One traced function in which every quantized input, once computed, goes to the calibrators of the
    current pass (``targets``, one list per tensor) through a ``tf.py_function`` as a torch tensor over
    the same memory (DLPack, no copy): the statistics are :mod:`qdq.calib`'s own, computed by the code the
    PyTorch path runs. Collecting inside the graph lets TensorFlow free each activation after use and go
    on with the next layers while a histogram is counted (returning every activation and counting them
    afterwards holds them all at once, and was measured slower). The
    probe is kept on the model (:func:`_probe_of`), so later passes do not trace again; it runs with every
    wrapper bypassed, so nothing it traced depends on the ranges. ``forward_with_outputs`` also returns the
    float model's outputs (the samples ``method="auto"`` holds out); ``forward`` leaves them out, and TensorFlow
    prunes the layers only they need.
    """

    def __init__(self, model: Any, tensors: list[Any]) -> None:
        from qdq.keras._backend import keras, tf

        self.targets: list[list[Any]] = []
        self.failures: list[BaseException] = []
        probe = keras().Model(model.inputs, [*tensors, *model.outputs])
        feeds = [self._feeder(index) for index in range(len(tensors))]

        def run(inputs: Any) -> tuple[list[Any], list[Any]]:
            values = probe(inputs, training=False)
            values = list(values) if isinstance(values, list | tuple) else [values]
            collected = [
                tf().py_function(feed, [tf().cast(value, tf().float32)], tf().int32)
                for feed, value in zip(feeds, values)
            ]
            return collected, values[len(tensors) :]

        traced = tf().function(reduce_retracing=True, autograph=False)  # a Keras graph: nothing for AutoGraph
        self._forward = traced(lambda inputs: run(inputs)[0])
        self._forward_with_outputs = traced(run)  # (collected, outputs)
        self._batched = all(tensor.shape[0] is None for tensor in model.inputs)
        self._general: set[int] = set()

    def forward(self, inputs: Any) -> Any:
        """Collect ``inputs``' activations."""
        return self._call(self._forward, inputs)

    def forward_with_outputs(self, inputs: Any) -> Any:
        """Collect ``inputs``' activations; ``(collected, the float model's outputs)``."""
        return self._call(self._forward_with_outputs, inputs)

    def traces(self) -> int:
        """How many times its functions were traced."""
        return int(self._forward.experimental_get_tracing_count()
                   + self._forward_with_outputs.experimental_get_tracing_count())  # fmt: skip

    def _call(self, function: Any, inputs: Any) -> Any:
        """``function`` on ``inputs``, traced once for every batch size where the model's inputs have a batch axis: a
        held-out cut, a last smaller batch, runs the same trace (each trace of a large model takes seconds)."""
        from qdq.keras._backend import keras, tf

        if self._batched and id(function) not in self._general:
            specs = keras().tree.map_structure(
                lambda value: tf().TensorSpec([None, *np.shape(value)[1:]], tf().as_dtype(value.dtype)), inputs)
            function.get_concrete_function(specs)
            self._general.add(id(function))
        return function(inputs)

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

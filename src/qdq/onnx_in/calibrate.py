"""Ranges for the quantizers of an ONNX model's view, from the float model run on ONNX Runtime.

Every tensor a quantizer reads is made an output of a copy of the float model; each batch runs once and each
observed tensor goes straight into its quantizer's calibrator (:mod:`qdq.calib`: the PyTorch path's max and
power-of-two histogram calibrators, the same algorithms bit for bit), then is dropped: memory holds one batch's
tensors and a fixed-size histogram per quantizer, whatever the number of batches. Any batch size and any dynamic
axis work (the calibrators merge tensors of any shape). A quantizer with several sites (one range for the tensors
around a MaxPool) collects all of them. Weights are ranged from the weights themselves (max per channel, or the
``weight_method``).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from qdq.calib import make_calibrator
from qdq.calib.methods import get_method
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.graphs.onnx import feed_inputs
from qdq.graphs.onnx_session import ort_session as session_of
from qdq.graphs.onnx_session import probe_model as graph_probe
from qdq.graphs.onnx_types import value_dims
from qdq.graphs.view import GraphView, Quantizer
from qdq.onnx_in.samples import Feed, SampleAxes, split
from qdq.onnx_in.subgraphs import expose
from qdq.onnx_in.view import keep_unreached_float, weight_axis
from qdq.workflow.progress import Progress, counter

__all__ = ["Statistics", "WeightCache", "batch_feed", "collect", "kept_parts", "ort_session",
           "weight_ranges"]

#: with ``held_out``, :func:`collect` keeps at most this many of the first batches when none is held out
MAX_KEPT = 8

@dataclass
class Statistics:
    """What calibration collected: a calibrator per activation quantizer (by ``id``), the batches seen.

    With a ``held_out`` choice of batches (:func:`collect`): ``held_out`` has the statistics of those batches (by
    quantizer ``id``; ``calibrators`` the others'), ``scored`` those batches' feeds with the float model's outputs
    (in the graph's output order), or, when none was held out, the first batches' (at most ``MAX_KEPT``).
    """

    calibrators: dict[int, Any]
    quantizers: dict[int, Quantizer]
    batches: int
    held_out: dict[int, Any] = field(default_factory=dict)
    scored: list[tuple[dict[str, np.ndarray], list[np.ndarray]]] = field(default_factory=list)
    #: where the feeds and outputs hold their samples (:mod:`qdq.onnx_in.samples`; None: a batch cannot be cut)
    axes: SampleAxes | None = None

    def merge_held_out(self) -> None:
        """Add the held-out batches' statistics to the others' (the ranges then come from every batch)."""
        for key, calibrator in self.held_out.items():
            if key in self.calibrators and getattr(calibrator, "has_data", False):
                self.calibrators[key].merge(calibrator)
        self.held_out = {}

    def ranges(self, method: str, keys: Collection[int] | None = None, **options: Any) -> dict[int, np.ndarray]:
        """Every activation quantizer's (those of ``keys`` only, when given) float32 amax by a registered
        statistics-level ``method``."""
        chosen = get_method(method)
        resolved = chosen.resolve_options(options)
        found = {}
        for key, calibrator in self.calibrators.items():
            if keys is not None and key not in keys:
                continue
            amax = chosen.compute_amax(calibrator, **resolved)
            if amax is None:
                raise QdqCalibrationError(f"quantizer {key} saw no data during calibration.")
            found[key] = np.asarray(amax.detach().cpu().numpy() if torch.is_tensor(amax) else amax, np.float32)
        return found


def collect(
    model: onnx.ModelProto,
    view: GraphView,
    data: Iterable[Mapping[str, np.ndarray]],
    calibrator: str,
    *,
    num_batches: int | None = None,
    threads: int | None = None,
    progress: Progress = True,
    held_out: HeldOutRule | None = None,
) -> Statistics:
    """Run the float ``model`` over ``data`` (dicts of graph input name -> array) and collect every activation
    quantizer's statistics with ``calibrator`` (``"max"`` or ``"histogram"``). A quantizer the data never reached
    (inside an ``If`` branch no batch took) goes from ``view``, the ops reading through it left float.

    ``held_out(index, batches held out so far, samples)`` says how many of a batch's last samples (along the axes the
    model declares for them, :mod:`qdq.onnx_in.samples`; else the whole batch) have their statistics kept apart and
    their feeds and float outputs kept (:class:`Statistics`; ``method="auto"`` scores its candidates on them).

    Raises:
        QdqConfigError: no data, a batch that is not a dict of the graph's inputs.
    """
    quantizers = {id(q): q for q in view.quantizers() if not q.per_channel}
    tensors = sorted({site.value.name for q in quantizers.values() for site in q.sites})
    calibrators = {key: make_calibrator(calibrator, unsigned=q.unsigned) for key, q in quantizers.items()}
    apart = {key: make_calibrator(calibrator, unsigned=q.unsigned) for key, q in quantizers.items()} if held_out else {}
    reading = {key: sorted({site.value.name for site in q.sites}) for key, q in quantizers.items()}
    probe = probe_model(model, tensors)
    declared = feed_inputs(model)
    graph_outputs = [o.name for o in model.graph.output]
    axes = SampleAxes.of(model)
    kept: list[tuple[dict[str, np.ndarray], list[np.ndarray]]] = []
    first: list[tuple[dict[str, np.ndarray], list[np.ndarray]]] = []
    with tempfile.TemporaryDirectory(prefix="qdq-calibrate-") as folder:
        session = ort_session(probe, Path(folder), threads)
        total = len(data) if isinstance(data, list | tuple) else None
        bar = counter(progress, "calibration", min(filter(None, (num_batches, total)), default=0))
        seen, reached = 0, set()
        for batch in _batches(data, num_batches):
            feed = batch_feed(batch, declared, seen)
            samples = axes.samples(feed) if axes is not None else None
            aside = held_out(seen, len(kept), samples) if held_out is not None else 0
            for part, into in zip(split(axes, feed, aside), (calibrators, apart)):
                if part is None:
                    continue
                keep = into is apart or (held_out is not None and not kept and len(first) < MAX_KEPT)
                fetched = list(dict.fromkeys([*tensors, *graph_outputs])) if keep else tensors
                outputs = dict(zip(fetched, session.run(fetched, part)))
                if keep:
                    (kept if into is apart else first).append((part, [outputs[name] for name in graph_outputs]))
                for key, names in reading.items():
                    for name in (n for n in names if outputs[n].size):  # empty: an If branch this batch did not take
                        into[key].collect(torch.from_numpy(np.ascontiguousarray(outputs[name], np.float32)))
                        reached.add(key)
                del outputs
            seen += 1
            bar.update()
        bar.close()
    if seen == 0:
        raise QdqConfigError(
            "quantize_onnx got no calibration data: pass an iterable of batches, each a dict of graph input name "
            "-> array (a few hundred representative samples). qdq never calibrates on random data."
        )
    keep_unreached_float(view, [q for key, q in quantizers.items() if key not in reached])
    statistics = Statistics({k: c for k, c in calibrators.items() if k in reached},
                            {k: q for k, q in quantizers.items() if k in reached}, seen,
                            {k: c for k, c in apart.items() if k in reached}, kept or first, axes)  # fmt: skip
    unseen = [k for k, c in statistics.calibrators.items() if not getattr(c, "has_data", True)]
    if unseen:  # reached on held-out batches alone: their statistics are all there is
        statistics.merge_held_out()
    return statistics


WeightCache = dict[tuple[str, int, str, bytes], np.ndarray]
"""Weight ranges already computed in one ``quantize_onnx`` call, by (method, axis, initializer name, digest of its
values): the stem's trials, equalization's check and the file written read the same weights again."""


def weight_ranges(model: onnx.ModelProto, view: GraphView, method: str = "max",
                  cache: WeightCache | None = None) -> dict[int, np.ndarray]:  # fmt: skip
    """The per-channel float32 amax of every weight quantizer of ``view`` (``method``: a weight method); ``cache``
    keeps those computed (a weight whose values changed, equalized, is computed again)."""
    chosen = get_method(method)
    if not chosen.weights:
        raise QdqConfigError(f"method {method!r} cannot set a weight's range; use 'max', 'mse' or 'percentile'.")
    inits = {t.name: t for t in model.graph.initializer}
    found = {}
    for quantizer in view.quantizers():
        if not quantizer.per_channel:
            continue
        site = quantizer.sites[0]
        weight = numpy_helper.to_array(inits[site.value.name]).astype(np.float32)
        axis = weight_axis(site.input_reader, site.index) % weight.ndim
        key = (method, axis, site.value.name, hashlib.blake2b(weight.tobytes(), digest_size=16).digest())
        if cache is not None and key in cache:
            found[id(quantizer)] = cache[key]
            continue
        channels = np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)
        calibrator = make_calibrator(chosen.calibrator, axis=0)
        calibrator.collect(torch.from_numpy(np.ascontiguousarray(channels)))
        amax = chosen.compute_amax(calibrator, **chosen.resolve_options({}))
        found[id(quantizer)] = np.asarray(amax.detach().numpy(), np.float32).reshape(-1)
        if cache is not None:
            cache[key] = found[id(quantizer)]
    return found


def ort_session(model: onnx.ModelProto, folder: Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session of ``model`` from the one session factory
    (:func:`qdq.graphs.onnx_session.ort_session`); a model over protobuf's 2 GB limit goes through ``folder``."""
    return session_of(model, threads=threads, folder=folder)


def probe_model(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also returns every tensor in ``tensors`` (the one probe,
    :func:`qdq.graphs.onnx_session.probe_model`; those computed inside ``If`` branches returned through each ``If``)."""
    return graph_probe(model, tensors, expose)


HeldOutRule = Callable[[int, int, int | None], int]
"""``held_out(batch index, batches held out so far, samples or None) -> samples held out`` (the last ones)."""


def kept_parts(model: onnx.ModelProto, batches: Sequence[Any], held_out: HeldOutRule) -> list[Feed]:
    """The first ``batches`` as :func:`collect` reads them with ``held_out``, without their held-out samples."""
    declared, axes, parts = feed_inputs(model), SampleAxes.of(model), []
    for index, batch in enumerate(batches):
        feed = batch_feed(batch, declared, index)
        part, _ = split(axes, feed, held_out(index, 0, axes.samples(feed) if axes is not None else None))
        parts += [part] if part is not None else []
    return parts


def _batches(data: Iterable[Any], limit: int | None) -> Iterable[Any]:
    if data is None or isinstance(data, str | bytes | Mapping) or not hasattr(data, "__iter__"):
        raise QdqConfigError(
            f"calibration data must be an iterable of batches (dicts of graph input name -> array), got "
            f"{type(data).__name__}. Wrap one batch in a list: [{{'input': array}}]."
        )
    for number, batch in enumerate(data):
        if limit is not None and number >= limit:
            return
        yield batch


def batch_feed(batch: Any, declared: Sequence[Any], number: int) -> dict[str, np.ndarray]:
    """Calibration batch ``number`` as a feed of the graph inputs ``declared`` (their ``ValueInfoProto``:
    :func:`qdq.graphs.onnx.feed_inputs`), checked against the dimensions the graph fixes.

    Raises:
        QdqConfigError: not a dict of the graph's inputs (a one-input model also takes an array), or an array whose
            rank or fixed dimensions are not the graph's.
    """
    inputs = [value.name for value in declared]
    if not isinstance(batch, Mapping):
        if len(inputs) == 1 and hasattr(batch, "shape"):
            batch = {inputs[0]: batch}
        else:
            raise QdqConfigError(
                f"calibration batch {number} is a {type(batch).__name__}; each batch is a dict of graph input name "
                f"-> array, the graph's inputs being {inputs}."
            )
    missing = [name for name in inputs if name not in batch]
    if missing:
        raise QdqConfigError(
            f"calibration batch {number} has no array for the graph input(s) {missing}; it gave {sorted(batch)}. "
            f"Name each array after its graph input ({inputs})."
        )
    feed = {name: np.asarray(batch[name]) for name in inputs}
    for value in declared:
        _check_shape(value, feed[value.name].shape, number)
    return feed


def _check_shape(value: Any, shape: tuple[int, ...], number: int) -> None:
    """Raise where ``shape`` (an array of calibration batch ``number``) breaks what the graph input ``value``
    declares: its rank, a dimension it fixes."""
    dims = value_dims(value)
    if dims is None:
        return
    where = f"calibration batch {number}: input {value.name!r} has shape {tuple(shape)}, but the graph declares {dims}"
    if len(dims) != len(shape):
        raise QdqConfigError(f"{where}: {len(dims)} dimensions. Give arrays of the graph's rank.")
    wrong = [axis for axis, (d, n) in enumerate(zip(dims, shape)) if d is not None and d != n]
    if wrong and wrong[0] == 0:
        raise QdqConfigError(f"{where}: the model takes batches of exactly {dims[0]} sample(s). Give batches of "
                             f"{dims[0]} (the CLI's --data cuts them to that size).")  # fmt: skip
    if wrong:
        raise QdqConfigError(f"{where}: dimension {wrong[0]} is fixed at {dims[wrong[0]]}. Resize the inputs to it.")

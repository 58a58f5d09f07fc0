"""The search's phases, on one :class:`~qdq.tuning.evaluation.Evaluator`: the sensitivity pass (:func:`sensitivity`),
greedy steps (:func:`greedy`), the ranking's leading units together (:func:`leading`), pruning (:func:`prune`); then
the precision variants of the configuration that met (:func:`precision_variants`)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch

from qdq.graphs.onnx import atomic_save
from qdq.tensor_quant import fake_tensor_quant
from qdq.tuning.budget import output_sqnr
from qdq.tuning.evaluation import Evaluator
from qdq.tuning.result import Trial
from qdq.workflow.progress import counter
from qdq.workflow.verification import sqnr_db

__all__ = ["greedy", "leading", "precision_variants", "prune", "ranking", "search", "sensitivity"]

Unit = tuple[str, ...]


def search(ev: Evaluator, max_candidates: int | None, max_steps: int) -> None:
    """The fewest units that meet the budget: nothing when plain INT8 meets it; else the sensitivity pass, greedy
    steps, the leading units of the ranking together where no single step met it, and pruning of what met."""
    base = ev.trials[0]
    if base.meets(ev.budget):
        return
    order = sensitivity(ev, base, max_candidates)
    met = greedy(ev, order, max_steps)
    if met is None:
        met = leading(ev, ranking(ev, order))
    if met is not None:
        prune(ev, met, max_steps)


def sensitivity(ev: Evaluator, base: Trial, max_candidates: int | None) -> list[Unit]:
    """For each unit (or the ``max_candidates`` noisiest), the file with that unit alone left float, scored by the
    budget's proxy (default: output SQNR against FP32) on the first tuning batch (``ev.gains``: the gain over plain
    INT8); the units that gained, largest gain first."""
    candidates = ev.units if max_candidates is None else noisiest(ev, max_candidates)
    screen = [ev.tuning[0]]
    proxy = ev.budget.proxy or output_sqnr
    rows = len(next(iter(ev.feed(screen[0]).values())))
    reference = [r[:rows] for r in ev.reference[id(ev.tuning)]]
    base_sqnr = proxy(reference, ev.outputs(base.path, screen)) if base.path else -math.inf
    bar = counter(ev.progress, "tune: sensitivity", len(candidates))
    for unit in candidates:
        path = ev.quantize((unit,))[0]
        ev.evaluations += 1
        ev.gains[unit] = proxy(reference, ev.outputs(path, screen)) - base_sqnr
        path.unlink()
        bar.update()
    bar.close()
    return sorted((u for u in candidates if ev.gains[u] > 0), key=lambda u: -ev.gains[u])


def greedy(ev: Evaluator, order: list[Unit], max_steps: int) -> Trial | None:
    """The units of ``order`` one by one (at most ``max_steps``), a step kept only when the budget's own score
    improves, until the budget holds; the trial that met, or None."""
    floated: tuple[Unit, ...] = ()
    best = ev.trials[0].score
    for step, unit in enumerate(order[:max_steps]):
        trial = ev.add(f"greedy {step + 1}", (*floated, unit))
        if trial.meets(ev.budget):
            return trial
        if trial.score > best:  # a step is kept only when the budget's own score improves
            floated, best = trial.floated, trial.score
        else:
            trial.name += " (undone)"
    return None


def ranking(ev: Evaluator, gaining: list[Unit]) -> list[Unit]:
    """Every unit, best first: those that gained alone (largest gain first), then the other measured units (least
    loss first), then the units the sensitivity pass did not measure. Its end is every unit float: the FP32
    computation, which a budget FP32 meets is met by."""
    first = set(gaining)
    rest = sorted((u for u in ev.gains if u not in first), key=lambda u: -ev.gains[u])
    return gaining + rest + [u for u in ev.units if u not in ev.gains]


def leading(ev: Evaluator, order: list[Unit]) -> Trial | None:
    """The fewest leading units of ``order`` that meet the budget together: ``k`` doubling from 2 until the budget
    holds, then a bisection between the last ``k`` that missed and the first that met; None when even every unit of
    ``order`` misses."""
    missed, k, met = 1, 2, None  # greedy tried the first unit alone
    while met is None and missed < len(order):
        k = min(k, len(order))
        trial = ev.add(f"top {k}", tuple(order[:k]))
        if trial.meets(ev.budget):
            met = trial
        else:
            missed, k = k, 2 * k
    while met is not None and len(met.floated) - missed > 1:
        middle = (missed + len(met.floated)) // 2
        trial = ev.add(f"top {middle}", tuple(order[:middle]))
        if trial.meets(ev.budget):
            met = trial
        else:
            missed = middle
    return met


def prune(ev: Evaluator, met: Trial, max_tries: int) -> None:
    """Drop from the met configuration the units the budget does not need, at most ``max_tries`` tries: the least
    useful half (smallest gain) first, then quarters, and so on down to single units (each try keeps its removal
    when the budget still holds), so a large set shrinks in a few evaluations."""
    floated = sorted(met.floated, key=lambda u: ev.gains.get(u, 0.0))
    size, tries = max(len(floated) // 2, 1), 0
    while tries < max_tries:
        start = 0
        while start < len(floated) and tries < max_tries:
            chunk = set(floated[start : start + size])
            keep = set(floated) - chunk
            if not keep:  # nothing float is plain INT8, which misses
                start += size
                continue
            trial = ev.add(f"prune {len(ev.trials)}", tuple(u for u in met.floated if u in keep))
            tries += 1
            if trial.meets(ev.budget):
                floated = [u for u in floated if u in keep]
            else:
                start += size
        if size == 1:
            break
        size = max(size // 2, 1)


def precision_variants(ev: Evaluator) -> None:
    """The configuration that met the budget with the fewest float units, its float MatMuls on constant weights run
    at a precision between int8 and float: block-quantized weights of each width the runtime declares
    (:attr:`qdq.runtime.Backend.block_weight_bits`; ONNX Runtime: ``MatMulNBits``, 8 and 4 bits, int8 activations
    per block at run time), as its backend writes them (one evaluation each; none without such a MatMul)."""
    backend = ev.engine.backend
    passing = [t for t in ev.trials if t.meets(ev.budget) and t.path is not None]
    if not passing or not backend.block_weight_bits:
        return
    base = min(reversed(passing), key=lambda t: len(t.floated))  # the last of the fewest: the pruned one
    model = onnx.load(str(base.path))
    names = backend.block_weight_matmuls(model)
    if not names:
        return
    for width in backend.block_weight_bits:
        out = ev.work / f"config_{ev.files}.onnx"
        ev.files += 1
        atomic_save(backend.with_block_weights(model, names, width), out)
        trial = ev.add(f"{base.name}, {len(names)} MatMul(s) {width}-bit", base.floated, out)
        trial.matmul_bits = width


def noisiest(ev: Evaluator, count: int) -> list[Unit]:
    """The ``count`` units whose tensors lose the most to their quantization on one batch (lowest SQNR)."""
    tensors = sorted({name for unit in ev.units for name in unit})
    values = ev.prepared.values(tensors, ev.feed(ev.calibration_batch), threads=ev.engine.threads)
    ranges = ev.value_ranges or {}
    noise = {unit: _unit_sqnr([values[n] for n in unit], ranges.get(unit[0])) for unit in ev.units}
    return sorted(ev.units, key=lambda u: noise[u])[:count]


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

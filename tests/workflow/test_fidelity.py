"""Output fidelity (qdq.workflow.fidelity): the meter against a numpy oracle of its formula; meters merged, and
summed over ranks as torch.distributed would."""

import math

import numpy as np
import pytest

from qdq.workflow.fidelity import FidelityMeter


def _oracle_fidelity(references: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> float:
    """The module docstring's formula, written out: per output, per feature (axis 1 of rank >= 3, else the whole
    tensor), 10 log10(variance / mse) over the batches, capped at 60; mean over features, then outputs."""
    per_output = []
    for index in range(len(references[0])):
        if not np.issubdtype(references[0][index].dtype, np.floating):
            continue
        ref = np.concatenate([r[index] for r in references]).astype(np.float64)
        out = np.concatenate([o[index] for o in outputs]).astype(np.float64)
        pairs = [(ref[:, f], out[:, f]) for f in range(ref.shape[1])] if ref.ndim >= 3 else [(ref, out)]
        values = [min(60.0, 10 * math.log10(r.var() / np.mean((q - r) ** 2))) for r, q in pairs if r.var() > 0]
        if values:
            per_output.append(np.mean(values))
    return float(np.mean(per_output))


def test_fidelity_is_the_per_feature_variance_to_error_ratio():
    """Two batches of a detector-like output (a pixel row, two 0-1 score rows, a constant row), a rank-2 output
    and an int64 output (ignored): the meter equals the oracle; the constant row does not count."""
    rng = np.random.default_rng(0)
    batches, references, outputs = [], [], []
    for _ in range(2):
        boxes = rng.uniform(0, 320, (4, 1, 50))
        scores = rng.uniform(0, 1, (4, 2, 50))
        ref = np.concatenate([boxes, scores, np.full((4, 1, 50), 7.0)], axis=1).astype(np.float32)
        out = ref + rng.normal(0, [[[1.0]], [[0.01]], [[0.05]], [[0.0]]], ref.shape).astype(np.float32)
        flat = rng.normal(0, 1, (4, 10)).astype(np.float32)
        ids = rng.integers(0, 9, (4, 3))
        references.append([ref, flat, ids])
        outputs.append([out, flat + 0.1, ids + 1])
        batches.append(None)
    meter = FidelityMeter()
    for ref, out in zip(references, outputs):
        meter.add(ref, out)
    assert meter.score() == pytest.approx(_oracle_fidelity(references, outputs), abs=1e-9)
    assert meter.sums().keys() == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)}  # the int64 output is not measured


def test_a_perfect_output_scores_the_ceiling_and_nothing_comparable_is_nan():
    meter = FidelityMeter()
    meter.add([np.arange(6.0).reshape(2, 3)], [np.arange(6.0).reshape(2, 3)])
    assert meter.score() == 60.0
    empty = FidelityMeter()
    empty.add([np.ones((2, 3))], [np.ones((2, 3))])  # no variance: nothing to measure against
    assert math.isnan(empty.score())


def _batches(seed: int, count: int = 3) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(count):
        ref = rng.normal(size=(4, 3, 5))
        found.append(([ref, ref[:, 0]], [ref + rng.normal(0, 0.1, ref.shape), ref[:, 0] + 0.05]))
    return found


def test_merged_meters_score_as_one_meter_over_every_batch():
    first, second, together = FidelityMeter(), FidelityMeter(), FidelityMeter()
    for index, (ref, out) in enumerate(_batches(0, 4)):
        (first if index % 2 else second).add(ref, out)
        together.add(ref, out)
    assert (first + second).score() == pytest.approx(together.score(), abs=1e-12)
    assert (first + second).sums().keys() == together.sums().keys()


def test_summed_over_ranks_a_meter_holds_every_ranks_batches():
    """Two ranks' meters reduced with a sum of their flattened sums (what all_reduce_sum does) score as one meter
    over both ranks' batches; reduced alone (one rank: the identity) a meter is unchanged."""
    ranks = [FidelityMeter(), FidelityMeter()]
    together = FidelityMeter()
    for rank, seed in enumerate((1, 2)):
        for ref, out in _batches(seed):
            ranks[rank].add(ref, out)
            together.add(ref, out)
    flats = [[v for key in sorted(m.sums()) for v in m.sums()[key]] for m in ranks]
    summed = ranks[0].reduced(lambda mine: [a + b for a, b in zip(mine, flats[1], strict=True)])
    assert summed.score() == pytest.approx(together.score(), abs=1e-12)
    assert ranks[1].reduced(list).score() == ranks[1].score()

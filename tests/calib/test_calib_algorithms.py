"""entropy / mse / percentile against slow, literal numpy references on random histograms.

The references transcribe the algorithm descriptions directly (one candidate at a time, scipy's KL),
independently of the prefix-sum / matrix formulations in ``qdq.calib.algorithms``. Bin widths are
powers of two so ``amax / width`` recovers the chosen candidate bin exactly.

Agreement criterion: the candidate we pick is optimal for the *reference's* objective (within 1e-9
absolute for KL, 1e-9 relative for mse), and the tie rule holds against the reference (no later
candidate within 1e-11 of the KL minimum; no earlier candidate within 1e-13 relative of the mse
minimum). Those tolerances sit above the float64 rounding of either formulation (KL terms are
~log(total) ~ 20, summed over <= 2048 bins: ~1e-12; mse sums <= 2048 positive terms: ~1e-13 relative)
and far below any real difference between candidates.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import entropy as scipy_kl

from qdq.calib import entropy_amax, mse_amax, percentile_amax
from qdq.errors import QdqConfigError, QdqTypeError

# -- references -------------------------------------------------------------------------------------


def ref_entropy_kl(counts, num_bits, unsigned, start_bin, stride):
    """(candidates, KL) exactly as described: P with folded tail, Q spread over non-empty bins."""
    used = int(np.nonzero(counts)[0].max()) + 1
    bins = counts[:used].astype(np.float64)
    bins[0] = counts[1]
    levels = 2 ** (num_bits - 1 + int(unsigned))
    candidates = np.arange(min(start_bin, used), used + 1, stride)
    kls = []
    for i in candidates:
        p = bins[:i].copy()
        p[i - 1] += bins[i:].sum()
        group = np.digitize(np.arange(i), np.linspace(0, i, levels + 1)) - 1
        mass = np.bincount(group, weights=bins[:i], minlength=levels)
        filled = np.bincount(group, weights=(bins[:i] > 0).astype(float), minlength=levels)
        q = np.where(bins[:i] > 0, mass[group] / np.maximum(filled[group], 1), 0.0)
        # a Q without mass cannot represent P (scipy would return nan)
        kls.append(scipy_kl(p, q) if q.sum() > 0 else np.inf)
    return candidates, np.array(kls)


def ref_mse_errors(counts, width, num_bits, unsigned, start_bin, stride):
    """(candidates, error): bin centres fake-quantized in float32, squared errors weighted by counts."""
    used = int(np.nonzero(counts)[0].max()) + 1
    centres = ((np.arange(used) + 0.5) * width).astype(np.float32)
    max_bound = 2 ** (num_bits - 1 + int(unsigned)) - 1
    qmin = 0 if unsigned else -max_bound - 1
    candidates = np.arange(min(start_bin, used - 1), used, stride)
    errors = []
    for i in candidates:
        step = np.float32(centres[i] / np.float32(max_bound))
        q = np.clip(np.rint(centres / step), qmin, max_bound)
        out = (q * step).astype(np.float32)
        errors.append(np.sum(counts[:used] * (out.astype(np.float64) - centres.astype(np.float64)) ** 2))
    return candidates, np.array(errors)


def ref_percentile_bin(counts, percentile):
    """Bin of the r-th smallest value, r = ceil(total * p / 100) (bin 0 for r = 0)."""
    values = np.repeat(np.arange(len(counts)), counts)
    rank = math.ceil(len(values) * (percentile / 100))
    return 0 if rank == 0 else int(values[rank - 1])


def random_histogram(rng, n, kind):
    """Histogram shapes met in calibration: decaying (post-ReLU / |gaussian|), with gaps and outliers."""
    x = np.arange(n)
    if kind == "laplace":
        density = np.exp(-x / rng.uniform(0.02, 0.3) / n)
    elif kind == "gauss":
        density = np.exp(-0.5 * (x / (rng.uniform(0.1, 0.4) * n)) ** 2)
    else:
        density = rng.uniform(0, 1, n)
    counts = rng.poisson(density * rng.uniform(5, 500)).astype(np.int64)
    counts[rng.uniform(size=n) < 0.1] = 0  # gaps
    counts[rng.integers(n // 2, n)] += rng.integers(1, 4)  # a far outlier
    counts[0] += rng.integers(0, 1000)  # zero spike
    counts[1] = max(counts[1], 1)
    return counts


CASES = [
    # (seed, n, kind, num_bits, unsigned, start_bin, stride)
    (0, 2048, "laplace", 8, False, 128, 1),
    (1, 2048, "gauss", 8, True, 128, 1),
    (2, 2048, "uniform", 8, False, 128, 1),
    (3, 1024, "laplace", 8, False, 128, 3),
    (4, 512, "gauss", 6, True, 32, 1),
    (5, 256, "laplace", 4, False, 8, 2),
    (6, 64, "uniform", 8, False, 16, 1),  # levels > bins: every bin its own group
    (7, 300, "gauss", 5, False, 400, 1),  # start_bin beyond the data
]


def _chosen_bin(amax, width, offset=0.0):
    value = float(amax) / width - offset
    assert value == int(value), value
    return int(value)


# -- entropy ----------------------------------------------------------------------------------------


def check_entropy(counts, num_bits, unsigned, start_bin, stride):
    width = 2.0**-6
    amax = entropy_amax(
        torch.from_numpy(counts), width, num_bits=num_bits, unsigned=unsigned, start_bin=start_bin, stride=stride
    )
    chosen = _chosen_bin(amax, width)
    candidates, kl = ref_entropy_kl(counts, num_bits, unsigned, start_bin, stride)
    assert chosen in candidates
    best = kl.min()
    assert kl[candidates == chosen][0] <= best + 1e-9
    assert np.all(kl[candidates > chosen] > best + 1e-11), "a later candidate ties the minimum"


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-n{c[1]}-{c[2]}" for c in CASES])
def test_entropy_matches_reference(case):
    seed, n, kind, num_bits, unsigned, start_bin, stride = case
    counts = random_histogram(np.random.default_rng(seed), n, kind)
    check_entropy(counts, num_bits, unsigned, start_bin, stride)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 50), min_size=2, max_size=80).filter(lambda c: sum(c[1:]) > 0),
    num_bits=st.sampled_from([2, 3, 4]),
    unsigned=st.booleans(),
    start_bin=st.integers(1, 20),
    stride=st.integers(1, 3),
)
def test_entropy_matches_reference_small_histograms(counts, num_bits, unsigned, start_bin, stride):
    check_entropy(np.array(counts, dtype=np.int64), num_bits, unsigned, start_bin, stride)


def test_entropy_exact_tie_picks_last_candidate():
    # two equal bins, 30 and 31, in the last of 4 groups (num_bits=3 signed). i = 32: Q = P (equal counts
    # in a group); i = 31: bin 31 folds into bin 30, alone in its group, so Q = P again. KL = 0 for both
    # (every i <= 30 is infinite: its last bin is empty but has a tail) and the last one, 32, wins.
    counts = np.zeros(64, dtype=np.int64)
    counts[30] = counts[31] = 5
    _, kl = ref_entropy_kl(counts, 3, False, 1, 1)
    assert kl[30] == 0 and kl[31] == 0 and np.isinf(kl[:30]).all()  # candidates 1..32
    assert float(entropy_amax(torch.from_numpy(counts), 0.5, num_bits=3, start_bin=1)) == 16.0


def test_entropy_ignores_the_zero_spike_like_the_seed():
    # bin 0 is replaced by bin 1 (= 0 here): a huge zero spike must not change the answer
    counts = np.zeros(256, dtype=np.int64)
    counts[100:200] = 5
    with_spike = counts.copy()
    with_spike[0] = 10**9
    a = entropy_amax(torch.from_numpy(counts), 1.0, start_bin=16)
    b = entropy_amax(torch.from_numpy(with_spike), 1.0, start_bin=16)
    assert float(a) == float(b)


# -- mse --------------------------------------------------------------------------------------------


def check_mse(counts, num_bits, unsigned, start_bin, stride):
    width = 2.0**-5
    amax = mse_amax(
        torch.from_numpy(counts), width, num_bits=num_bits, unsigned=unsigned, start_bin=start_bin, stride=stride
    )
    chosen = _chosen_bin(amax, width, offset=0.5)
    candidates, err = ref_mse_errors(counts, width, num_bits, unsigned, start_bin, stride)
    assert chosen in candidates
    best = err.min()
    assert err[candidates == chosen][0] <= best * (1 + 1e-9)
    assert np.all(err[candidates < chosen] > best * (1 + 1e-13)), "an earlier candidate ties the minimum"


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-n{c[1]}-{c[2]}" for c in CASES])
def test_mse_matches_reference(case):
    seed, n, kind, num_bits, unsigned, start_bin, stride = case
    counts = random_histogram(np.random.default_rng(100 + seed), n, kind)
    check_mse(counts, num_bits, unsigned, start_bin, stride)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 50), min_size=2, max_size=80).filter(lambda c: sum(c) > 0),
    num_bits=st.sampled_from([2, 3, 4, 8]),
    unsigned=st.booleans(),
    start_bin=st.integers(1, 20),
    stride=st.integers(1, 3),
)
def test_mse_matches_reference_small_histograms(counts, num_bits, unsigned, start_bin, stride):
    check_mse(np.array(counts, dtype=np.int64), num_bits, unsigned, start_bin, stride)


def test_mse_exact_tie_picks_first_candidate():
    # values 2.5 and 3.5 (bins 2, 3), num_bits=2 signed (max_bound 1): amax 2.5 puts 3.5 on 2.5 (error 1),
    # amax 3.5 puts 2.5 on 3.5 (error 1), amax 1.5 clips both (error 1 + 4): the first of the tie wins
    counts = np.array([0, 0, 1, 1, 0, 0], dtype=np.int64)
    _, err = ref_mse_errors(counts, 1.0, 2, False, 1, 1)
    assert err.tolist() == [5.0, 1.0, 1.0]
    assert float(mse_amax(torch.from_numpy(counts), 1.0, num_bits=2, start_bin=1)) == 2.5


# -- percentile -------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=2, max_size=64).filter(lambda c: sum(c) > 0),
    percentile=st.one_of(st.sampled_from([0.0, 50.0, 90.0, 99.0, 99.99, 100.0]), st.floats(0, 100)),
)
def test_percentile_matches_reference(counts, percentile):
    counts = np.array(counts, dtype=np.int64)
    amax = percentile_amax(torch.from_numpy(counts), 0.25, percentile)
    assert float(amax) == ref_percentile_bin(counts, percentile) * 0.25


def test_percentile_batched_channels_equal_single():
    rng = np.random.default_rng(3)
    counts = np.stack([random_histogram(rng, 128, "laplace") for _ in range(5)])
    widths = torch.tensor([2.0**-k for k in range(5)], dtype=torch.float64)
    batched = percentile_amax(torch.from_numpy(counts), widths, 99.0)
    assert batched.shape == (5,)
    for c in range(5):
        assert float(batched[c]) == ref_percentile_bin(counts[c], 99.0) * float(widths[c])


# -- shared behaviour and errors ---------------------------------------------------------------------


@pytest.mark.parametrize("fn", [entropy_amax, mse_amax, percentile_amax])
def test_all_zero_histogram_gives_zero(fn):
    assert float(fn(torch.zeros(16, dtype=torch.int64), 1.0)) == 0.0


@pytest.mark.parametrize("fn", [entropy_amax, mse_amax])
def test_per_channel_rows_equal_single_rows(fn):
    rng = np.random.default_rng(9)
    counts = torch.from_numpy(np.stack([random_histogram(rng, 256, "gauss") for _ in range(3)]))
    widths = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    batched = fn(counts, widths, start_bin=16)
    singles = [float(fn(counts[c], float(widths[c]), start_bin=16)) for c in range(3)]
    assert batched.tolist() == singles


@pytest.mark.parametrize("percentile", [-10, 200, float("nan"), "99"])
def test_percentile_out_of_range_raises(percentile):
    with pytest.raises(QdqConfigError, match="range"):
        percentile_amax(torch.ones(8, dtype=torch.int64), 1.0, percentile)


@pytest.mark.parametrize("fn", [entropy_amax, mse_amax])
@pytest.mark.parametrize("option", [{"start_bin": 0}, {"stride": 0}, {"start_bin": 2.5}])
def test_bad_candidate_options_raise(fn, option):
    with pytest.raises(QdqConfigError, match=">= 1"):
        fn(torch.ones(8, dtype=torch.int64), 1.0, **option)


@pytest.mark.parametrize("counts", [torch.ones(8), [1, 2, 3]])
def test_non_integer_counts_raise(counts):
    with pytest.raises(QdqTypeError, match="integer"):
        percentile_amax(counts, 1.0)


@pytest.mark.parametrize("shape", [(1,), (2, 3, 4)])
def test_bad_count_shapes_raise(shape):
    with pytest.raises(QdqConfigError, match="shape"):
        entropy_amax(torch.ones(shape, dtype=torch.int64), 1.0)


@pytest.mark.parametrize("fn", [entropy_amax, mse_amax])
def test_channels_at_once_equal_one_channel_at_a_time(fn):
    # channels of different lengths (one shorter than start_bin, one empty, one all in bin 0) in one call
    rng = np.random.default_rng(5)
    rows = [random_histogram(rng, 512, kind) for kind in ("laplace", "gauss", "gaps", "laplace")]
    rows += [np.zeros(512, np.int64), np.eye(1, 512, 0, dtype=np.int64)[0] * 7, np.eye(1, 512, 40, dtype=np.int64)[0]]
    counts = torch.from_numpy(np.stack(rows))
    widths = torch.tensor([2.0**-e for e in range(len(rows))], dtype=torch.float64)
    together = fn(counts, widths, start_bin=64)
    alone = torch.stack([fn(counts[c], float(widths[c]), start_bin=64) for c in range(len(rows))])
    assert torch.equal(together, alone)
    assert together[4] == 0.0  # empty histogram


@pytest.mark.parametrize("fn", [entropy_amax, mse_amax])
def test_bad_num_bits_raise(fn):
    with pytest.raises(QdqConfigError, match="num_bits"):
        fn(torch.ones(8, dtype=torch.int64), 1.0, num_bits=1)


@pytest.mark.parametrize("search", [entropy_amax, mse_amax])
def test_the_chunking_of_the_search_does_not_change_the_amax(search, monkeypatch):
    from qdq.calib import algorithms

    generator = torch.Generator().manual_seed(3)
    samples = torch.randn(4, 50_000, generator=generator).abs() * torch.tensor([[1.0], [3.0], [0.2], [7.0]])
    samples[1, :40] *= 30  # outliers in one channel
    counts = torch.stack([torch.histc(row, 4096, 0, float(samples.max())) for row in samples]).to(torch.int64)
    width = float(samples.max()) / 4096
    whole = search(counts, width, stride=4)
    monkeypatch.setattr(algorithms, "_CPU_CHUNK_ELEMS", 5_000)  # one candidate row per chunk
    assert torch.equal(search(counts, width, stride=4), whole)

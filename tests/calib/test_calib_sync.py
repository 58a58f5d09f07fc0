"""sync(): a 2-process gloo group holds, on every rank, what one process computes over all the data."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qdq.calib import HistogramCalibrator, MaxCalibrator
from qdq.errors import QdqCalibrationError

WORLD = 2
SCALES = [0.5, 30.0, 0.0, 2.0, 1e3, 1e-4]  # rank 0 gets 0.5, 0.0, 1e3; rank 1 gets 30, 2, 1e-4


def make_calibrators():
    return {
        "hist": HistogramCalibrator(),
        "hist_axis1": HistogramCalibrator(axis=1, num_bins=256, unsigned=True),
        "hist_rank1_empty": HistogramCalibrator(axis=1, num_bins=256),
        "max": MaxCalibrator(track_amax=True),
        "max_axis1": MaxCalibrator(axis=1),
    }


def make_batches():
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(4, 3, 5, generator=gen) * s for s in SCALES]


def results(cals):
    out = {}
    for name, cal in cals.items():
        methods = cal.methods
        out[name] = {m: cal.compute_amax(m, **({"start_bin": 32} if m in ("entropy", "mse") else {})) for m in methods}
        if isinstance(cal, HistogramCalibrator):
            out[name]["counts"] = cal.bin_counts
        else:
            out[name]["amaxs"] = cal.amaxs
    return out


def expected_errors(rank):
    """Collectives that must fail on every rank (each rank raises after the same gather)."""
    errors = []
    config = HistogramCalibrator(num_bins=128 if rank == 0 else 256)
    config.collect(torch.rand(3))
    shapes = MaxCalibrator(axis=0)
    shapes.collect(torch.rand(2 + rank, 4))
    for cal in (config, shapes):
        try:
            cal.sync()
        except QdqCalibrationError as err:
            errors.append(str(err))
    return errors


def extra_batch():
    return torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(99)) * 1e4


def worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        cals = make_calibrators()
        for batch in make_batches()[rank::WORLD]:
            for name, cal in cals.items():
                if not (name == "hist_rank1_empty" and rank == 1):
                    cal.collect(batch)
        for cal in cals.values():
            cal.sync()
        out = {"results": results(cals)}
        for cal in cals.values():  # syncing again must not count anything twice
            cal.sync()
        out["again"] = results(cals)
        if rank == 0:  # more data on one rank after a sync, then a new sync
            for name in ("hist", "max"):
                cals[name].collect(extra_batch())
        # until the next sync, rank 0 is back to its own data; rank 1 still holds the synced state
        out["total_before_resync"] = int(cals["hist"].bin_counts.sum())
        for name in ("hist", "max"):
            cals[name].sync()
        out["extended"] = results({name: cals[name] for name in ("hist", "max")})
        out["errors"] = expected_errors(rank)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_group(tmp_path):
    ctx = mp.start_processes(
        worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("the 2-process gloo group did not finish within 120 s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert torch.equal(a, b), where


def test_sync_over_two_gloo_processes_equals_one_process(tmp_path):
    ranks = run_group(tmp_path)

    single = make_calibrators()
    batches = make_batches()
    for batch in batches[0::2] + batches[1::2]:  # rank order, as the gathered track_amax list
        for name, cal in single.items():
            if name != "hist_rank1_empty":
                cal.collect(batch)
    for batch in batches[0::2]:
        single["hist_rank1_empty"].collect(batch)
    expected = results(single)

    extended = {name: make_calibrators()[name] for name in ("hist", "max")}
    for batch in [*batches[0::2], extra_batch(), *batches[1::2]]:
        for cal in extended.values():
            cal.collect(batch)

    for rank, got in enumerate(ranks):
        assert_same(got["results"], expected, f"rank{rank}")
        assert_same(got["again"], expected, f"rank{rank} after a second sync")
        assert_same(got["extended"], results(extended), f"rank{rank} after more data and a new sync")
        assert got["total_before_resync"] == (4 * 60 if rank == 0 else 6 * 60)  # batches of 60 values
        assert len(got["errors"]) == 2, got["errors"]
        assert "different calibrator configurations" in got["errors"][0]
        assert "different channel shapes" in got["errors"][1]


def test_sync_without_process_group_is_a_no_op():
    assert not dist.is_initialized()
    cal = HistogramCalibrator()
    cal.sync()
    assert not cal.has_data
    cal.collect(torch.rand(100))
    before = cal.bin_counts
    cal.sync()
    assert torch.equal(cal.bin_counts, before)

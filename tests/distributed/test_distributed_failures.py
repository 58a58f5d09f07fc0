"""A rank that crashes or hangs makes the other exit non-zero with a clear error, well within 60 s."""

from __future__ import annotations

from typing import Any

TIMEOUT_S = 5


def test_crashing_rank_stops_the_others_with_its_error(launch: Any, tmp_path):
    run = launch("crash", tmp_path, timeout_s=TIMEOUT_S, wall_limit_s=60)
    assert run.returncode != 0
    assert run.seconds < 60
    assert "RuntimeError: simulated crash on rank 1" in run.output  # the root cause, from the failing rank
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished


def test_hanging_rank_times_out_with_a_clear_error(launch: Any, tmp_path):
    run = launch("hang", tmp_path, timeout_s=TIMEOUT_S, wall_limit_s=60)
    assert run.returncode != 0
    assert run.seconds < 60
    assert "QdqDistributedError: rank 0 of 2: comparing the quantizers to calibrate across ranks failed" in run.output
    assert f"collectives give up after {TIMEOUT_S} s" in run.output
    assert not list(tmp_path.glob("rank*.pt"))

"""A 2-rank DDP QAT run (torchrun, gloo): identical state on both ranks, checkpoints from rank 0 only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def ranks(qat_run: Any) -> list[dict[str, Any]]:
    return qat_run.results()


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_quantizer_state_and_weights_identical_on_both_ranks(ranks):
    first, second = ranks
    for key in ("quantizers", "parameters"):
        assert first[key].keys() == second[key].keys()
        differ = [k for k in first[key] if not _equal(first[key][k], second[key][k])]
        assert differ == [], key
    assert any(k.endswith(".clip_max") for k in first["quantizers"])  # learned ranges were compared too


def test_learned_ranges_train_only_when_asked(ranks):
    for result in ranks:
        calibrated, frozen = result["calibrated_clip"], result["frozen_clip"]
        # learn_ranges=False under DDP: ranges unchanged (and DDP did not fail on their unused gradients)
        assert all(torch.equal(calibrated[k], frozen[k]) for k in calibrated)
        learned = {k: v for k, v in result["quantizers"].items() if k in calibrated}
        assert any(not torch.equal(calibrated[k], learned[k]) for k in calibrated)


def test_only_rank_zero_writes_checkpoints_and_resume_is_consistent(ranks, qat_run):
    first, second = ranks
    checkpoint = qat_run.out_dir / "checkpoints" / "qat_checkpoint.pt"
    assert [Path(p) for p in first["saves"]] == [checkpoint, checkpoint]  # epoch 1, then resumed epoch 2
    assert first["saves_after_first"] == 1
    assert second["saves"] == []
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["qat_checkpoint.pt"]  # no temporary left
    assert first["resumed_from"] == second["resumed_from"] == 1
    assert first["history"] == second["history"]  # loss averaged over ranks, the same score
    state = torch.load(checkpoint, weights_only=False)
    assert state["epoch"] == 2 and len(state["rng_per_rank"]) == 2
    assert all(not k.startswith("module.") for k in state["model"])  # the unwrapped model's keys
    for name, value in first["parameters"].items():
        assert torch.equal(state["model"][name], value), name


def test_assert_in_sync_detects_and_broadcast_repairs(ranks):
    for result in ranks:  # rank 1 doubled one amax: both ranks raise, naming it; the broadcast restores it
        assert "differs between rank 0 and rank(s) [1]" in result["desync_error"]
        assert "features.3._input_quantizer.amax" in result["desync_error"]
        assert result["repaired"]

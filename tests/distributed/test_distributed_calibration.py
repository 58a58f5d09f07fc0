"""2-rank calibration (torchrun, gloo) == 1-rank calibration over the same batches, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

METHODS = ("max", "entropy", "mse", "percentile")


@pytest.fixture(scope="module")
def runs(calibrate_run: Any, worker: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return calibrate_run.results(), worker.reference_calibration()


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_ranks_calibrated_different_batches(runs):
    ranks, _ = runs
    # 9 batches dealt in turn: 5 and 4, so the ranks' histograms have different ranges (max 60 vs 8)
    assert [r["num_batches"] for r in ranks] == [5, 4]
    # the branch ran on rank 0's largest batch only: its quantizer had data on one rank, none on the other
    assert [r["max_branch_calls"] for r in ranks] == [1, 0]


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_equal_one_process_bit_for_bit(runs, method):
    ranks, reference = runs
    assert "branch._input_quantizer.amax" in reference[method]
    for result in ranks:
        assert_bit_identical(result[method], reference[method])


def test_auto_gives_every_rank_the_same_ranges(runs):
    """auto scores each rank's first batches in the model's order, each layer on its quantized input, and sums
    the errors over the ranks: every rank chooses the same ranges, but not those of one process over all the
    batches (that process scores other batches: the first of the whole stream)."""
    ranks, reference = runs
    assert ranks[0]["auto"].keys() == reference["auto"].keys()
    assert_bit_identical(ranks[1]["auto"], ranks[0]["auto"])
    assert_bit_identical(ranks[1]["auto_biases"], ranks[0]["auto_biases"])  # bias correction's sums are pooled too


def test_ptq_picks_the_same_method_with_the_same_statistics(runs):
    ranks, reference = runs
    for result in ranks:
        # load_amax runs once per method: the statistics are all-reduced once, not once per call
        assert result["ptq"]["counts"] == reference["ptq"]["counts"]
        assert result["ptq"]["scores"] == reference["ptq"]["scores"]
        assert result["ptq"]["best"] == reference["ptq"]["best"]
        assert_bit_identical(result["ptq"]["amax"], reference["ptq"]["amax"])


def test_ddp_wrapped_model_calibrates_through_module(runs):
    ranks, reference = runs
    for result in ranks:
        assert_bit_identical(result["ddp_entropy"], reference["entropy"])


def test_quantizer_unused_everywhere_raises_on_every_rank(runs):
    ranks, _ = runs
    for result in ranks:
        assert result["unused_error"] is not None
        assert "unused._input_quantizer" in result["unused_error"] and "saw no data" in result["unused_error"]


def test_ranks_with_different_quantizers_raise_instead_of_mixing_statistics(runs):
    ranks, _ = runs
    for result in ranks:
        assert "the ranks disagree on the quantizers to calibrate" in result["mismatch_error"]
        assert "head.1._input_quantizer" in result["mismatch_error"]

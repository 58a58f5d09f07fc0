"""method="auto", the default: the method whose quantized outputs stay closest to the float model's on held-out
batches. The fidelity against a numpy oracle, the choice rules, and small models where the right choice is known by
construction (the outliers max must keep, outliers a saturating layer ignores, a tail entropy clips)."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from detector_sample import tail_signal_data
from qdq.errors import QdqCalibrationWarning
from qdq.quantizer import disabled_quantizers
from qdq.workflow.auto_calibration import (
    DESTRUCTIVE_MARGIN_DB,
    HOLDOUT_EVERY,
    MAX_HOLDOUT,
    TIE_DB,
    candidates,
    choose,
    held_out,
    select_amax,
)
from qdq.workflow.calibration import calibrate, named_quantizers
from qdq.workflow.collection import collect_split
from qdq.workflow.post_training import ptq


def test_choose_takes_the_best_the_earliest_of_ties_and_a_destructive_range_only_by_a_margin():
    assert choose({"max": 10.0, "mse": 12.0, "percentile": 11.0}, {}) == "mse"
    assert choose({"max": 12.0 - TIE_DB / 2, "mse": 12.0}, {}) == "max"  # a tie: the earlier, wider one
    clips = {"entropy": ["conv"]}
    assert choose({"max": 10.0, "entropy": 12.0 + DESTRUCTIVE_MARGIN_DB / 2, "mse": 12.0}, clips) == "mse"
    assert choose({"max": 10.0, "entropy": 12.0 + DESTRUCTIVE_MARGIN_DB, "mse": 12.0}, clips) == "entropy"
    assert choose({"max": 10.0, "entropy": 20.0}, {"max": ["a"], "entropy": ["b"]}) == "entropy"
    assert choose({"max": math.nan, "mse": 3.0}, {}) == "mse"


def test_the_last_quarter_of_each_batch_or_one_batch_in_four_is_held_out_up_to_the_maximum():
    assert [held_out(i, 0, 8) for i in range(4)] == [2, 2, 2, 2]  # splittable: the last quarter of each
    assert [held_out(i, 0, 3) for i in range(8)] == [0, 0, 0, 3, 0, 0, 0, 3]  # too small to split: whole batches
    assert [held_out(i, 0) for i in range(4)] == [0, 0, 0, 1]  # samples unknown: whole batches
    taken, picked = 0, []
    for index in range(HOLDOUT_EVERY * MAX_HOLDOUT + 8):
        if held_out(index, taken):
            picked.append(index)
            taken += 1
    assert picked == [HOLDOUT_EVERY * k + HOLDOUT_EVERY - 1 for k in range(MAX_HOLDOUT)]
    assert held_out(0, MAX_HOLDOUT, 100) == 0


def test_the_candidates_are_every_registered_method_computed_from_statistics():
    assert [method.name for method, _ in candidates()] == list(qdq.calib.CALIBRATION_METHODS)
    assert all(not method.model_level for method, _ in candidates())


@pytest.mark.parametrize("name", ["mse", "entropy"])
def test_a_searching_method_is_scored_on_every_fourth_bin_within_those_bins_of_its_exact_range(name):
    from qdq.calib import HistogramCalibrator
    from qdq.workflow.auto_calibration import SCORING_STRIDE

    options = dict(candidates())[qdq.calib.get_method(name)]
    assert options == {"stride": SCORING_STRIDE}
    calibrator = HistogramCalibrator(num_bits=8, axis=None, unsigned=False)
    calibrator.collect(torch.from_numpy(np.random.default_rng(0).standard_t(3, size=200_000).astype(np.float32)))
    exact, scored = calibrator.compute_amax(name), calibrator.compute_amax(name, stride=SCORING_STRIDE)
    width = float(calibrator.compute_amax("max")) / 4096  # the histogram's bin width (4096 bins up to the max)
    assert abs(float(scored) - float(exact)) <= SCORING_STRIDE * width * 1.01


class _Probe(nn.Module):
    """A linear layer reading ``features`` values, then an optional saturation."""

    def __init__(self, features: int, saturate: float | None = None):
        super().__init__()
        self.fc = nn.Linear(features, 8)
        self.saturate = saturate

    def forward(self, x):
        y = self.fc(x)
        return y if self.saturate is None else torch.clamp(y, -self.saturate, self.saturate)


def _outlier_batches(seed: int, scale: float, count: int = 8) -> list[torch.Tensor]:
    """Batches of 64 x 256 values drawn from N(0, 1), but one value in each batch (a rate of 6e-5: below what
    percentile 99.99 keeps) is ``scale`` times larger."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        x = torch.randn(64 * 256, generator=gen)
        x[torch.randint(0, x.numel(), (1,), generator=gen)] = scale
        batches.append(x.reshape(64, 256))
    return batches


def test_outliers_that_carry_the_output_keep_a_range_that_holds_them():
    """The outliers reach the output unchanged (a linear layer): clipping them moves those outputs by far more than
    a coarser step costs the rest. percentile 99.99 and entropy clip them (flagged destructive) and score far below;
    the range kept holds them (max, or mse just under it)."""
    torch.manual_seed(0)
    model = qdq.quantize_model(_Probe(256))
    result = select_amax(model, _outlier_batches(0, 60.0), progress=False)
    assert result.chosen in ("max", "mse"), result.table()
    assert result.clipping["percentile 99.99"] and result.clipping["entropy"]
    assert result.scores[result.chosen] > result.scores["percentile 99.99"] + 6
    assert result.held_out and result.batches == 8  # the last 16 of each batch of 64
    assert float(model.fc._input_quantizer.amax) >= 0.9 * 60.0
    assert model.fc._input_quantizer.amax_method == f"auto: {result.chosen}"


def test_outliers_a_saturating_layer_ignores_are_clipped_and_said():
    """Far larger outliers, and the layer's output saturates: what clipping costs them is lost anyway, and max's
    step (1000 / 127) rounds the body to zero (mse and entropy keep the outliers too: they hold the energy).
    percentile clips them: the diagnostics call that destructive (the outliers are most of the energy), but it
    scores far above the rest, so it is kept, and the clipping warning says so."""
    torch.manual_seed(0)
    model = qdq.quantize_model(_Probe(256, saturate=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(model, _outlier_batches(1, 1000.0), progress=False)
    assert model.fc._input_quantizer.amax_method == "auto: percentile 99.99"
    assert float(model.fc._input_quantizer.amax) < 10
    assert [w for w in caught if issubclass(w.category, QdqCalibrationWarning)]
    result = select_amax(qdq.quantize_model(_Probe(256, saturate=0.5)), _outlier_batches(1, 1000.0), progress=False)
    assert result.clipping[result.chosen]
    assert result.scores[result.chosen] > max(result.scores[k] for k in result.scores if k != result.chosen) + 6


def _group_head() -> nn.Module:
    """A head that reads the detector activation's sparse tail: the group holding the largest value wins."""
    head = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.kron(torch.eye(4), torch.ones(1, 16)))
    return head


def test_a_tail_entropy_clips_is_flagged_destructive_and_not_chosen():
    """The shipped detector activation: entropy cuts the 1 % tail where the signal is; auto reports it as
    destructive and keeps a range that holds the tail, and the model agrees with the float head."""
    calib = [tail_signal_data(64, seed)[0] for seed in range(8)]
    x, _ = tail_signal_data(2000, 10)
    labels = _group_head()(x).argmax(1)
    model = qdq.quantize_model(_group_head(), qdq.QuantConfig(quant_desc_weight=qdq.QuantDescriptor(axis=0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(model, calib, progress=False)  # the default: auto
    assert not [w for w in caught if issubclass(w.category, QdqCalibrationWarning)]
    quantizer = model._input_quantizer if hasattr(model, "_input_quantizer") else next(
        q for _, q in named_quantizers(model, weights=False))  # fmt: skip
    assert quantizer.amax_method in ("auto: max", "auto: mse", "auto: percentile 99.99")
    assert float((model(x).argmax(1) == labels).float().mean()) >= 0.99


def test_the_report_lists_every_candidate_and_says_when_nothing_was_held_out():
    batches = [b[:3] for b in _outlier_batches(2, 60.0, count=2)]  # two batches of three samples: nothing to spare
    model = qdq.quantize_model(_Probe(256))
    result = select_amax(model, batches, progress=False)
    assert not result.held_out and result.batches == 2
    assert "too few to hold one out" in result.summary()
    table = result.table()
    for method, options in candidates():
        assert method.label(options) in table
    assert table.count("| chosen |") == 1


def test_held_out_samples_are_collected_apart_and_kept_with_their_float_outputs():
    """collect_split: the last quarter of each batch goes to the second calibrators (a value of 50 there is not in
    the kept statistics), with the float model's output on exactly those samples."""
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    batches[0][7, 0] = 50.0  # in a held-out sample (the last two of each batch)
    model = qdq.quantize_model(_Probe(16))
    held = collect_split(model, batches, held_out, calibrator="max", progress=False)
    quantizer = model.fc._input_quantizer
    assert float(quantizer._calibrator.compute_amax()) == max(float(b[:6].abs().max()) for b in batches) < 50
    assert float(held.calibrators["fc._input_quantizer"].compute_amax()) == 50.0
    assert [tuple(b.shape) for b, _ in held.batches] == [(2, 16)] * 4 and not held.first
    with torch.no_grad(), disabled_quantizers(model):
        for (batch, output), full in zip(held.batches, batches):
            assert torch.equal(batch, full[6:]) and torch.allclose(output, model(batch))


def test_auto_reads_a_one_shot_iterator_once():
    """auto holds its batches out in the statistics pass: one pass, so a generator is enough."""
    model = qdq.quantize_model(_Probe(256))
    calibrate(model, (b for b in _outlier_batches(3, 60.0)), progress=False)
    assert model.fc._input_quantizer.amax_method.startswith("auto: ")


def test_ptq_with_auto_records_and_restores_each_quantizers_method():
    model = qdq.quantize_model(_Probe(256))
    batches = _outlier_batches(4, 60.0)
    result = ptq(model, batches, lambda m: 1.0 if (m.fc._input_quantizer.amax_method or "").startswith("auto") else 0.0,
                 ("max", "auto"), progress=False)  # fmt: skip
    assert result.best.method == "auto"
    assert model.fc._input_quantizer.amax_method.startswith("auto: ")


def test_one_held_out_batch_splits_by_its_samples_in_tuples_and_dicts_and_only_there():
    from qdq.workflow.auto_calibration import _rows

    batch = (torch.arange(8.0).reshape(8, 1), {"labels": torch.arange(8)})
    first, second = _rows((batch, torch.arange(8.0) * 2))
    assert first[0][0].ravel().tolist() == [0, 1, 2, 3] and second[0][1]["labels"].tolist() == [4, 5, 6, 7]
    assert second[1][0].tolist() == [8, 10, 12, 14]
    assert _rows((batch, torch.zeros(2, 8, 4))) is None  # a state [layers, batch, width]: samples not along dim 0
    assert _rows((torch.zeros(1, 3), torch.zeros(1))) is None  # one sample


class _EvalOnly(nn.Module):
    """A model that refuses to run in training mode without targets, as torchvision's detectors do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert not self.training, "targets should not be none when in training mode"
        return self.head(torch.relu(self.norm(self.conv(x))))


class _Wrapper(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def test_the_default_leaves_every_module_in_its_own_mode_and_the_norms_statistics_as_they_were():
    """A user's wrapper (training mode, as a new ``nn.Module`` is) around a model in eval mode: the scoring restored
    the root's flag on every submodule (``model.train(True)``), and bias correction then ran the model training:
    the detector raised, and BatchNorm updated its running statistics on the calibration data."""
    torch.manual_seed(0)
    inner = _EvalOnly()
    inner.norm.running_mean.uniform_(-0.5, 0.5)
    inner.eval()
    model = qdq.quantize_model(_Wrapper(inner), qdq.QuantConfig(target="onnxruntime"))  # traced: a new root
    modes = [m.training for m in model.modules()]
    assert modes[0] and not any(m.training for m in model.model.modules())  # quantize_model kept each one's mode
    statistics = (inner.norm.running_mean.clone(), inner.norm.running_var.clone())
    data = [torch.randn(8, 3, 12, 12) for _ in range(4)]
    result = select_amax(model, data, progress=False)  # what qdq.calibrate(model, data) runs
    assert result.bias_base is not None  # bias correction was measured
    assert [m.training for m in model.modules()] == modes
    norm = model.model.norm  # its conv has a bias: bias correction moves that, never the norm's statistics
    assert torch.equal(norm.running_mean, statistics[0]) and torch.equal(norm.running_var, statistics[1])

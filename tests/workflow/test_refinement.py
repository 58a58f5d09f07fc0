"""Per-quantizer refinement of auto's choice: the walk over the quantizers whose candidates disagree, its gain
thresholds against a hand-built score, and a model whose two activations need two different methods (known by
construction) through both doors."""

import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.fidelity import FidelityMeter
from qdq.workflow.refinement import (
    DESTRUCTIVE_GAIN_DB,
    MIN_DIFFERENCE,
    MIN_SPLIT_SAMPLES,
    REFINE_GAIN_DB,
    halves,
    refine,
    samples_of,
)


def _meter(db: float) -> FidelityMeter:
    """A meter scoring ``db``: one feature of variance 1 whose outputs are off by 10^(-db/20)."""
    error = 10 ** (-db / 20)
    meter = FidelityMeter()
    meter.add([np.array([1.0, -1.0])], [np.array([1.0 + error, -1.0 + error])])
    return meter


def _additive_score(gains: dict[str, dict[str, float]], second: dict[str, dict[str, float]] | None = None):
    """Each half scores 20 dB plus each quantizer's gain for its method (0 for a method not listed); the second
    half gains ``second`` where given."""
    calls = []

    def score(selection, half):
        calls.append((dict(selection), half))
        table = second if half == 1 and second is not None else gains
        return _meter(20 + sum(table.get(key, {}).get(label, 0.0) for key, label in selection.items()))

    return score, calls


def _tried(calls) -> list[str]:
    """The quantizer each trial's first run changed (the first two calls score the start)."""
    return [next(k for k, v in selection.items() if v != "a") for selection, half in calls[2:] if half == 0]


def test_a_meter_scores_as_the_oracle():
    assert _meter(20.0).score() == pytest.approx(20.0) and (_meter(20.0) + _meter(20.0)).score() == pytest.approx(20.0)


def test_a_change_is_kept_only_above_its_gain_and_a_destructive_one_above_the_larger_gain():
    candidates = {"a": {"q1": 1.0, "q2": 1.0, "q3": 1.0, "q4": 1.0}, "b": {"q1": 2.0, "q2": 3.0, "q3": 4.0, "q4": 1.0}}
    gains = {"q1": {"b": 0.4 * REFINE_GAIN_DB}, "q2": {"b": 1.2 * REFINE_GAIN_DB}, "q4": {"b": 5.0},
             "q3": {"b": (REFINE_GAIN_DB + DESTRUCTIVE_GAIN_DB) / 2}}  # q4: b's range equals a's, never tried
    score, calls = _additive_score(gains)
    selection, result = refine(candidates, "a", score, {k: k for k in candidates["a"]}, {"b": ["q3"]})
    assert selection == {"q1": "a", "q2": "b", "q3": "a", "q4": "a"}
    assert [(c.quantizer, c.before, c.after) for c in result.changes] == [("q2", "a", "b")]
    assert result.changes[0].gain_db == pytest.approx(1.2 * REFINE_GAIN_DB)
    assert result.score == pytest.approx(20 + 1.2 * REFINE_GAIN_DB) and result.start == pytest.approx(20.0)
    assert _tried(calls) == ["q3", "q2", "q1"]  # the largest ratio first
    # the start's two halves; q3 and q2 gain half of what they need on the first half, so the second runs; q1 not
    assert result.tried == 3 and result.runs == 2 + 2 + 2 + 1 == len(calls)
    assert "1 of 3 quantizers" in result.summary() and "| q2" in result.table()


def test_only_the_most_disagreeing_quantizers_are_tried_and_small_differences_never():
    candidates = {"a": {f"q{i}": 1.0 for i in range(6)},
                  "b": {"q0": 1.0 + MIN_DIFFERENCE / 2, "q1": 1.5, "q2": 8.0, "q3": 0.1, "q4": 1.2, "q5": 1.0}}
    score, calls = _additive_score({})
    _, result = refine(candidates, "a", score, {k: k for k in candidates["a"]}, {}, limit=2)
    assert result.tried == 2 and result.runs == 4 and not result.changes
    assert _tried(calls) == ["q3", "q2"]  # |log 0.1| > |log 8|


def test_a_walk_takes_its_best_range_and_stops_where_the_score_falls():
    candidates = {"a": {"q": 1.0}, "b": {"q": 2.0}, "c": {"q": 4.0}, "d": {"q": 8.0}}
    score, calls = _additive_score({"q": {"b": 1.0, "c": 1.0 + 0.3 * REFINE_GAIN_DB, "d": 0.2}})
    selection, result = refine(candidates, "a", score, {"q": "q"}, {})
    assert selection == {"q": "c"} and result.changes[0].gain_db == pytest.approx(1.0 + 0.3 * REFINE_GAIN_DB)
    # the start's two halves, b, c and d on the first half (d falls: the walk ends), c on the second
    assert result.runs == 2 + 3 + 1 == len(calls)


def test_a_walk_whose_nearest_range_scores_lower_goes_no_further():
    candidates = {"a": {"q": 2.0}, "b": {"q": 1.0}, "c": {"q": 4.0}, "d": {"q": 8.0}, "e": {"q": 0.5}}
    score, calls = _additive_score({"q": {"b": -1.0, "c": -1.0, "d": 5.0, "e": 5.0}})
    selection, result = refine(candidates, "a", score, {"q": "q"}, {})
    assert selection == {"q": "a"} and not result.changes
    assert [sel["q"] for sel, half in calls[2:]] == ["b", "c"]  # the nearest smaller and the nearest larger only


def test_a_start_the_front_end_scored_already_is_not_run_again():
    candidates = {"a": {"q": 1.0}, "b": {"q": 2.0}}
    score, calls = _additive_score({"q": {"b": 1.0}})
    selection, result = refine(candidates, "a", score, {"q": "q"}, {}, start=(_meter(20.0), _meter(20.0)))
    assert selection == {"q": "b"} and result.start == pytest.approx(20.0)
    assert result.runs == len(calls) == 2 and [sel["q"] for sel, _ in calls] == ["b", "b"]  # b's two halves only


def test_a_gain_one_half_of_the_held_out_batches_does_not_carry_is_not_kept():
    candidates = {"a": {"q1": 1.0, "q2": 1.0}, "b": {"q1": 2.0, "q2": 3.0}}
    gains = {"q1": {"b": 2.0}, "q2": {"b": 2.0}}
    score, _ = _additive_score(gains, second={"q1": {"b": 1.0}, "q2": {"b": 0.1}})
    selection, result = refine(candidates, "a", score, {"q1": "q1", "q2": "q2"}, {})
    assert selection == {"q1": "b", "q2": "a"} and [c.quantizer for c in result.changes] == ["q1"]
    assert result.changes[0].half_gains_db == pytest.approx((2.0, 1.0))


def test_nothing_to_try_runs_nothing_and_without_halves_nothing_changes():
    score, calls = _additive_score({})
    selection, result = refine({"a": {"q": 1.0}, "b": {"q": 1.0}}, "a", score, {"q": "q"}, {})
    assert selection == {"q": "a"} and not calls and result.runs == 0 and "not refined" in result.summary()
    selection, result = refine({"a": {"q": 1.0}, "b": {"q": 2.0}}, "a", None, {"q": "q"}, {})
    assert selection == {"q": "a"} and "fewer than two held-out batches" in result.summary()


def test_the_halves_are_alternate_batches_and_need_two_batches_and_enough_samples():
    pairs = [(i, np.zeros((n, 3))) for i, n in enumerate([1, 2, 1, 3])]
    first, second = halves(pairs, lambda pair: samples_of([pair[1]]))
    assert [p[0] for p in first] == [0, 2] and [p[0] for p in second] == [1, 3]
    assert halves(pairs[:1], lambda pair: 8) is None  # one batch
    assert halves(pairs[:2], lambda pair: samples_of([pair[1]])) is None  # 3 samples < MIN_SPLIT_SAMPLES
    assert MIN_SPLIT_SAMPLES == 4 and samples_of([np.float32(1.0)]) == 1 and samples_of([]) == 1



class _TwoPaths(nn.Module):
    """Two linear layers on two inputs: the first's rare outliers reach its output (a range must hold them), the
    second's far larger outliers are saturated away after it (a range that holds them rounds the rest to zero)."""

    def __init__(self):
        super().__init__()
        self.carry = nn.Linear(256, 8)
        self.saturating = nn.Linear(256, 8)

    def forward(self, x, z):
        return self.carry(x), torch.clamp(self.saturating(z), -0.5, 0.5)


def _batches(seed: int, count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """64 x 256 values from N(0, 1) per input, one value in each batch 60 (``x``) or 1000 (``z``) instead: a rate
    below what percentile 99.99 keeps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        pair = []
        for scale in (60.0, 1000.0):
            v = torch.randn(64 * 256, generator=gen)
            v[torch.randint(0, v.numel(), (1,), generator=gen)] = scale
            pair.append(v.reshape(64, 256))
        out.append(tuple(pair))
    return out


def test_the_pytorch_door_gives_each_activation_the_method_it_needs():
    """No one method suits both: max (or mse) keeps ``x``'s outliers and rounds ``z``'s body to zero, percentile
    the reverse. The refinement gives the other activation the other method, and scores above both."""
    torch.manual_seed(0)
    model = qdq.quantize_model(_TwoPaths())
    result = select_amax(model, _batches(0), progress=False, forward_fn=lambda m, b: m(*b))
    assert result.refinement is not None and result.refinement.changes, result.table()
    assert float(model.carry._input_quantizer.amax) >= 0.9 * 60
    assert float(model.saturating._input_quantizer.amax) < 10
    assert result.refinement.score > max(result.scores.values()) + 3
    assert model.saturating._input_quantizer.amax_method.startswith("auto: ")
    assert {c.quantizer for c in result.refinement.changes} <= {"carry._input_quantizer", "saturating._input_quantizer"}
    assert "Refined" in result.table()


def test_the_onnx_door_gives_each_activation_the_method_it_needs(tmp_path):
    torch.manual_seed(0)
    source = tmp_path / "two_paths.onnx"
    torch.onnx.export(_TwoPaths().eval(), _batches(9, 1)[0], source, input_names=["x", "z"],
                      output_names=["carried", "saturated"], dynamic_axes={"x": {0: "n"}, "z": {0: "n"}},
                      opset_version=17, dynamo=False)  # fmt: skip
    feeds = [{"x": x.numpy(), "z": z.numpy()} for x, z in _batches(0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qdq.quantize_onnx(source, feeds, tmp_path / "q.onnx", target="onnxruntime", progress=False,
                                   bias_correction=False)  # fmt: skip
    auto = result.auto
    assert auto is not None and auto.refinement is not None and auto.refinement.changes, auto.table()
    assert auto.refinement.score > max(auto.scores.values()) + 3
    ranges = {name: float(np.max(v)) for name, v in result.ranges.items() if v.size == 1}
    carry = next(v for k, v in ranges.items() if "carry" in k or k.startswith("/carry"))
    saturating = next(v for k, v in ranges.items() if "saturating" in k)
    assert carry >= 0.9 * 60 and saturating < 10
    assert "Refined" in result.report()
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"))

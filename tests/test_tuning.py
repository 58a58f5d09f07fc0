"""qdq.tune on small ONNX files whose sensitive tensor is known by construction."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
import qdq.tuning.evaluation
import qdq.tuning.timing
from onnx_models import export
from qdq.runtime import Backend, register_runtime, unregister_runtime
from qdq.runtime.ort import OrtRuntime
from qdq.targets import TENSORRT, RuntimeSupport
from qdq.tuning import Budget
from qdq.workflow.verification import sqnr_db


class SparseTail(nn.Module):
    """Three convs and a linear head over every pixel (a mean over pixels would let bias correction undo the damage:
    it is a per-pixel loss, not a mean shift); the second conv's output channel 0 is ``relu(1000 (x - 3))`` of the first
    input channel: zero but at about 0.1 % of the pixels, where it reaches hundreds. Calibrated with ``max``, one
    8-bit range over that tensor rounds every other channel to zero: that tensor is the one to leave float. The
    third conv ignores channel 0, so no later tensor inherits the tail."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8 * 16 * 16, 10)
        with torch.no_grad():
            self.a.weight[0].zero_()
            self.a.weight[0, 0, 1, 1] = 1.0
            self.a.bias[0] = 0.0
            self.b.weight[0].zero_()
            self.b.weight[0, 0, 1, 1] = 1000.0
            self.b.bias[0] = -3000.0
            self.c.weight[:, 0] = 0.0  # the tail stops here: the next tensors have ordinary ranges

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))
        return self.head(y.flatten(1))


class TwoTails(nn.Module):
    """Two branches, each a :class:`SparseTail`-like conv whose output channel 0 is zero but at about 0.1 % of the
    pixels, summed into a linear head: either tail left alone in int8 rounds its branch away, so only the two left
    float together restore the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b1, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c1, self.c2 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8 * 16 * 16, 10)
        with torch.no_grad():
            self.a.weight[0].zero_()
            self.a.weight[0, 0, 1, 1] = 1.0
            self.a.bias[0] = 0.0
            for b, c in ((self.b1, self.c1), (self.b2, self.c2)):
                b.weight[0].zero_()
                b.weight[0, 0, 1, 1] = 1000.0
                b.bias[0] = -3000.0
                c.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.a(x))
        y = torch.relu(self.c1(torch.relu(self.b1(a)))) + torch.relu(self.c2(torch.relu(self.b2(a))))
        return self.head(y.flatten(1))


class MixedConcat(nn.Module):
    """Two branches concatenated and read by a conv: one of ranges about 1, one about 1000 (scaled by its
    weights). ONNX Runtime's int8 concatenation gives its output one scale, which rounds the small branch away;
    the next conv reads only the small branch: the concatenation's output is the tensor to leave float."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.small, self.large = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.mix = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8 * 16 * 16, 10)
        with torch.no_grad():
            self.large.weight.mul_(1000.0)
            self.mix.weight[:, 4:] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(self.small(x)), torch.relu(self.large(x))], dim=1)
        return self.head(torch.relu(self.mix(y)).flatten(1))


class SparseTokens(nn.Module):
    """:class:`SparseTail` for tokens: linear layers over ``[batch, tokens, features]`` (exported as MatMul + Add),
    the second one's output feature 0 zero but at a few tokens; the third linear, whose MatMul reads
    that tensor, ignores the feature (about 0.6 % of the tokens here: a few per batch). Leaving the tail float
    leaves that MatMul float on its constant weight: the one MatMul the precision variants convert."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        with torch.no_grad():
            self.a.weight[0].zero_()
            self.a.weight[0, 0], self.a.bias[0] = 1.0, 0.0
            self.b.weight[0].zero_()
            self.b.weight[0, 0], self.b.bias[0] = 1000.0, -2500.0
            self.c.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def _data(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"images": rng.normal(size=(8, 3, 16, 16)).astype(np.float32)} for _ in range(count)]


@pytest.fixture(scope="module")
def sparse_tail(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune")
    path = export(SparseTail(), torch.randn(1, 3, 16, 16), folder / "tail.onnx")
    graph = onnx.load(str(path)).graph
    conv_b = next(n for n in graph.node if n.op_type == "Conv" and n.input[1].startswith("b."))
    relu_b = next(n for n in graph.node if n.op_type == "Relu" and n.input[0] == conv_b.output[0])
    return path, relu_b.output[0]


def test_the_search_leaves_exactly_the_sparse_tail_float_and_times_it_on_the_runtime(sparse_tail, tmp_path,
                                                                                     monkeypatch):  # fmt: skip
    path, tail = sparse_tail
    measured = []
    original = qdq.tuning.timing.compare_models

    def recording(*args, **kwargs):
        comparison = original(*args, **kwargs)
        measured.append(comparison)
        return comparison

    monkeypatch.setattr(qdq.tuning.timing, "compare_models", recording)
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "tuned.onnx", budget=Budget.sqnr(25.0),
                      method="max", progress=False, rounds=3, iters=3)  # fmt: skip
    assert not result.int8.meets(result.budget)  # plain INT8 misses the budget
    assert result.int8.score < result.budget.threshold - 1.0
    assert result.chosen is not None and result.chosen.meets(result.budget) and (tail,) in result.chosen.floated
    # the fewest that meet: the tail alone (the choice among those level in speed is asserted below, from the timings)
    assert _fewest_meeting(result).floated == ((tail,),)
    assert result.path == tmp_path / "tuned.onnx" and result.path.is_file()
    # the file holds no Q/DQ pair on the tail tensor, and one on every other conv input
    graph = onnx.load(str(result.path)).graph
    quantized = {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    assert tail not in quantized
    # latencies are the runtime's interleaved block medians
    comparison, confirmation = measured
    timed = [result.fp32, *[t for t in result.trials if t.ms is not None]]
    assert len(timed) == len(comparison.block_ms)
    for trial, blocks in zip(timed, comparison.block_ms.values()):
        assert trial.ms == pytest.approx(float(np.median(blocks)))
    # the choice rests on a second, fresh timing of FP32, INT8 and the passing configurations
    confirmed = [t for t in [result.fp32, *result.trials] if t.confirmed is not None]
    assert confirmed[:2] == [result.fp32, result.int8] and result.chosen in confirmed
    for trial, blocks in zip(confirmed, confirmation.block_ms.values()):
        assert trial.confirmed[0] == pytest.approx(float(np.median(blocks)))
    passing = [t for t in confirmed[1:] if t.meets(result.budget)]  # FP32 is the reference, not a candidate
    fastest = min(passing, key=lambda t: t.confirmed[0])
    level = [t for t in passing if t.confirmed[1] <= fastest.confirmed[2]]  # as fast within the spread
    assert result.chosen in level and len(result.chosen.floated) == min(len(t.floated) for t in level)
    assert result.evaluations >= len(result.trials)
    report = result.report()
    print(report)
    assert "(chosen)" in report and tail in report and "PASS" in report and "FAIL" in report


def test_timing_loads_at_most_max_loaded_files_at_once(sparse_tail, tmp_path, monkeypatch):
    """Each configuration is a session (an engine on a GPU): beyond max_loaded, they are timed in groups, each beside
    FP32 and INT8, and every configuration still gets its latency."""
    path, _ = sparse_tail
    loaded = []
    original = qdq.tuning.timing.compare_models

    def recording(models, *args, **kwargs):
        loaded.append(len(models))
        return original(models, *args, **kwargs)

    monkeypatch.setattr(qdq.tuning.timing, "compare_models", recording)
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "tuned.onnx", budget=Budget.sqnr(200.0),
                      method="max", progress=False, rounds=1, iters=2, max_loaded=3)  # fmt: skip
    assert len(result.trials) >= 3 and all(t.ms is not None for t in [result.fp32, *result.trials])
    confirmed = any(t.confirmed is not None for t in result.trials)
    timing = loaded[:-1] if confirmed else loaded  # the confirmation times FP32, INT8 and the passing ones last
    assert len(timing) == len(result.trials) - 1 and set(timing) == {3}
    with pytest.raises(qdq.QdqConfigError, match="max_loaded=2"):
        qdq.tune(path, _data(2, 1), _data(2, 2), tmp_path / "t.onnx", budget=Budget.sqnr(20.0), max_loaded=2)


def test_a_budget_the_plain_int8_file_meets_leaves_nothing_float(sparse_tail, tmp_path):
    path, _ = sparse_tail
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "tuned.onnx", budget=Budget.sqnr(-100.0),
                      method="max", progress=False, rounds=1, iters=2)  # fmt: skip
    assert result.chosen is not None and result.chosen.floated == ()
    assert [t.name for t in result.trials] == ["INT8"]


def test_budget_drop_is_measured_against_fp32(sparse_tail, tmp_path):
    path, _ = sparse_tail

    def mean_logit(outputs, batches):
        return float(outputs[0].mean())

    budget = Budget.drop(mean_logit, 0.5, name="mean logit")
    result = qdq.tune(path, _data(2, 1), _data(2, 2), tmp_path / "t.onnx", budget=budget, method="max",
                      progress=False, rounds=1, iters=2)  # fmt: skip
    assert result.budget.threshold == pytest.approx(min(result.fp32.score, result.fp32.holdout) - 0.5)


def test_too_little_evaluation_data_is_one_clear_error(sparse_tail, tmp_path):
    path, _ = sparse_tail
    with pytest.raises(qdq.QdqConfigError, match="at least two batches"):
        qdq.tune(path, _data(2, 1), _data(1, 2), tmp_path / "t.onnx", budget=Budget.sqnr(20.0), progress=False)


def test_a_score_in_coarse_steps_finds_the_two_tails_among_the_leading_units(tmp_path):
    """The budget's score is a step (pass or fail, as F1 over a few images moves by whole detections): no single
    greedy step gains, so the greedy phase undoes every step; floating the leading units together finds both
    tails, and pruning drops every other unit."""
    path, tails = _two_tails(tmp_path)
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "t.onnx",
                      budget=Budget.minimum(_restored, 1.0, name="restored"), method="max", progress=False,
                      rounds=1, iters=2)  # fmt: skip
    assert not result.int8.meets(result.budget)
    greedy = [t for t in result.trials if t.name.startswith("greedy")]
    assert greedy and all(t.name.endswith("(undone)") for t in greedy)
    assert any(t.name.startswith("top") and t.meets(result.budget) for t in result.trials)
    assert {u for (u,) in _fewest_meeting(result).floated} == tails  # pruning kept the two tails only
    assert result.chosen is not None and tails <= {u for (u,) in result.chosen.floated}  # the rest: by its timing
    assert "together they cost" in result.report()
    _assert_unit_costs_are_measured_pairs(result)


def test_when_no_unit_gains_on_the_proxy_the_ranking_goes_on_over_every_unit(tmp_path):
    """A proxy that ranks nothing (every unit gains 0 dB alone): the ranking's end is every unit float, so the
    leading-units phase still finds the two tails, and pruning drops the rest."""
    path, tails = _two_tails(tmp_path)
    budget = Budget("restored", lambda reference, outputs, _: _restored(reference, outputs), 1.0,
                    proxy=lambda reference, outputs: 0.0)  # fmt: skip
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "t.onnx", budget=budget, method="max",
                      progress=False, rounds=1, iters=2, max_steps=20)  # fmt: skip
    assert result.gains and all(gain == 0.0 for gain in result.gains.values())
    assert not any(t.name.startswith("greedy") for t in result.trials)  # no unit gained: nothing to step through
    assert {u for (u,) in _fewest_meeting(result).floated} == tails
    assert result.chosen is not None and result.chosen.meets(result.budget)  # the fastest of those that meet


def _fewest_meeting(result):
    """The configuration with the fewest float units among those that meet the budget (the search's pruned one;
    which of those level in speed is chosen rests on the host's timing)."""
    return min((t for t in result.trials if t.meets(result.budget)), key=lambda t: len(t.floated))


def _two_tails(folder):
    path = export(TwoTails(), torch.randn(1, 3, 16, 16), folder / "two.onnx")
    graph = onnx.load(str(path)).graph
    tails = set()
    for branch in ("b1.", "b2."):
        conv = next(n for n in graph.node if n.op_type == "Conv" and n.input[1].startswith(branch))
        tails.add(next(n for n in graph.node if n.op_type == "Relu" and n.input[0] == conv.output[0]).output[0])
    return path, tails


def _restored(reference, outputs):
    """1 when the output's SQNR against FP32 reaches 25 dB, else 0: a score in one coarse step."""
    signal = float(np.sum(np.square(reference[0], dtype=np.float64)))
    return float(sqnr_db(signal, float(np.sum(np.square(reference[0] - outputs[0], dtype=np.float64)))) >= 25.0)


def _assert_unit_costs_are_measured_pairs(result):
    """Each unit's reported cost is the latency difference of two timed trials that differ by that unit alone."""
    assert result.unit_ms
    timed = [t for t in result.trials if t.ms is not None]
    for unit, cost in result.unit_ms.items():
        pairs = [a.ms - b.ms for a in timed for b in timed if set(a.floated) - set(b.floated) == {unit}
                 and len(a.floated) == len(b.floated) + 1]  # fmt: skip
        assert any(cost[0] == pytest.approx(diff) for diff in pairs)
        assert cost[1] <= cost[0] <= cost[2]
    assert "measured ms added" in result.report()


def test_a_pytorch_model_is_tuned_through_its_fp32_export_with_labelled_batches(tmp_path):
    """The module itself, its data as a PyTorch user holds it: (images, labels) pairs. The budget reads the labels
    (agreement of the INT8 argmax with the FP32 model's own predictions, which the labels here are)."""
    model = SparseTail().eval()
    images = [torch.from_numpy(b["images"]) for b in _data(4, 1) + _data(4, 2)]
    with torch.no_grad():
        batches = [(x, model(x).argmax(1)) for x in images]
    seen = []

    def agreement(outputs, feeds):
        seen.extend(sorted(feed) for feed in feeds)
        labels = np.concatenate([feed["labels"] for feed in feeds])
        return float((outputs[0].argmax(1) == labels).mean())

    result = qdq.tune(model, batches[:4], batches[4:], tmp_path / "t.onnx", budget=Budget.sqnr(25.0), method="max",
                      progress=False, rounds=1, iters=2)  # fmt: skip
    assert not result.int8.meets(result.budget)
    assert result.chosen is not None and len(result.chosen.floated) == 1  # the sparse tail, by its exported name
    graph = onnx.load(str(result.path)).graph
    assert [i.name for i in graph.input] == ["input"]  # qdq's export names a single positional input "input"
    # what computes each tensor, from the exporter's name scopes: the module a conv belongs to
    assert {"Conv in a", "Conv in b", "Conv in c", "Gemm in head"} <= set(result.made_by.values())
    assert result.made_by["input"] == "graph input"
    (tail,) = result.chosen.floated[0]
    assert f"{tail} ({result.made_by[tail]})" in result.report()
    labelled = qdq.tune(model, batches[:4], batches[4:], tmp_path / "l.onnx", method="max", progress=False,
                        rounds=1, iters=2, budget=Budget.drop(agreement, 0.5, name="agreement"))  # fmt: skip
    assert labelled.fp32.score == 1.0  # the labels are the FP32 model's predictions
    assert seen and all(keys == ["input", "labels"] for keys in seen)


def test_a_keras_model_is_tuned_through_its_fp32_export(tmp_path):
    """The Keras twin of :class:`SparseTail` (channels last), its data as a Keras user holds it: (images, labels)
    arrays; the search leaves float exactly the tail tensor of the exported graph."""
    keras = _keras_or_skip()
    model = _keras_sparse_tail(keras)
    rng = np.random.default_rng(0)
    batches = [(x, model(x).numpy().argmax(1)) for x in (rng.normal(size=(8, 16, 16, 3)).astype(np.float32)
                                                         for _ in range(8))]  # fmt: skip
    seen = []

    def agreement(outputs, feeds):
        seen.extend(sorted(feed) for feed in feeds)
        return float((outputs[0].argmax(1) == np.concatenate([f["labels"] for f in feeds])).mean())

    result = qdq.tune(model, batches[:4], batches[4:], tmp_path / "k.onnx", budget=Budget.sqnr(25.0), method="max",
                      progress=False, rounds=1, iters=2)  # fmt: skip
    assert not result.int8.meets(result.budget)
    assert result.chosen is not None and len(result.chosen.floated) == 1
    (tail,) = result.chosen.floated[0]
    graph = onnx.load(str(result.path)).graph
    producer = next(n for n in graph.node if tail in n.output)
    assert producer.op_type == "Relu"
    conv = next(n for n in graph.node if producer.input[0] in n.output)
    assert "tail" in conv.name or any("tail" in name for name in conv.input)  # the tail layer's own activation
    labelled = qdq.tune(model, batches[:4], batches[4:], tmp_path / "l.onnx", method="max", progress=False,
                        rounds=1, iters=2, budget=Budget.drop(agreement, 0.5, name="agreement"))  # fmt: skip
    assert labelled.fp32.score == 1.0
    assert seen and all(keys == ["input", "labels"] for keys in seen)


def _keras_or_skip():
    """Keras 3 on TensorFlow with tf2onnx (the ``tf`` extra), imported as the Keras tests do; else a skip (a bare
    ``import keras`` could find the ``tests/keras`` folder instead)."""
    from qdq.errors import QdqBackendUnavailable
    from qdq.keras import _backend

    try:
        _backend.tf()
    except QdqBackendUnavailable:
        pytest.skip("tuning a Keras model needs TensorFlow: pip install 'qdq[tf]'")
    pytest.importorskip("tf2onnx", reason="the Keras export needs tf2onnx: pip install 'qdq[tf]'")
    return importlib.import_module("keras")


def _keras_sparse_tail(keras):
    inputs = keras.Input((16, 16, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="a")
    b = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="tail")
    c = keras.layers.Conv2D(8, 1, activation="relu", name="c")
    head = keras.layers.Dense(10, name="head")
    outputs = head(keras.layers.Flatten()(c(b(a(inputs)))))
    model = keras.Model(inputs, outputs)
    wa, ba = a.get_weights()
    wa[..., 0], ba[0] = 0.0, 0.0
    wa[1, 1, 0, 0] = 1.0
    wb, bb = b.get_weights()
    wb[..., 0], bb[0] = 0.0, -3000.0
    wb[1, 1, 0, 0] = 1000.0
    wc, bc = c.get_weights()
    wc[:, :, 0, :] = 0.0
    a.set_weights([wa, ba]), b.set_weights([wb, bb]), c.set_weights([wc, bc])
    return model


def test_the_float_matmul_of_the_met_configuration_is_tried_with_block_quantized_weights(tmp_path, monkeypatch):
    """After the search, the configuration that met with the fewest units is tried with its float MatMul on a
    constant weight as MatMulNBits, 8 and 4 bits: each variant is a file of its own, scored by the budget on the
    runtime and timed like every configuration."""
    path = export(SparseTokens(), torch.randn(1, 64, 16), tmp_path / "tokens.onnx")
    rng = np.random.default_rng(0)
    calibration = [{"images": rng.normal(size=(8, 64, 16)).astype(np.float32)} for _ in range(4)]
    evaluation = [{"images": rng.normal(size=(8, 64, 16)).astype(np.float32)} for _ in range(4)]
    converted = {}  # trial id -> MatMulNBits in the file it was scored on
    original = qdq.tuning.evaluation.Evaluator.add

    def recording(self, name, floated, path=None):
        trial = original(self, name, floated, path)
        ops = [n.op_type for n in onnx.load(str(trial.path)).graph.node]
        converted[id(trial)] = ops.count("MatMulNBits")
        return trial

    monkeypatch.setattr(qdq.tuning.evaluation.Evaluator, "add", recording)
    result = qdq.tune(path, calibration, evaluation, tmp_path / "t.onnx", budget=Budget.sqnr(25.0), method="max",
                      progress=False, rounds=1, iters=2)  # fmt: skip
    assert not result.int8.meets(result.budget)
    met = min((t for t in result.trials if t.meets(result.budget) and t.matmul_bits is None),
              key=lambda t: len(t.floated))  # fmt: skip
    variants = [t for t in result.trials if t.matmul_bits is not None]
    assert [t.matmul_bits for t in variants] == [8, 4]
    for variant in variants:
        assert variant.floated == met.floated and variant.name.startswith(f"{met.name}, 1 MatMul(s)")
        assert variant.ms is not None  # timed with the others
        assert converted[id(variant)] == 1  # the file it was scored on runs that MatMul as MatMulNBits
    assert converted[id(met)] == 0
    assert "MatMulNBits" in result.report()


def test_a_model_of_another_kind_is_one_clear_error(tmp_path):
    with pytest.raises(qdq.QdqConfigError, match=r"float torch\.nn\.Module or a float Keras model"):
        qdq.tune(object(), _data(2, 1), _data(2, 2), tmp_path / "t.onnx", budget=Budget.sqnr(20.0), progress=False)


def test_an_int8_concatenation_mixing_ranges_is_the_tensor_left_float(tmp_path):
    path = export(MixedConcat(), torch.randn(1, 3, 16, 16), tmp_path / "concat.onnx")
    concat = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Concat")
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "tuned.onnx", budget=Budget.sqnr(30.0),
                      method="max", progress=False, rounds=1, iters=2)  # fmt: skip
    assert not result.int8.meets(result.budget)
    assert _fewest_meeting(result).floated == ((concat.output[0],),)
    assert result.chosen is not None and (concat.output[0],) in result.chosen.floated


def test_the_command_line_tunes_from_npz_files_and_writes_the_report(sparse_tail, tmp_path, capsys):
    from qdq.cli import main

    path, tail = sparse_tail
    np.savez(tmp_path / "calib.npz", images=np.concatenate([b["images"] for b in _data(4, 1)]))
    np.savez(tmp_path / "eval.npz", images=np.concatenate([b["images"] for b in _data(4, 2)]))
    code = main(["tune", "--model", str(path), "--data", str(tmp_path / "calib.npz"), "--eval-data",
                 str(tmp_path / "eval.npz"), "--min-sqnr", "25", "--calib", "max", "--out", str(tmp_path / "t.onnx"),
                 "--report", str(tmp_path / "tune.md")])  # fmt: skip
    assert code == 0 and (tmp_path / "t.onnx").is_file()
    report = (tmp_path / "tune.md").read_text()
    assert "(chosen)" in report and tail in report
    assert "tuned file:" in capsys.readouterr().out
    assert main(["tune", "--model", str(path), "--data", str(tmp_path / "calib.npz"), "--eval-data",
                 str(tmp_path / "eval.npz"), "--metric", "x.py:f"]) == 2  # --metric without --min-metric


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_the_command_line_tunes_for_a_target_on_openvino(sparse_tail, target, tmp_path, capsys):
    """Both targets' files run on OpenVINO's CPU plugin: scored and timed there, the tail still the unit to float."""
    pytest.importorskip("openvino")
    from qdq.cli import main

    path, tail = sparse_tail
    np.savez(tmp_path / "calib.npz", images=np.concatenate([b["images"] for b in _data(4, 1)]))
    np.savez(tmp_path / "eval.npz", images=np.concatenate([b["images"] for b in _data(4, 2)]))
    code = main(["tune", "--model", str(path), "--data", str(tmp_path / "calib.npz"), "--eval-data",
                 str(tmp_path / "eval.npz"), "--min-sqnr", "25", "--calib", "max", "--target", target, "--runtime",
                 "openvino", "--out", str(tmp_path / "t.onnx"), "--report", str(tmp_path / "tune.md")])  # fmt: skip
    assert code == 0
    report = (tmp_path / "tune.md").read_text()
    assert report.startswith("# tune: output SQNR dB >= 25 on openvino") and "builds on openvino" in report
    chosen = next(line for line in report.splitlines() if "(chosen)" in line)
    assert "PASS" in chosen and tail in report
    assert re.search(r"\| 1 *\|[^\n]*PASS", report)  # one unit float meets the budget: the tail


def test_the_noisiest_unit_is_the_sparse_tail_when_candidates_are_limited(sparse_tail, tmp_path):
    path, tail = sparse_tail
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "t.onnx", budget=Budget.sqnr(25.0), method="max",
                      max_candidates=1, progress=False, rounds=1, iters=2)  # fmt: skip
    assert list(result.gains) == [(tail,)]
    assert result.chosen is not None and result.chosen.floated == ((tail,),)


def test_the_choice_prefers_fewer_float_units_when_as_fast_within_the_spread():
    """Confirmed timings (median, 25th, 75th percentile): the fastest has three units float; a one-unit
    configuration whose 25th percentile is below the fastest's 75th is as fast within the spread and is chosen; a
    one-unit configuration clearly slower, and a faster one that misses the budget, are not."""
    from qdq.tuning.result import Trial
    from qdq.tuning.timing import choose

    budget = Budget.sqnr(10.0)
    fastest = Trial("top 3", (("a",), ("b",), ("c",)), 20.0, 20.0, ms=9.0, confirmed=(10.0, 9.0, 11.0))
    level = Trial("prune 1", (("a",),), 20.0, 20.0, ms=10.0, confirmed=(10.5, 10.8, 12.0))
    slower = Trial("prune 2", (("b",),), 20.0, 20.0, ms=10.0, confirmed=(15.0, 14.0, 16.0))
    missing = Trial("greedy 1", (), 5.0, None, ms=5.0, confirmed=(5.0, 4.0, 6.0))
    trials = [missing, fastest, slower, level]
    assert choose(trials, budget) is level
    level.confirmed = (12.0, 11.5, 13.0)  # no longer level with the fastest
    assert choose(trials, budget) is fastest


class _SimulatedGpu(OrtRuntime):
    """ONNX Runtime's numbers on a modelled clock: each Conv/Gemm costs 0.5 ms on int8 inputs, 2 ms on float ones
    (a stand-in for an engine that keeps its own time: the latencies tune reports must be this runtime's clock's,
    whatever else the host is doing)."""

    name = "simulated_gpu"
    INT8_MS, FLOAT_MS = 0.5, 2.0

    def time_ms(self, call):
        call()
        return self.modelled_ms

    @functools.cached_property
    def modelled_ms(self):
        graph = onnx.load(str(self.path)).graph
        dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
        layers = [n for n in graph.node if n.op_type in ("Conv", "Gemm")]
        return sum(self.INT8_MS if n.input[0] in dequantized else self.FLOAT_MS for n in layers)


@pytest.fixture
def simulated_gpu_target():
    """A TensorRT-placed target whose native runtime is the simulated GPU, registered for the test only."""
    register_runtime("simulated_gpu", _SimulatedGpu)
    try:
        yield dataclasses.replace(TENSORRT, name="tensorrt_sim", runtimes=(RuntimeSupport("simulated_gpu", "native"),))
    finally:
        unregister_runtime("simulated_gpu")


def test_a_tensorrt_placement_is_tuned_on_its_own_runtime_with_an_fp16_float_part(sparse_tail, simulated_gpu_target,
                                                                                  tmp_path):  # fmt: skip
    path, tail = sparse_tail
    result = qdq.tune(path, _data(4, 1), _data(4, 2), tmp_path / "tuned.onnx", budget=Budget.sqnr(25.0),
                      target=simulated_gpu_target, method="max", progress=False, rounds=3, iters=3,
                      target_options={"float": "float16"})  # fmt: skip
    assert result.runtime == "simulated_gpu"
    assert not result.int8.meets(result.budget) and result.chosen is not None
    assert result.chosen.floated == ((tail,),)
    graph = onnx.load(str(result.path)).graph
    assert tail not in {n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in graph.initializer)  # the float part is FP16
    # the modelled clock, not ONNX Runtime's: the tail float turns one int8 conv into a float one (+1.5 ms)
    added = _SimulatedGpu.FLOAT_MS - _SimulatedGpu.INT8_MS
    assert result.chosen.latency - result.int8.latency == pytest.approx(added)
    assert result.unit_ms[(tail,)][0] == pytest.approx(added)
    assert result.builds >= len(result.trials) and "builds on simulated_gpu" in result.report()


def test_a_runtime_the_target_refuses_or_that_is_missing_is_one_clear_error(sparse_tail, tmp_path):
    path, _ = sparse_tail
    with pytest.raises(qdq.QdqConfigError, match="does not run on 'tensorrt': TensorRT builds signed int8"):
        qdq.tune(path, _data(2, 1), _data(2, 2), tmp_path / "t.onnx", budget=Budget.sqnr(20.0), runtime="tensorrt")
    register_runtime(Backend("absent_gpu", _SimulatedGpu, package="qdq_no_such_package", install="pip install x"))
    try:
        target = dataclasses.replace(TENSORRT, name="absent", runtimes=(RuntimeSupport("absent_gpu", "native"),))
        with pytest.raises(qdq.QdqConfigError, match="'absent_gpu', which is not installed here: pip install x"):
            qdq.tune(path, _data(2, 1), _data(2, 2), tmp_path / "t.onnx", budget=Budget.sqnr(20.0), target=target)
    finally:
        unregister_runtime("absent_gpu")


def test_the_runtimes_warnings_are_said_once_per_kind_without_the_files_name():
    """A runtime's warning about a file carries its kind and the file's name as data: loading tens of the search's
    files says each kind once, as the first file's message without that file's (temporary) name."""
    import warnings

    from qdq.errors import QdqRuntimeWarning
    from qdq.runtime import get_backend
    from qdq.targets import ONNXRUNTIME
    from qdq.tuning.engine import Engine

    engine = Engine(ONNXRUNTIME, get_backend("onnxruntime"), None, {})
    with pytest.warns(UserWarning) as said:
        for number, count in ((0, 3), (1, 4)):
            with engine.once():
                name = f"config_{number}.onnx"
                message = QdqRuntimeWarning(f"{name}: {count} weight(s) run in float", file=name, kind="float")
                warnings.warn(message, stacklevel=1)
                warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in said] == ["tune: 3 weight(s) run in float", "tune: another warning"]


def test_the_stem_auto_left_float_stays_float_in_every_later_file(tmp_path, monkeypatch):
    """The plain INT8 file's calibration (auto) keeps the stem float where int8 loses the input's quiet channel;
    every later configuration keeps it float too and reuses that calibration (none calibrates again)."""
    from qdq.tuning import evaluation

    from .workflow.test_stem import _export, _QuietInput, _signals

    torch.manual_seed(0)
    path = _export(_QuietInput(0.01), tmp_path / "quiet.onnx", (2, 2, 32))
    calls = []
    real = evaluation.quantize_onnx

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append((list(kwargs.get("keep_float", ())), result.auto))
        return result

    monkeypatch.setattr(evaluation, "quantize_onnx", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdq.tune(path, _signals(0.01), _signals(0.01, count=4, seed=2), tmp_path / "t.onnx",
                 budget=Budget.sqnr(200.0), method="auto", progress=False, rounds=1, iters=2, max_steps=1,
                 max_candidates=2)  # fmt: skip
    stem = calls[0][1].stem.ops
    assert stem and len(calls) > 1
    assert all(set(stem) <= set(keep) and auto is None for keep, auto in calls[1:])


def test_tune_calibrates_with_the_same_default_as_quantize_onnx_in_the_api_and_the_cli():
    """One default in every door (issue 43): tune's one calibration is quantize_onnx's own default method."""
    import inspect

    from qdq.cli import build_parser

    default = inspect.signature(qdq.quantize_onnx).parameters["method"].default
    assert inspect.signature(qdq.tune).parameters["method"].default == default == "auto"
    args = build_parser().parse_args(["tune", "--model", "m.onnx", "--data", "c.npz", "--eval-data", "e.npz",
                                      "--min-sqnr", "30"])  # fmt: skip
    assert args.calib == default

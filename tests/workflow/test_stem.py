"""The stem left float where int8 there costs more than it is worth: the levels of a generated graph, the choice
against hand-built scores, and through the ONNX door a model whose input int8 cannot hold (known by construction)
against the same model on data it can."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from unittest.mock import patch

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import qdq
from qdq.onnx_in.prepared import PreparedModel
from qdq.runtime.backend import get_backend
from qdq.runtime.benchmark import Comparison
from qdq.targets import resolve_target
from qdq.workflow.auto_calibration import select_amax
from qdq.workflow.fidelity import FidelityMeter
from qdq.workflow.stem import STEM_COST_DB, STEM_SLOWDOWN_MS, StemTiming, choose_stem, stem_levels

from .test_refinement import _meter


class _Branchy(nn.Module):
    """Two convs read the input (level 0); one reads the first (level 1); the last reads level 1 and level 0 added
    (level 2: the longest path)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.c, self.d = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.a(x)))) + self.b(x))


def _export(model: nn.Module, path, shape) -> str:
    torch.onnx.export(model.eval(), torch.zeros(*shape), path, input_names=["x"], output_names=["y"], opset_version=17,
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, dynamo=False)  # fmt: skip
    return str(path)


def test_levels_group_the_int8_weighted_ops_by_the_longest_path_from_the_inputs(tmp_path):
    torch.manual_seed(0)
    path = _export(_Branchy(), tmp_path / "branchy.onnx", (2, 3, 8, 8))
    view = PreparedModel.load(path).view(resolve_target("onnxruntime"))
    convs = {op.name: op for op in view.ops_of("Conv")}
    by_weight = {op.inputs[1].name.split(".")[0]: name for name, op in convs.items()}
    with patch.multiple("qdq.workflow.stem", STEM_SHARE=1.0, STEM_OPS_SHARE=1.0):
        levels = stem_levels(view)
        assert [sorted(level) for level in levels] == [sorted([by_weight["a"], by_weight["b"]]), [by_weight["c"]],
                                                       [by_weight["d"]]]  # fmt: skip
        assert stem_levels(view, limit=1) == levels[:1]
    with patch.multiple("qdq.workflow.stem", STEM_SHARE=1.0, STEM_OPS_SHARE=0.75):  # 3 of the 4 ops: not 4
        assert stem_levels(view) == levels[:2]
    with patch.multiple("qdq.workflow.stem", STEM_SHARE=1.0, STEM_OPS_SHARE=0.25):  # level 0 alone holds 2 of 4
        assert stem_levels(view) == []
    assert stem_levels(view) == levels[:1]  # half of its depth (3 weighted ops deep), half of its 4 ops
    kept = PreparedModel.load(path).view(resolve_target("onnxruntime"), keep_float=[by_weight["a"]])
    with patch.multiple("qdq.workflow.stem", STEM_SHARE=1.0, STEM_OPS_SHARE=1.0):
        assert stem_levels(kept)[0] == [by_weight["b"]]  # a float op is no level's


class _Chain(nn.Module):
    """``n`` convs in a row: ``n`` weighted ops deep."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


def test_a_later_op_the_user_keeps_float_does_not_shrink_the_stem(tmp_path):
    path = _export(_Chain(), tmp_path / "chain.onnx", (2, 3, 8, 8))
    view = PreparedModel.load(path).view(resolve_target("onnxruntime"))
    order = [op.name for op in view.ops_of("Conv")]
    assert stem_levels(view) == [[order[0]], [order[1]], [order[2]]]  # three levels at most (half of eight deep: 4)
    kept = PreparedModel.load(path).view(resolve_target("onnxruntime"), keep_float=[order[6]])
    assert stem_levels(kept) == [[order[0]], [order[1]], [order[2]]]  # three of the seven int8 ops: within half
    shallow = PreparedModel.load(_export(_Chain(5), tmp_path / "five.onnx", (2, 3, 8, 8)))
    names = [op.name for op in shallow.view(resolve_target("onnxruntime")).ops_of("Conv")]
    assert stem_levels(shallow.view(resolve_target("onnxruntime"))) == [[names[0]], [names[1]]]  # half of 5 deep: 2


def _scores(gains: dict[int, float], second: dict[int, float] | None = None, calls: list | None = None):
    """Each half scores 20 dB plus the gain of the number of levels left float (0 for one not listed)."""

    def score(ops, half):
        n = {0: 0, 1: 1, 3: 2, 4: 3}[len(ops)]  # levels of 1, 2 and 1 ops
        if calls is not None:
            calls.append((n, half))
        table = second if half == 1 and second is not None else gains
        return _meter(20 + table.get(n, 0.0))

    return score


LEVELS = [["a"], ["b", "c"], ["d"]]


def test_the_levels_kept_pay_their_cost_on_the_whole_and_each_half():
    below = choose_stem(LEVELS, _scores({1: 0.9 * STEM_COST_DB, 2: 1.9 * STEM_COST_DB, 3: 2.9 * STEM_COST_DB}))
    assert below.levels == 0 and below.ops == [] and below.gain_db == 0.0
    assert set(below.scores) == {0, 1, 2, 3} and "stem int8" in below.summary()
    # one level alone loses (its neighbours' quantizers move), three together gain: the levels are tried together;
    # a trial whose first half gains less than its cost does not run the second
    calls: list = []
    together = choose_stem(LEVELS, _scores({1: -2.0, 2: 0.9, 3: 6.0}, calls=calls))
    assert calls == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1)]
    assert np.isnan(together.scores[1]) and "—" in together.table()
    assert together.levels == 3 and together.ops == ["a", "b", "c", "d"]
    assert together.gain_db == pytest.approx(6.0) and together.half_gains[3] == pytest.approx((6.0, 6.0))
    assert "+6.0 dB" in together.summary() and "| 3 " in together.table()
    # the most net of cost wins: 2 levels at +4 (net 3) over 3 at +4.2 (net 2.7)
    assert choose_stem(LEVELS, _scores({1: 0.2, 2: 4.0, 3: 4.2})).levels == 2
    # a gain one half carries and the other does not is the samples', not the model's
    assert choose_stem(LEVELS, _scores({3: 6.0}, second={3: 0.4 * 3 * STEM_COST_DB})).levels == 0


def _timing(int8_ms: float, ratios: list[float]) -> StemTiming:
    return StemTiming("onnxruntime", tuple(int8_ms for _ in ratios), tuple(int8_ms * r for r in ratios))


def test_a_stem_kept_pays_for_the_time_its_file_takes_at_the_stated_rate():
    gains = {1: 0.2, 2: 4.0, 3: 4.2}  # 2 levels win on the scores: +4.0 dB, 3.0 net of their cost
    asked: list = []

    def timer(ops):
        asked.append(list(ops))
        return _timing(50.0, [1.5, 1.48, 1.51])  # 50 % more time: 20 log10(1.5) = 3.5 dB

    slow = choose_stem(LEVELS, _scores(gains), timer)
    assert asked == [["a", "b", "c"]]  # timed once: the levels the scores chose
    assert slow.levels == 0 and slow.ops == [] and slow.dropped == 2 and slow.gain_db == 0.0
    assert slow.timing.slowdown == pytest.approx(0.5) and slow.timing.cost_db == pytest.approx(20 * np.log10(1.5))
    assert "gained +4.0 dB but ran +50% time on onnxruntime, which costs 3.5 dB" in slow.summary()
    assert "dropped: slower" in slow.table()
    assert "| 2 " in slow.table().split("dropped: slower")[0].splitlines()[-1]  # on the row of the levels dropped
    # 20 % more time costs 1.6 dB: the 3 dB net still pays; under a millisecond, or faster, costs nothing
    paid = choose_stem(LEVELS, _scores(gains), lambda ops: _timing(50.0, [1.2, 1.2, 1.2]))
    tiny = choose_stem(LEVELS, _scores(gains), lambda ops: _timing(0.5 * STEM_SLOWDOWN_MS, [1.9, 1.9, 1.9]))
    faster = choose_stem(LEVELS, _scores(gains), lambda ops: _timing(50.0, [0.9, 0.9, 0.9]))
    untimed = choose_stem(LEVELS, _scores(gains), lambda ops: None)
    for kept in (paid, tiny, faster, untimed):
        assert kept.levels == 2 and kept.dropped == 0
    assert "+20% time" in paid.summary() and tiny.timing.cost_db == 0.0 and faster.timing.cost_db == 0.0
    assert "dropped: slower" not in paid.table()  # kept and timed: no row says dropped
    assert untimed.timing is None
    # nothing chosen: nothing timed
    assert choose_stem(LEVELS, _scores({3: 0.1}), lambda ops: asked.append(ops)).levels == 0 and len(asked) == 1


def test_nothing_is_tried_without_halves_or_levels():
    assert choose_stem(LEVELS, None).skipped and "not tried" in choose_stem(LEVELS, None).summary()
    assert choose_stem([], lambda ops, half: FidelityMeter()).skipped == "no int8 weighted op"


#: convs after the stem: each quantized op then carries a small share of the output's error (the stem's would not
#: pay its cost), unless its input is one int8 cannot hold
BODY = 12


class _QuietInput(nn.Module):
    """The stem scales its two input channels, of sizes ``LOUD`` and ``quiet``, to one size; a quiet channel of 0.01
    next to a loud one of 100 is below one int8 step of the input, so only a float stem keeps it."""

    def __init__(self, quiet: float) -> None:
        super().__init__()
        self.stem = nn.Conv1d(2, 2, 1, bias=False)
        self.body = nn.Sequential(nn.ReLU(), *[layer for _ in range(BODY) for layer in (nn.Conv1d(2, 2, 1), nn.ReLU())])
        with torch.no_grad():
            self.stem.weight.copy_(torch.diag(torch.tensor([1 / LOUD, 1 / quiet]))[:, :, None])
            for conv in self.body[1::2]:  # near the identity: both channels reach the output
                conv.weight.copy_(torch.eye(2)[:, :, None] + 0.1 * torch.rand(2, 2, 1))
                conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.stem(x))


LOUD = 100.0


def _signals(quiet: float, count: int = 8, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    scale = np.array([[LOUD], [quiet]], np.float32)
    return [{"x": (rng.uniform(-1, 1, size=(16, 2, 32)) * scale).astype(np.float32)} for _ in range(count)]


def _sqnr(path, float_path, feeds) -> float:
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (path, float_path)]
    out, ref = (np.concatenate([r.run(None, f)[0] for f in feeds]) for r in runs)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((out - ref) ** 2)))


@pytest.mark.parametrize("quiet", [0.01, LOUD])
def test_auto_keeps_the_stem_float_only_where_int8_cannot_hold_its_input(tmp_path, quiet):
    torch.manual_seed(0)
    float_path = _export(_QuietInput(quiet), tmp_path / "quiet.onnx", (2, 2, 32))
    stem = next(n.name for n in onnx.load(float_path).graph.node if n.op_type == "Conv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qdq.quantize_onnx(float_path, _signals(quiet), tmp_path / "q.onnx", target="onnxruntime",
                                   progress=False)  # fmt: skip
        qdq.quantize_onnx(float_path, _signals(quiet), tmp_path / "int8.onnx", target="onnxruntime", method="max",
                          progress=False)  # fmt: skip
        qdq.quantize_onnx(float_path, _signals(quiet), tmp_path / "forced.onnx", target="onnxruntime",
                                   progress=False, keep_float=[stem])  # fmt: skip
    choice = result.auto.stem
    unseen = _signals(quiet, count=2, seed=1)
    if quiet < 1:  # the quiet channel is lost to the input's step: the stem float gains tens of dB
        assert choice.levels >= 1 and stem in choice.ops and stem in result.float_ops
        assert "stem" in result.float_ops[stem] and choice.gain_db > 10
        kept = _sqnr(tmp_path / "q.onnx", float_path, unseen)
        assert kept >= _sqnr(tmp_path / "forced.onnx", float_path, unseen) - 1.0
        assert kept > 20 + _sqnr(tmp_path / "int8.onnx", float_path, unseen)  # max: one method, the stem int8
    else:  # both channels of one size: int8 holds the input, the stem's float ops would not pay
        assert choice.levels == 0 and stem not in result.float_ops
    assert "stem" in result.auto.summary() and "levels float" in result.auto.table()


@pytest.mark.parametrize("ratio", [100.0, 1.0])
def test_the_onnx_door_times_the_stem_it_keeps_on_the_targets_runtime(tmp_path, ratio):
    """The quiet-input model keeps its stem float on the scores (tens of dB); timed 100 times slower, more than that
    gain pays for (40 dB), the file is all int8."""
    torch.manual_seed(0)
    float_path = _export(_QuietInput(0.01), tmp_path / "quiet.onnx", (2, 2, 32))
    stem = next(n.name for n in onnx.load(float_path).graph.node if n.op_type == "Conv")
    timed: list = []

    def compare(models, runtime, **options):  # the same files, timed by a clock this test sets
        timed.append((sorted(models), runtime, options["inputs"]["x"].shape))
        assert all(onnx.load(str(path)).graph.node for path in models.values())  # written, as the target finishes
        return Comparison(runtime, 1, None, 5, "int8", {"int8": (10.0,) * 3, "stem": (10.0 * ratio,) * 3})

    benchmark = importlib.import_module("qdq.runtime.benchmark")  # also the name of a function of qdq.runtime
    with warnings.catch_warnings(), patch.object(benchmark, "compare_models", compare):
        warnings.simplefilter("ignore")
        result = qdq.quantize_onnx(float_path, _signals(0.01), tmp_path / "q.onnx", target="onnxruntime",
                                   progress=False)  # fmt: skip
        untimed = qdq.quantize_onnx(float_path, _signals(0.01), tmp_path / "t.onnx", target="tensorrt",
                                    progress=False)  # fmt: skip
    choice = result.auto.stem
    assert timed[0][:2] == (["int8", "stem"], "onnxruntime") and len(timed) == 1  # TensorRT's is not timed here
    assert timed[0][2] == (1, 2, 32)  # one sample: latency, as a deployed model runs
    assert choice.timing is not None and choice.timing.slowdown == pytest.approx(ratio - 1)
    assert untimed.auto.stem.levels >= 1 and untimed.auto.stem.timing is None
    assert get_backend("tensorrt").compiles and not get_backend("onnxruntime").compiles  # engines are not built here
    if ratio > 1:
        assert choice.levels == 0 and choice.dropped >= 1 and stem not in result.float_ops
        assert "but ran +9900% time on onnxruntime" in result.auto.summary()
        graph = onnx.load(str(tmp_path / "q.onnx")).graph
        producers = {out: node.op_type for node in graph.node for out in node.output}
        assert all(producers.get(n.input[0]) == "DequantizeLinear" for n in graph.node if n.op_type == "Conv")
    else:
        assert choice.levels >= 1 and stem in result.float_ops


@pytest.mark.parametrize("quiet", [0.01, LOUD])
def test_the_pytorch_door_disables_the_stem_quantizers_only_where_int8_cannot_hold_its_input(quiet):
    torch.manual_seed(0)
    float_model = _QuietInput(quiet).eval()
    model = qdq.quantize_model(_QuietInput(quiet).eval(), qdq.QuantConfig(target="onnxruntime"))
    model.load_state_dict(float_model.state_dict(), strict=False)
    data = [torch.from_numpy(b["x"]) for b in _signals(quiet)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = select_amax(model, data, progress=False)
    stem = dict(model.named_modules())["stem"]
    unseen = torch.from_numpy(_signals(quiet, count=1, seed=1)[0]["x"])
    with torch.no_grad():
        ref, out = float_model(unseen), model(unseen)
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum()))
    if quiet < 1:
        assert result.stem.ops == ["stem"] and result.stem.gain_db > 10
        assert not stem._input_quantizer.is_quantizing and not stem._weight_quantizer.is_quantizing
        assert sqnr > 30
    else:
        assert result.stem.levels == 0 and stem._input_quantizer.is_quantizing and stem._weight_quantizer.is_quantizing


@pytest.mark.parametrize("ratio", [100.0, 1.0])
def test_the_pytorch_door_times_the_stem_it_keeps_as_the_onnx_door_does(ratio):
    """The quiet-input model in the PyTorch door: its stem's gain (tens of dB) pays for the same time, not for a file
    100 times slower; the two files are the model exported for its target with the stem's quantizers off and on."""
    torch.manual_seed(0)
    float_model = _QuietInput(0.01).eval()
    data = [torch.from_numpy(b["x"]) for b in _signals(0.01)]
    timed: list = []

    def compare(models, runtime, **options):
        graphs = {label: onnx.load(str(path)).graph for label, path in models.items()}
        timed.append((sorted(models), runtime, {label: _reads_dequantized(g) for label, g in graphs.items()}))
        return Comparison(runtime, 1, None, 3, "int8", {"int8": (10.0,) * 3, "stem": (10.0 * ratio,) * 3})

    results = {}
    benchmark = importlib.import_module("qdq.runtime.benchmark")  # also the name of a function of qdq.runtime
    with warnings.catch_warnings(), patch.object(benchmark, "compare_models", compare):
        warnings.simplefilter("ignore")
        for target in ("onnxruntime", "tensorrt"):
            model = qdq.quantize_model(_QuietInput(0.01).eval(), qdq.QuantConfig(target=target))
            model.load_state_dict(float_model.state_dict(), strict=False)
            results[target] = (model, select_amax(model, data, progress=False))
    assert len(timed) == 1 and timed[0][:2] == (["int8", "stem"], "onnxruntime")  # TensorRT builds engines: untimed
    assert timed[0][2] == {"int8": 1 + BODY, "stem": BODY}  # convs reading a DequantizeLinear: the stem's is float
    model, result = results["onnxruntime"]
    stem = dict(model.named_modules())["stem"]
    assert result.stem.timing is not None and result.stem.timing.slowdown == pytest.approx(ratio - 1)
    assert results["tensorrt"][1].stem.timing is None and results["tensorrt"][1].stem.ops == ["stem"]
    if ratio > 1:
        assert result.stem.levels == 0 and result.stem.dropped >= 1 and stem._input_quantizer.is_quantizing
    else:
        assert result.stem.ops == ["stem"] and not stem._input_quantizer.is_quantizing


def test_a_model_that_does_not_export_keeps_the_stem_its_scores_chose():
    torch.manual_seed(0)
    float_model = _QuietInput(0.01).eval()
    model = qdq.quantize_model(_QuietInput(0.01).eval(), qdq.QuantConfig(target="onnxruntime"))
    model.load_state_dict(float_model.state_dict(), strict=False)
    data = [torch.from_numpy(b["x"]) for b in _signals(0.01)]

    def refuse(*args, **kwargs):
        raise RuntimeError("this model does not export")

    with warnings.catch_warnings(), patch("qdq.export.onnx_export.export_onnx", refuse):
        warnings.simplefilter("ignore")
        result = select_amax(model, data, progress=False)
    assert result.stem.ops == ["stem"] and result.stem.timing is None
    assert not dict(model.named_modules())["stem"]._input_quantizer.is_quantizing
    assert all(q.is_enabled for name, q in model.named_modules() if name.endswith("_quantizer") and "stem" not in name)


def _reads_dequantized(graph) -> int:
    """How many convs of ``graph`` read their data input from a DequantizeLinear."""
    producers = {out: node.op_type for node in graph.node for out in node.output}
    return sum(producers.get(n.input[0]) == "DequantizeLinear" for n in graph.node if n.op_type == "Conv")


def test_a_stem_trial_leaves_float_what_calibration_never_reached(tmp_path):
    """silero-vad's family: the network inside an If whose else branch no batch takes. Its quantizers were dropped
    after calibration (never reached); a trial placement asks for them again and must drop them too, not give up."""
    from ..onnx_in.test_families import batches, if_with_weights

    if_with_weights(tmp_path / "if.onnx")
    feeds = [{**b, "cond": np.array(True)} for b in batches((4, 3, 8, 8), name="x", count=8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qdq.quantize_onnx(tmp_path / "if.onnx", feeds, tmp_path / "q.onnx", target="onnxruntime",
                                   progress=False)  # fmt: skip
    stem = result.auto.stem
    assert stem.tried >= 1 and not stem.skipped
    assert all(np.isfinite(gains[0]) for gains in stem.half_gains.values())  # every trial scored


class _DataDependent(nn.Module):
    """A forward torch.fx cannot trace (a branch on the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if x.sum() > 0 else self.conv(-x)


def test_the_pytorch_door_says_why_a_model_it_cannot_trace_keeps_its_stem():
    model = qdq.quantize_model(_DataDependent().eval())
    data = [torch.from_numpy(b["x"]) for b in _signals(LOUD)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = select_amax(model, data, progress=False)
    assert "torch.fx cannot trace" in result.stem.skipped and result.stem.levels == 0
    assert model.conv._input_quantizer.is_quantizing and model.conv._weight_quantizer.is_quantizing


@pytest.mark.parametrize("order", [("auto", "max"), ("max", "auto")])
def test_ptq_keeps_the_stem_auto_left_float_only_where_auto_wins(order):
    """``ptq`` with ``auto`` among its methods: the stem auto disables stays disabled only where auto's row wins;
    the methods scored after it, and the model returned when another wins, quantize the stem as given."""
    torch.manual_seed(0)
    float_model = _QuietInput(0.01).eval()
    model = qdq.quantize_model(_QuietInput(0.01).eval(), qdq.QuantConfig(target="onnxruntime"))
    model.load_state_dict(float_model.state_dict(), strict=False)
    data = [torch.from_numpy(b["x"]) for b in _signals(0.01)]
    stem = dict(model.named_modules())["stem"]
    seen: list[bool] = []

    def last_wins(scored) -> float:  # each call scores higher: the grid's last method wins
        seen.append(stem._input_quantizer.is_enabled)
        return float(len(seen))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qdq.ptq(model, data, last_wins, methods=list(order), progress=False)
    assert result.best.method == order[-1]
    assert seen[1:] == [name != "auto" for name in order]  # auto scored with its stem float, max with it int8
    assert stem._input_quantizer.is_enabled == (order[-1] != "auto")
    assert stem._weight_quantizer.is_enabled == (order[-1] != "auto")


def test_both_files_are_timed_on_one_thread(monkeypatch):
    """A pool of threads on a small machine stalls at random (benchmarks/RESULTS.md, zoo_draws): a ratio is priced."""
    from types import SimpleNamespace

    benchmark = importlib.import_module("qdq.runtime.benchmark")  # the package exports a function of that name
    seen = {}

    def compare(models, runtime, **options):
        seen.update(options)
        return SimpleNamespace(block_ms={"int8": (2.0, 2.0, 2.0), "stem": (2.2, 2.4, 2.3)})

    monkeypatch.setattr(benchmark, "compare_models", compare)
    timing = StemTiming.measure(Path("int8.onnx"), Path("stem.onnx"), "onnxruntime")
    assert seen["threads"] == 1
    assert timing.slowdown == pytest.approx(0.15)

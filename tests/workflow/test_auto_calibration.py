"""method="auto": each quantizer's range by its layer's output error, against a numpy oracle of that error."""

import warnings
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import profile

import qdq
from detector_sample import detector_values, tail_signal_data
from qdq.calib import HistogramCalibrator
from qdq.errors import QdqCalibrationWarning, QdqConfigError
from qdq.nn import QuantAdd, QuantConcat, QuantLinear, QuantMatMul
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer
from qdq.workflow.auto_calibration import CANDIDATES, SCORE_FRACTION, select_amax
from qdq.workflow.calibration import calibrate, collect_stats, method_label, named_quantizers
from qdq.workflow.diagnostics import calibration_report
from qdq.workflow.post_training import ptq
from reference import fake_quant_np


class Head(nn.Module):
    """The detector's last layer: a 1x1 convolution 16 -> 2 on a post-ReLU activation."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        return self.conv(x)


def _detector_batches(batches=4, seed=0):
    values = torch.from_numpy(detector_values(batches * 8 * 16 * 64, seed=seed))
    return list(values.reshape(batches, 8, 16, 8, 8))


def _candidate_ranges(values: np.ndarray) -> dict[str, float]:
    """Each candidate's range from a fresh histogram of the values (the statistics auto starts from)."""
    cal = HistogramCalibrator()
    cal.collect(torch.from_numpy(values))
    return {method_label(m, o): float(cal.compute_amax(m, **o)) for m, o in CANDIDATES}


def test_auto_keeps_the_detector_tail_and_matches_a_numpy_oracle():
    """On the shipped detector activation (entropy 0.165 against a max of 2.1), auto picks the candidate whose
    quantized 1x1 conv output (weights per-channel max, as exported) is closest to the float output, computed
    here in float64 numpy on the scored samples (the first SCORE_FRACTION of each batch; the ranges come from all
    of them); it keeps the tail (>= 90 % of the max)."""
    torch.manual_seed(3)
    model = qdq.quantize_model(Head())
    batches = _detector_batches()
    collect_stats(model, batches, calibrator="histogram", progress=False)
    result = select_amax(model, batches, progress=False)
    choice = result.choices[0]
    assert choice.quantizer == "conv._input_quantizer" and choice.layer == "conv"

    scored = int(8 * SCORE_FRACTION)  # of each batch of 8
    assert result.batches == len(batches) and result.samples == scored * len(batches) < 8 * len(batches)
    x = np.stack([b[:scored].numpy() for b in batches]).astype(np.float64)  # (B, N, C, H, W)
    w = model.conv.weight.detach().numpy()[:, :, 0, 0]
    w_q = fake_quant_np(w, np.abs(w).max(axis=1, keepdims=True)).astype(np.float64)
    bias = model.conv.bias.detach().numpy().astype(np.float64)[None, :, None, None]
    ref = np.einsum("oc,bnchw->bnohw", w.astype(np.float64), x) + bias
    ranges = _candidate_ranges(np.stack([b.numpy() for b in batches]).reshape(-1))
    oracle = {}
    for label, amax in ranges.items():
        x_q = fake_quant_np(x.astype(np.float32), np.float32(amax)).astype(np.float64)
        out = np.einsum("oc,bnchw->bnohw", w_q, x_q) + bias
        oracle[label] = ((out - ref) ** 2).sum() / (ref**2).sum()
    assert set(choice.error) <= set(oracle)
    for label, error in choice.error.items():
        assert error == pytest.approx(oracle[label], rel=2e-3), label
    best = min(oracle, key=oracle.get)
    assert oracle[choice.chosen] <= oracle[best] * 1.001
    data_max = ranges["max"]
    assert choice.amax[choice.chosen] >= 0.9 * data_max
    assert choice.error["entropy"] > 100 * choice.error[choice.chosen]  # entropy's cut destroys the output
    assert model.conv.input_quantizer.amax_method == f"auto: {choice.chosen}"
    assert float(model.conv.input_quantizer.amax) == pytest.approx(choice.amax[choice.chosen])


class Mixed(nn.Module):
    """Each kind of quantizer owner: a Linear, an add, a matmul (two quantized inputs), a concat, a standalone
    quantizer (as placement adds)."""

    def __init__(self):
        super().__init__()
        self.fc = QuantLinear(8, 8)
        self.add = QuantAdd()
        self.matmul = QuantMatMul()
        self.cat = QuantConcat(dim=1)
        self.out_quantizer = TensorQuantizer()

    def forward(self, x):
        y = torch.relu(self.fc(x))
        z = self.add(y, x)
        m = self.matmul(z, z.transpose(0, 1))
        return self.out_quantizer(self.cat([m, z]))


def _heavy_batches(n=3, rows=16):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(rows, 8, generator=gen) * torch.rand(rows, 8, generator=gen).pow(6) * 4 for _ in range(n)]


def test_each_quantizer_is_compared_at_the_module_that_owns_it():
    model = Mixed()
    batches = _heavy_batches()
    collect_stats(model, batches, calibrator="histogram", progress=False)
    result = select_amax(model, batches, progress=False)
    layers = {c.quantizer: c.layer for c in result.choices}
    assert layers == {
        "fc._input_quantizer": "fc",
        "add.input_quantizers.0": "add",
        "add.input_quantizers.1": "add",
        "matmul.input_quantizers.0": "matmul",
        "matmul.input_quantizers.1": "matmul",
        "cat.input_quantizer": "cat",
        "out_quantizer": "out_quantizer",
    }
    assert result.batches == len(batches)
    assert result.layer_runs == len(batches) * sum(len(c.error) for c in result.choices)
    groups: dict[tuple, list] = {}  # quantizers reading one tensor: equal candidate ranges
    for choice in result.choices:
        groups.setdefault(tuple(choice.amax.items()), []).append(choice)
    # from Mixed.forward: fc and the add's second operand read x; the matmul reads z twice; out_quantizer reads
    # the concat's output, which (quantizers off while collecting) is what the concat's quantizer reads
    assert sorted(sorted(c.quantizer for c in group) for group in groups.values() if len(group) > 1) == [
        ["add.input_quantizers.1", "fc._input_quantizer"],
        ["cat.input_quantizer", "out_quantizer"],
        ["matmul.input_quantizers.0", "matmul.input_quantizers.1"],
    ]
    for group in groups.values():  # one choice per tensor: the smallest error summed over its readers
        assert len({c.chosen for c in group}) == 1
        if group[0].error:  # one candidate left after merging: nothing to compare
            total = {label: sum(c.error[label] for c in group) for label in group[0].error}
            assert total[group[0].chosen] == min(total.values())
    assert "compared at" in result.table() and sum(result.counts().values()) == 7


def test_each_layer_is_compared_on_its_quantized_input():
    """The comparison runs in the model's order on the activations quantized so far: the add's second operand
    (the model input) is tuned with the first operand as the quantized model computes it (``fc`` at its chosen
    range, weights quantized) and quantized by the add's first input quantizer at its range; the reference is
    the float add of the same operands: oracle in numpy on one scored batch."""
    model = Mixed()
    batches = _heavy_batches()
    collect_stats(model, batches, calibrator="histogram", progress=False)
    result = select_amax(model, batches, num_batches=1, score_fraction=1.0, progress=False)
    choice = next(c for c in result.choices if c.quantizer == "add.input_quantizers.1")
    x = batches[0].numpy()
    with torch.no_grad():
        y = torch.relu(model.fc(batches[0])).numpy()  # fc quantized at the chosen range
    first = float(model.add.input_quantizers[0].amax)
    y_q = fake_quant_np(y, np.float32(first)).astype(np.float64)
    total = y.astype(np.float64) + x.astype(np.float64)  # the float add of what reaches it
    assert len(choice.error) > 1
    for label, amax in _candidate_ranges(np.concatenate([b.numpy() for b in batches]).reshape(-1)).items():
        if label in choice.error:
            out = y_q + fake_quant_np(x, np.float32(amax)).astype(np.float64)
            error = ((out - total) ** 2).sum() / (total**2).sum()
            assert choice.error[label] == pytest.approx(error, rel=1e-4), label


@pytest.mark.parametrize(
    ("sizes", "fraction", "scored"),
    [
        ([16] * 4, 0.25, [4, 4, 4, 4]),  # the first quarter of each batch
        ([1] * 8, 0.25, [1, 0, 0, 0, 1, 0, 0, 0]),  # batches of one: one batch in four, from the first
        ([10, 3, 7], 0.5, [5, 2, 3]),  # after n samples, ceil(n / 2) scored
        ([5, 5], 1.0, [5, 5]),
    ],
)
def test_the_pass_scores_the_first_samples_of_each_batch(sizes, fraction, scored):
    """``score_fraction``: after ``n`` samples ``ceil(n * fraction)`` were scored, the first of each batch; a batch
    with none to score does not run. Counted by the rows the layer sees; labels are cut alike. The model check
    runs the model three times (float, chosen, widest) on the same samples."""
    model = nn.Sequential(QuantLinear(8, 4))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 8, generator=gen), torch.zeros(n, dtype=torch.long)) for n in sizes]
    collect_stats(model, batches, calibrator="histogram", progress=False)
    ran = [n for n in scored if n]
    for check in (False, True):
        seen: list[int] = []
        handle = model[0].register_forward_pre_hook(lambda _, args, seen=seen: seen.append(len(args[0])))
        result = select_amax(model, batches, score_fraction=fraction, model_check=check, progress=False)
        handle.remove()
        assert seen == ran + ([n for n in ran for _ in range(3)] if check else [])
        assert result.samples == sum(scored) and result.batches == len(ran)
        assert bool(result.model_error) == check


def test_score_fraction_outside_zero_one_is_a_config_error():
    model = qdq.quantize_model(Head())
    batches = _detector_batches(2)
    collect_stats(model, batches, calibrator="histogram", progress=False)
    for bad in (0.0, 1.5):
        with pytest.raises(QdqConfigError, match="score_fraction"):
            select_amax(model, batches, score_fraction=bad, progress=False)


def test_weights_are_quantized_as_exported():
    """A 4-bit per-channel weight quantizer: the errors include its effect (the float output is the reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(QuantLinear(8, 4, quant_desc_weight=qdq.QuantDescriptor(num_bits=4, axis=0)))
    batches = _heavy_batches(2, rows=1024)
    collect_stats(model, batches, calibrator="histogram", progress=False)
    result = select_amax(model, batches, progress=False)
    w = model[0].weight.detach().numpy()
    w_q = fake_quant_np(w, np.abs(w).max(axis=1, keepdims=True), num_bits=4).astype(np.float64)
    x = np.concatenate([b[: int(len(b) * SCORE_FRACTION)].numpy() for b in batches])  # the samples scored
    bias = model[0].bias.detach().numpy().astype(np.float64)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    choice = result.choices[0]
    assert len(choice.error) > 1
    for label, error in choice.error.items():
        out = fake_quant_np(x, np.float32(choice.amax[label])).astype(np.float64) @ w_q.T + bias
        assert error == pytest.approx(((out - ref) ** 2).sum() / (ref**2).sum(), rel=1e-3), label


def _group_head(features=64, groups=4):
    """A head that tells which group of a sparse post-ReLU activation holds the largest value (group sums)."""
    head = nn.Linear(features, groups, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.repeat_interleave(torch.eye(groups), features // groups, dim=1))
    return nn.Sequential(nn.ReLU(), head)


def test_a_sparse_tail_that_carries_the_signal_entropy_collapses_auto_does_not():
    """Agreement with the float head's decisions (benchmarks/calibration_quality.py trains such a head)."""
    calib = [tail_signal_data(64, seed)[0] for seed in range(4)]
    x, _ = tail_signal_data(2000, 10)
    labels = _group_head()(x).argmax(1)
    accuracy = {}
    for method in ("entropy", "auto"):
        model = qdq.quantize_model(_group_head(), qdq.QuantConfig(quant_desc_weight=qdq.QuantDescriptor(axis=0)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            calibrate(model, calib, method=method, progress=False)
        accuracy[method] = float((model(x).argmax(1) == labels).float().mean())
        flagged = [w for w in caught if issubclass(w.category, QdqCalibrationWarning)]
        assert bool(flagged) == (method == "entropy")
    assert accuracy["entropy"] < 0.5 and accuracy["auto"] >= 0.99


def test_auto_needs_data_it_can_read_twice_and_says_so_first():
    model = qdq.quantize_model(Head())
    with pytest.raises(QdqConfigError, match=r"twice.*list of batches or a DataLoader"):
        calibrate(model, iter(_detector_batches(2)), method="auto", progress=False)
    assert all(q._calibrator is None for _, q in named_quantizers(model))  # nothing ran
    with pytest.raises(QdqConfigError, match="twice"):
        ptq(model, (b for b in _detector_batches(2)), lambda m: 0.0, ("max", "auto"), progress=False)


def test_ptq_with_auto_records_and_restores_each_quantizers_method():
    torch.manual_seed(0)
    model = qdq.quantize_model(Head())
    batches = _detector_batches(2)
    scores = iter([50.0, 10.0, 20.0, 15.0])  # float, max, auto, entropy: auto is kept
    result = ptq(model, batches, lambda m: next(scores), ("max", "auto", "entropy"), progress=False)
    assert result.best.label == "auto"
    methods = {d.name: d.method for d in calibration_report(model).quantizers}
    assert methods == result.best.quantizer_methods and methods["conv._input_quantizer"].startswith("auto: ")
    assert "largest clipping error" in result.table()
    entropy = next(r for r in result.results if r.label == "entropy")
    assert entropy.diagnostics.flagged()[0].name == "conv._input_quantizer"


def test_the_comparison_pass_reads_nothing_from_the_device_per_batch():
    """Host reads (``.item()``, ``bool(tensor)``) are counted with the profiler: as many for 6 batches as for 2."""
    syncs = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")
    torch.manual_seed(0)
    model, data = Mixed(), _heavy_batches(6)
    collect_stats(model, data, calibrator="histogram", progress=False)
    counts = []
    for batches in (2, 6):
        copy = deepcopy(model)
        with profile() as prof:
            select_amax(copy, data, num_batches=batches, score_fraction=1.0, progress=False)
        names = [e.name for e in prof.events()]
        counts.append(sum(names.count(s) for s in syncs))
    assert counts[0] == counts[1]


class Nested(QuantModule, nn.Module):
    """A quantized module whose forward runs another quantized module (with its own hooks) after its input
    quantizer."""

    def __init__(self):
        super().__init__()
        self.input_quantizer = TensorQuantizer(role="input")
        self.fc = QuantLinear(8, 8)

    def forward(self, x):
        return self.fc(torch.relu(self.input_quantizer(x)) * 3)


def test_re_running_a_layer_does_not_feed_the_layers_inside_it():
    """``fc`` is compared on the float model's activations only, not again while ``Nested`` re-runs with a
    quantized input: its errors equal those of the same layer calibrated alone on ``relu(x) * 3``."""
    torch.manual_seed(0)
    model = nn.Sequential(Nested())
    batches = _heavy_batches(2, rows=256)
    collect_stats(model, batches, calibrator="histogram", progress=False)
    choices = {c.quantizer: c for c in select_amax(model, batches, progress=False).choices}
    assert choices["0.input_quantizer"].layer == "0" and choices["0.fc._input_quantizer"].layer == "0.fc"
    alone = nn.Sequential(deepcopy(model[0].fc))
    inner = [torch.relu(b) * 3 for b in batches]
    collect_stats(alone, inner, calibrator="histogram", progress=False)
    (want,) = select_amax(alone, inner, progress=False).choices
    got = choices["0.fc._input_quantizer"]
    assert got.error and got.error.keys() == want.error.keys()
    for label, error in want.error.items():
        assert got.error[label] == pytest.approx(error, rel=1e-6), label


class Amplified(nn.Module):
    """A Linear whose output goes through ``exp`` to another: an error on a large pre-activation (what clipping the
    input's tail causes) grows on its way to the model output, more than the first layer's own error says."""

    def __init__(self):
        super().__init__()
        self.fc1 = QuantLinear(8, 16)
        self.fc2 = QuantLinear(16, 4)

    def forward(self, x):
        return self.fc2(torch.exp(self.fc1(x)))


def _outlier_batches(seed: int, share: float = 0.05) -> list[torch.Tensor]:
    """Gaussian rows with a ``share`` of entries given an extra N(0, 6²) (outliers)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(4):
        x = torch.randn(64, 8, generator=gen)
        outliers = torch.rand(64, 8, generator=gen) < share
        batches.append(x + outliers * torch.randn(64, 8, generator=gen) * 6)
    return batches


def _relative_error(model: nn.Module, batches, reference: torch.Tensor) -> float:
    with torch.no_grad():
        out = torch.cat([model(x) for x in batches])
    return float(((out - reference) ** 2).sum() / (reference**2).sum())


@pytest.mark.parametrize(("seed", "expected"), [(1, "max"), (2, "auto")])
def test_the_model_check_keeps_the_ranges_whose_model_output_is_closer_to_float(seed, expected):
    """Both errors recomputed here from the model: auto's ranges without the check, and every range at max; the
    model is left with the smaller, and the choices say which (the two seeds give one of each)."""
    torch.manual_seed(seed)
    model, batches = Amplified(), _outlier_batches(seed)
    collect_stats(model, batches, calibrator="histogram", progress=False)
    with qdq.quantizer.disabled_quantizers(model), torch.no_grad():
        reference = torch.cat([model(x) for x in batches])
    local = deepcopy(model)
    select_amax(local, batches, score_fraction=1.0, model_check=False, progress=False)
    widest = deepcopy(model)
    qdq.load_amax(widest, "max", warn=False)
    errors = {"auto": _relative_error(local, batches, reference), "max": _relative_error(widest, batches, reference)}

    result = select_amax(model, batches, score_fraction=1.0, progress=False)
    assert result.model_error == pytest.approx(errors, rel=1e-5)
    assert result.kept == min(errors, key=errors.get) == expected
    assert errors["auto"] != pytest.approx(errors["max"], rel=1e-3)  # a real choice
    assert _relative_error(model, batches, reference) == pytest.approx(errors[expected], rel=1e-6)
    methods = [q.amax_method for _, q in named_quantizers(model, weights=False)]
    if expected == "max":
        assert {c.chosen for c in result.choices} == {"max"}
        assert methods == ["auto: max (model check)"] * 2
    else:
        assert "(model check)" not in " ".join(methods)

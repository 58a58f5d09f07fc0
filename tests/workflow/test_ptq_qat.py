"""PTQ method selection, QAT schedule/checkpoints/resume, and sensitivity."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import qdq
from equalization_models import images, torch_pair
from qdq.errors import QdqConfigError
from qdq.workflow.calibration import calibrate
from qdq.workflow.fine_tuning import qat
from qdq.workflow.post_training import disabled_quantizers, ptq
from qdq.workflow.sensitivity_analysis import keep_float, layer_quantizers, sensitivity


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def _loader(shuffle=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 1, 4, 4, generator=g)
    y = (x.sum(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=shuffle)


def _accuracy(model, loader=None):
    loader = loader or _loader(shuffle=False)
    model.eval()
    with torch.no_grad():
        hits = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    return 100.0 * hits / len(loader.dataset)


def test_ptq_evaluates_every_method_and_keeps_the_best():
    model = qdq.quantize_model(_net())
    scores = iter([90.0, 70.0, 80.0, 95.0, 60.0, 61.0, 62.0, 63.0])  # float, then 7 methods in order
    result = ptq(model, _loader(), lambda m: next(scores), progress=False)
    assert [r.label for r in result.results] == [
        "max", "entropy", "mse", "percentile 99.9", "percentile 99.99", "percentile 99.999", "percentile 99.9999"
    ]  # fmt: skip
    assert result.float_score == 90.0 and result.best.label == "mse"
    amax = model[0].input_quantizer.amax
    assert torch.equal(amax, result.best.amax["0._input_quantizer"])
    assert "mse (best)" in result.table()


def test_ptq_real_scores_float_first():
    model = qdq.quantize_model(_net())
    result = ptq(model, _loader(), _accuracy, methods=("max", "percentile"), percentiles=(99.0,), progress=False)
    with disabled_quantizers(model):
        assert _accuracy(model) == result.float_score
    assert {r.label for r in result.results} == {"max", "percentile 99.0"}
    with pytest.raises(QdqConfigError, match="unknown calibration method"):
        ptq(model, _loader(), _accuracy, methods=("kl",), progress=False)


@pytest.mark.parametrize("best", ["max", "auto"])
def test_ptq_keeps_a_model_level_methods_parameter_changes_only_where_it_wins(best):
    """``auto`` equalizes and corrects biases in place: the methods scored after it, and the model ptq returns when
    another wins, have the parameters as given; when it wins, its own."""
    model = qdq.quantize_model(torch_pair("ReLU"), qdq.QuantConfig(target="tensorrt"))
    given = {name: tensor.clone() for name, tensor in model.named_parameters()}
    scores = iter([0.0, 2.0, 1.0] if best == "auto" else [0.0, 1.0, 2.0])  # float, auto, max
    result = ptq(model, images(4, 1), lambda m: next(scores), methods=("auto", "max"), progress=False)
    assert result.best.label == best and result.results[0].quantizer_methods  # auto ran
    changed = [name for name, tensor in model.named_parameters() if not torch.equal(tensor, given[name])]
    assert changed if best == "auto" else not changed


def _calibrated():
    model = qdq.quantize_model(_net())
    calibrate(model, _loader(), progress=False, method="max")
    return model


def test_qat_schedule_starts_at_one_percent_and_ends_at_one_percent_of_that():
    model = _calibrated()
    lrs = []
    result = qat(model, _loader(), None, epochs=2, lr=1.0, progress=False)
    lrs = [e["lr"] for e in result.epochs]
    assert math.isclose(lrs[-1], 1.0 * 0.01 * 0.01, rel_tol=1e-9)
    assert lrs[0] < 0.01 and lrs[0] > lrs[-1]


def test_qat_keeps_ranges_frozen_and_trains_weights():
    model = _calibrated()
    amax = model[0].input_quantizer.amax.clone()
    weight = model[0].weight.detach().clone()
    qat(model, _loader(), _accuracy, epochs=1, lr=5.0, progress=False)
    assert torch.equal(model[0].input_quantizer.amax, amax)
    assert not torch.equal(model[0].weight, weight)


def test_resume_after_interrupt_equals_uninterrupted(tmp_path):
    torch.manual_seed(5)
    reference = _calibrated()
    torch.manual_seed(7)
    qat(reference, _loader(), None, epochs=3, lr=1.0, progress=False)

    torch.manual_seed(5)
    model = _calibrated()
    calls = {"n": 0}

    def interrupting_eval(m):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed during epoch 3, before its checkpoint
        return 0.0

    torch.manual_seed(7)
    with pytest.raises(KeyboardInterrupt):
        qat(model, _loader(), interrupting_eval, epochs=3, lr=1.0, progress=False, checkpoint_dir=tmp_path)
    assert (tmp_path / "qat_checkpoint.pt").exists()
    torch.manual_seed(5)
    resumed = _calibrated()
    result = qat(resumed, _loader(), None, epochs=3, lr=1.0, progress=False, checkpoint_dir=tmp_path, resume=True)
    assert result.resumed_from_epoch == 2 and len(result.epochs) == 3
    for key, value in reference.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_qat_adamw_first_step_is_the_adamw_formula_at_one_percent_of_lr():
    # one batch, one step: AdamW's first update is lr * g / (|g| + eps) (bias-corrected moments m = g, v = g^2)
    # after the decoupled decay p * (1 - lr * wd); lr is 1 % of the training LR at the cosine's start
    model = _calibrated()
    x, y = next(iter(_loader(shuffle=False)))
    reference = copy.deepcopy(model).train()
    nn.functional.cross_entropy(reference(x), y).backward()
    lr, wd = 0.5, 0.1
    qat(model, [(x, y)], None, epochs=1, lr=lr / 0.01, weight_decay=wd, optimizer="adamw", progress=False)
    for (name, p), (_, before) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        g = before.grad.double().numpy()
        expected = before.detach().double().numpy() * (1 - lr * wd) - lr * g / (np.abs(g) + 1e-8)
        np.testing.assert_allclose(p.detach().double().numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_qat_errors(tmp_path):
    model = _calibrated()
    with pytest.raises(QdqConfigError, match="epochs"):
        qat(model, _loader(), None, epochs=0, lr=1.0)
    with pytest.raises(QdqConfigError, match="checkpoint_dir"):
        qat(model, _loader(), None, epochs=1, lr=1.0, resume=True)
    with pytest.raises(QdqConfigError, match="empty"):
        qat(model, [], None, epochs=1, lr=1.0, progress=False)
    with pytest.raises(QdqConfigError, match="optimizer must be one of sgd, adamw, got 'adam'"):
        qat(model, _loader(), None, epochs=1, lr=1.0, optimizer="adam")


def test_sensitivity_and_keep_float():
    model = _calibrated()
    layers = layer_quantizers(model)
    assert set(layers) == {"0", "3"}
    calls = []

    def score(m):
        enabled = tuple(not q._disabled for name in ("0", "3") for q in layers[name])
        calls.append(enabled)
        return float(sum(enabled))

    result = sensitivity(model, score)
    assert calls[0] == (False,) * 4 and calls[1] == (True,) * 4
    assert [(s.name, s.only_this_quantized, s.all_but_this_quantized) for s in result.layers] == [
        ("0", 2.0, 2.0), ("3", 2.0, 2.0)
    ]  # fmt: skip
    keep_float(model, ["3"])
    assert all(q._disabled for q in layers["3"]) and not any(q._disabled for q in layers["0"])
    with pytest.raises(QdqConfigError, match="not quantized layers"):
        keep_float(model, ["nope"])

"""Model calibration: ranges equal an independent max, one pass serves all methods, clear errors."""

import numpy as np
import pytest
import torch
from torch import nn

import histogram_reference as ref
import qdq
from qdq.errors import QdqCalibrationError, QdqConfigError
from qdq.quantizer import TensorQuantizer
from qdq.workflow.calibration import calibrate, collect_stats, load_amax, named_quantizers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 5)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _model():
    model = qdq.quantize_model(Net(), qdq.QuantConfig(exclude=("unused",)))
    model.bn.running_mean.uniform_(-0.2, 0.2)
    return model


def _data(n=4):
    return [torch.randn(6, 3, 8, 8) * (i + 1) for i in range(n)]


def test_max_calibration_equals_independent_max_and_restores_modes():
    model = _model().train()
    data = _data()
    calibrate(model, data, method="max", progress=False)
    assert model.conv.input_quantizer.amax.item() == max(b.abs().max().item() for b in data)
    model.eval()
    with torch.no_grad():  # the fc input is the float model's activation (quantization off while collecting)
        fc_inputs = [torch.relu(model.bn(nn.functional.conv2d(b, model.conv.weight, model.conv.bias, padding=1)))
                     for b in data]  # fmt: skip
    assert model.fc.input_quantizer.amax.item() == pytest.approx(max(t.abs().max().item() for t in fc_inputs))
    weight_amax = model.conv.weight.detach().abs().amax(dim=(1, 2, 3), keepdim=True)
    assert torch.equal(model.conv.weight_quantizer.amax, weight_amax)
    for _, quantizer in named_quantizers(model):
        assert quantizer._if_quant and not quantizer._if_calib
    model.train()
    calibrate(model, data, progress=False, method="max")
    assert model.training  # restored


def test_num_batches_runs_exactly_that_many():
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    data = _data(5)
    calibrate(model, data, num_batches=2, progress=False, method="max")
    assert len(calls) == 2  # the seed ran num_batches + 1
    assert model.conv.input_quantizer.amax.item() == max(b.abs().max().item() for b in data[:2])


def _magnitudes(batches):
    return np.concatenate([b.numpy().reshape(-1) for b in batches])


def test_one_histogram_pass_serves_every_method():
    """Three batches collected once; each method's amax equals a numpy oracle on all the data at once."""
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    data = _data(3)
    collect_stats(model, data, calibrator="histogram", num_bins=2048, progress=False)
    values = _magnitudes(data)
    expected = {
        ("max", None): float(np.abs(values).max()),
        ("entropy", None): ref.entropy_amax(values),
        ("mse", None): ref.mse_amax(values),
        **{("percentile", p): ref.percentile_amax(values, p) for p in (99.9, 99.99, 99.999, 99.9999)},
    }
    for method, percentile in expected:
        options = {} if percentile is None else {"percentile": percentile}
        load_amax(model, method, **options)
        got = model.conv.input_quantizer.amax.item()
        assert got == pytest.approx(expected[method, percentile], rel=1e-6), (method, percentile)
    assert len(calls) == 3  # one pass over the data for all seven


def test_collect_stats_uses_the_descriptors_calibrator_unless_told_otherwise():
    """Precedence: calibrator= wins; None means each quantizer's descriptor calib_method (max by default)."""
    model = qdq.quantize_model(Net(), qdq.QuantConfig(exclude=("unused",)))
    data = _data(2)
    collect_stats(model, data, progress=False)
    assert type(model.conv.input_quantizer.calibrator).__name__ == "MaxCalibrator"
    with pytest.raises(QdqConfigError, match=r"conv\._input_quantizer: .*entropy.*calibrator='histogram'"):
        load_amax(model, "entropy")
    histogram = qdq.QuantDescriptor(calib_method="histogram")
    model = qdq.quantize_model(Net(), qdq.QuantConfig(quant_desc_input=histogram, exclude=("unused",)))
    collect_stats(model, data, num_bins=2048, progress=False)
    load_amax(model, "percentile", percentile=99.9)
    assert model.conv.input_quantizer.amax.item() == pytest.approx(ref.percentile_amax(_magnitudes(data), 99.9))
    collect_stats(model, data, calibrator="max", progress=False)  # the argument beats the descriptor
    assert type(model.conv.input_quantizer.calibrator).__name__ == "MaxCalibrator"


def test_batches_as_pairs_and_forward_fn():
    model = _model()
    inputs = _data(2)
    pairs = [(b, torch.full((6,), 1e3)) for b in inputs]
    calibrate(model, pairs, progress=False, method="max")  # the inputs of (inputs, labels) pairs, labels ignored
    assert model.conv.input_quantizer.amax.item() == float(np.abs(_magnitudes(inputs)).max())
    seen = []
    dicts = [{"x": b * 10} for b in _data(2)]
    calibrate(model, dicts, forward_fn=lambda m, batch: seen.append(m(batch["x"])), progress=False, method="max")
    assert len(seen) == 2
    assert model.conv.input_quantizer.amax.item() == float(np.abs(_magnitudes([d["x"] for d in dicts])).max())


def test_unused_quantizer_error_names_module():
    model = qdq.quantize_model(Net())
    with pytest.raises(QdqCalibrationError, match=r"unused\._input_quantizer.*not used in forward"):
        calibrate(model, _data(1), progress=False, method="max")
    calibrate(model, _data(1), progress=False, strict=False, method="max")  # warns and leaves it dynamic
    assert model.unused.input_quantizer.amax is None and model.conv.input_quantizer.amax is not None


def test_nan_in_data_names_quantizer():
    model = _model()
    bad = torch.randn(2, 3, 8, 8)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(QdqCalibrationError, match=r"conv\._input_quantizer.*NaN"):
        calibrate(model, [bad], progress=False, method="max")
    assert model.conv.input_quantizer._if_quant  # modes restored after the error


def test_empty_loader_raises_before_any_work():
    model = _model()
    with pytest.raises(QdqCalibrationError, match="empty"):
        calibrate(model, [], progress=False, method="max")
    with pytest.raises(QdqCalibrationError, match="empty"):
        calibrate(model, iter([]), progress=False, method="max")
    assert all(q._calibrator is None for _, q in named_quantizers(model))


def test_bad_arguments():
    model = _model()
    with pytest.raises(QdqConfigError, match="unknown calibration method"):
        calibrate(model, _data(1), method="kl")
    with pytest.raises(QdqConfigError, match="num_batches"):
        calibrate(model, _data(1), num_batches=0, method="max")
    with pytest.raises(QdqConfigError, match="no enabled activation quantizer"):
        calibrate(Net(), _data(1), method="max")


def test_calibrated_quantizers_are_static():
    model = _model()
    calibrate(model, _data(2), method="entropy", progress=False)
    assert all(q.amax is not None for _, q in named_quantizers(model) if isinstance(q, TensorQuantizer))

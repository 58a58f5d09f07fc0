"""Calibration diagnostics: clipped shares against sums over the raw data, the report, and the warning."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import qdq
from detector_sample import detector_values
from qdq.calib import HistogramCalibrator, MaxCalibrator
from qdq.errors import QdqCalibrationWarning, QdqConfigError
from qdq.workflow.calibration import calibrate, collect_stats, load_amax
from qdq.workflow.diagnostics import CLIPPED_ENERGY_LIMIT, calibration_report, clipped_shares


def _exact(values: np.ndarray, amax: float) -> tuple[float, float, float]:
    """Shares of the values above amax, of their energy and of the clipping error, summed over the raw data."""
    mag = np.abs(values.astype(np.float64))
    above = mag > amax
    energy = (mag**2).sum()
    return above.mean(), (mag[above] ** 2).sum() / energy, ((mag[above] - amax) ** 2).sum() / energy


@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.8, 0.999, 1.0, 1.5])
def test_clipped_shares_match_sums_over_the_data(unsigned, fraction):
    """Heavy-tailed signed data: the histogram estimate is within 0.1 point of the exact shares."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=gen) * torch.rand(200_000, generator=gen).pow(4) * 3
    cal = HistogramCalibrator(unsigned=unsigned)
    cal.collect(x)
    data_max = cal.compute_amax("max").reshape(1)
    amax = data_max * fraction
    total, energy, clipped, clipped_energy, error = clipped_shares(cal.bin_counts, cal.bin_width, amax, data_max)
    values = x.clamp(min=0).numpy() if unsigned else x.numpy()
    want_values, want_energy, want_error = _exact(values, float(amax))
    assert float(total) == values.size
    assert float(clipped / total) == pytest.approx(want_values, abs=1e-3)
    assert float(clipped_energy / energy) == pytest.approx(want_energy, abs=1e-3)
    assert float(error / energy) == pytest.approx(want_error, abs=1e-4)
    assert float(energy) == pytest.approx((values.astype(np.float64) ** 2).sum(), rel=1e-3)
    if fraction >= 1:
        assert float(clipped) == 0 and float(clipped_energy) == 0 and float(error) == 0  # the max is exact


def test_per_channel_shares_sum_over_channels():
    x = torch.randn(64, 3, 10) * torch.tensor([0.1, 1.0, 10.0])[None, :, None]
    cal = HistogramCalibrator(axis=1)
    cal.collect(x)
    data_max = cal.compute_amax("max").reshape(-1)
    amax = data_max * torch.tensor([0.5, 1.0, 0.9])
    shares = clipped_shares(cal.bin_counts, cal.bin_width, amax, data_max)
    exact = [_exact(x[:, c].numpy(), float(amax[c])) for c in range(3)]
    assert (shares.clipped_energy / shares.energy).tolist() == pytest.approx([e[1] for e in exact], abs=2e-3)
    assert (shares.clipping_error / shares.energy).tolist() == pytest.approx([e[2] for e in exact], abs=2e-4)
    assert float(shares.clipped_energy[1]) == 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 2, 1)
        self.fc = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _detector_batches(batches: int = 4) -> list[torch.Tensor]:
    values = torch.from_numpy(detector_values(batches * 8 * 16 * 64))
    return list(values.reshape(batches, 8, 16, 8, 8))


def test_report_flags_entropy_on_the_detector_sample():
    """The shipped detector activation: entropy's amax (0.165 against a max of 2.1) leaves 1 % of the values
    above it, which carry 98 % of the energy; clipping removes 69 % of it. The report names it, with the shares
    summed over the data, and the warning says what to do."""
    model = qdq.quantize_model(Net())
    batches = _detector_batches()
    with pytest.warns(QdqCalibrationWarning) as record:
        calibrate(model, batches, method="entropy", progress=False)
    report = calibration_report(model)
    row = next(d for d in report.quantizers if d.name == "conv._input_quantizer")
    values = torch.cat([b.reshape(-1) for b in batches]).numpy()
    want_values, want_energy, want_error = _exact(values, row.amax)
    assert row.method == "entropy" and row.calibrator == "HistogramCalibrator"
    assert row.amax == pytest.approx(0.165, abs=0.002) and row.data_max == pytest.approx(float(values.max()))
    assert row.energy_above == pytest.approx(want_energy, abs=1e-3) and row.energy_above > 0.95
    assert row.clipping_error == pytest.approx(want_error, abs=1e-4) and row.clipping_error > 0.6
    assert row.clipped_values == pytest.approx(want_values, abs=1e-3) and row.clipped_values < 0.02
    assert row.amax_ratio == pytest.approx(row.amax / row.data_max)
    assert report.flagged()[0].name == "conv._input_quantizer"
    message = str(record[0].message)
    assert "conv._input_quantizer (entropy)" in message and 'method="auto"' in message
    assert "FAIL" in report.table() and "clipping error" in str(report)


def test_good_ranges_pass_and_no_warning():
    model = qdq.quantize_model(Net())
    batches = _detector_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QdqCalibrationWarning)
        calibrate(model, batches, method="mse", progress=False)
        calibrate(model, batches, method="max", progress=False)
    report = calibration_report(model)
    assert report.flagged() == [] and "FAIL" not in report.table()
    assert all(d.method == "max" and d.clipping_error == 0 and d.amax_ratio == 1 for d in report.quantizers)
    assert all(d.calibrator == "MaxCalibrator" for d in report.quantizers)


def test_method_labels_and_a_range_set_by_hand():
    model = qdq.quantize_model(Net())
    batches = _detector_batches(2)
    collect_stats(model, batches, calibrator="histogram", progress=False)
    load_amax(model, "percentile", percentile=99.9, warn=False)
    assert {d.method for d in calibration_report(model).quantizers} == {"percentile 99.9"}
    model.conv.input_quantizer.amax = 0.01  # by hand: the method is no longer known
    row = calibration_report(model).quantizers[0]
    assert row.method is None and row.amax == pytest.approx(0.01) and row.energy_above > 0.99


def test_max_calibrator_below_its_max_is_unknown():
    model = qdq.quantize_model(Net())
    calibrate(model, _detector_batches(1), method="max", progress=False)
    model.conv.input_quantizer.amax = 0.5
    row = calibration_report(model).quantizers[0]
    assert row.clipping_error is None and row.clipped_values is None and "?" in calibration_report(model).table()


def test_warning_names_a_handful_then_counts():
    layers = [qdq.nn.QuantLinear(16, 16) for _ in range(8)]
    model = nn.Sequential(*layers)
    for layer in layers:
        nn.init.eye_(layer.weight)
        nn.init.zeros_(layer.bias)
    data = [torch.from_numpy(detector_values(64 * 16, seed=i)).reshape(64, 16) for i in range(2)]
    with pytest.warns(QdqCalibrationWarning) as record:
        calibrate(model, data, method="entropy", progress=False)
    lines = str(record[0].message).splitlines()
    assert lines[0].startswith("8 activation quantizers clip away 10 % or more")
    assert sum("(entropy): amax" in line for line in lines) == 5
    assert "... and 3 more" in lines[6]
    with warnings.catch_warnings():
        warnings.simplefilter("error", QdqCalibrationWarning)
        load_amax(model, "entropy", warn=False)


def test_limit_and_dict():
    """Percentile 99.9 on the detector activation: 0.1 % of the values, half the energy above amax, but they
    lie close to it: clipping removes about 4 % of the energy, under the default limit."""
    model = qdq.quantize_model(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("error", QdqCalibrationWarning)
        calibrate(model, _detector_batches(4), method="percentile", percentile=99.9, progress=False)
    row = calibration_report(model).quantizers[0]
    assert 0.3 < row.energy_above < 0.7 and 0.02 < row.clipping_error < 0.07
    assert calibration_report(model, limit=0.5).flagged() == []
    strict = calibration_report(model, limit=0.01)
    assert strict.to_dict()["flagged"][:1] == ["conv._input_quantizer"]
    assert strict.to_dict()["quantizers"][0]["clipping_error"] == row.clipping_error
    assert calibration_report(model).limit == CLIPPED_ENERGY_LIMIT
    for bad in (0, 1.5, float("nan"), True):
        with pytest.raises(QdqConfigError, match="limit"):
            calibration_report(model, limit=bad)


def test_uncalibrated_quantizers_are_left_out():
    model = qdq.quantize_model(Net())
    assert calibration_report(model).quantizers == []
    model.conv.input_quantizer.calibrator = MaxCalibrator()
    assert calibration_report(model).quantizers == []  # a calibrator without data

"""HistogramCalibrator: the seed's targets, collection (binning, growth, counts), options and errors.

Expected values are derived by hand from the power-of-two layout: a channel whose largest magnitude is
m uses the range [0, 2**k) with 2**(k-1) <= m < 2**k, split into num_bins bins of width 2**k / num_bins.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qdq.calib import HistogramCalibrator
from qdq.errors import QdqCalibrationError, QdqConfigError, QdqError, QdqTypeError


def collected(*tensors, **kwargs):
    cal = HistogramCalibrator(**kwargs)
    for t in tensors:
        cal.collect(t)
    return cal


# -- the seed's targets (notes §9), with the exact values of our layout ----------------------------------


def test_percentile_arange_p90():
    # range 128, width 1/16: integer v sits at the left edge of bin 16 v; 90 % of 100 values are <= 89
    amax = collected(torch.arange(100)).compute_amax("percentile", percentile=90)
    assert abs(float(amax) - 89.0) < 100 / 1024  # the seed's tolerance
    assert float(amax) == 89.0


def test_percentile_arange_p80_unsigned():
    amax = collected(torch.arange(100), unsigned=True).compute_amax("percentile", percentile=80)
    assert abs(float(amax) - 79.0) < 100 / 2048
    assert float(amax) == 79.0


def test_percentile_two_tensors_p99():
    # 200 values; the 198th smallest is 97 (only arange(100) reaches above 49.5)
    cal = collected(torch.arange(100), torch.arange(0, 50, 0.5))
    amax = cal.compute_amax("percentile", percentile=99)
    assert abs(float(amax) - 97.0) < 100 / 1024
    assert float(amax) == 97.0


def test_mse_one_outlier_closer_to_255():
    x = torch.full((11, 7, 3, 3), 255.0)
    x[1, 1, 1, 1] = 256.0
    amax = float(collected(x).compute_amax("mse"))
    assert abs(amax - 255) < abs(amax - 256)
    assert amax == 255.0625  # range 512, 4096 bins of 1/8: centre of 255's bin 2040 (error 0.9375**2 for 256 only)


def test_mse_unsigned_one_outlier_closer_to_512():
    x = torch.full((11, 7, 3, 3), 512.0)
    x[1, 1, 1, 1] = 513.0
    amax = float(collected(x, unsigned=True).compute_amax("mse"))
    assert abs(amax - 512) < abs(amax - 513)
    assert amax == 512.125  # range 1024, 4096 bins of 1/4: centre of bin 2048


@pytest.mark.parametrize("unsigned", [False, True])
def test_entropy_discards_one_outlier(unsigned):
    x = torch.rand(11, 7, 3, 3)
    x[1, 1, 1, 1] = 10.0
    cal = collected(x, unsigned=unsigned)
    assert float(cal.compute_amax("entropy")) < 1.1
    cal.collect(torch.rand(11, 7, 3, 3))  # the seed's two-tensor variant
    assert float(cal.compute_amax("entropy")) < 1.1


def test_growth_entropy_and_mse():
    x1 = torch.tensor([0, 255, 255, 255, 255, 255.0])
    x2 = torch.tensor([0, 255, 255, 255, 255, 256.0])
    cal = collected(x1, x2)
    entropy = float(cal.compute_amax("entropy"))
    assert abs(entropy - 255) < abs(entropy - 256)
    # range 512, 4096 bins of 1/8: 255 -> bin 2040, 256 -> bin 2048. P for i = 2041 is one bin (KL 0);
    # i = 2042..2048 have an empty last bin with a tail (KL inf); i = 2049 puts both values in one group
    assert entropy == 2041 * 0.125
    assert abs(float(cal.compute_amax("mse")) - 255) < 0.5


def test_skip_zeros_p50():
    cal = collected(
        torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 0, 0, 6, 7, 8, 9, 10]), skip_zeros=True
    )
    amax = float(cal.compute_amax("percentile", percentile=50))
    assert abs(amax - 5) < 10 / 2048
    assert amax == 5.0  # without zeros: 10 values, the 5th is 5 (16 is the range, 5 a bin edge)
    assert int(cal.bin_counts.sum()) == 10


def test_per_channel_max_over_two_batches():
    x1, x2 = torch.randn(31, 63, 7, 7), torch.randn(31, 63, 7, 7)
    cal = collected(x1, x2, axis=0)
    expected = torch.maximum(x1.abs(), x2.abs()).amax(dim=(1, 2, 3), keepdim=True)
    assert torch.equal(cal.compute_amax("max"), expected)
    assert cal.compute_amax("percentile").shape == (31, 1, 1, 1)


def test_reset_and_negative_axis():
    x = torch.randn(4, 3, 2, 2)
    a, b = collected(x, axis=0), collected(x, axis=-4)
    for method in HistogramCalibrator.methods:
        assert torch.equal(a.compute_amax(method), b.compute_amax(method))
    a.reset()
    assert a.compute_amax() is None and not a.has_data
    a.collect(torch.randn(5, 3))  # a new shape is fine after reset
    assert a.compute_amax("max").shape == (5, 1)


def test_channel_shape_change_raises():
    cal = collected(torch.rand(32, 63, 7, 7), axis=0)
    with pytest.raises(QdqCalibrationError, match="shape changed"):
        cal.collect(torch.rand(33, 63, 7, 7))
    with pytest.raises(QdqCalibrationError, match="shape changed"):
        cal.collect(torch.rand(32, 63))  # axis 0 of a rank-2 tensor: (32, 1) instead of (32, 1, 1, 1)


def test_per_tensor_accepts_any_shape():
    cal = collected(torch.rand(3, 4), torch.rand(7), torch.tensor(2.5))
    assert float(cal.compute_amax("max")) == 2.5


# -- collection ---------------------------------------------------------------------------------------


def test_values_land_in_their_bins():
    # range 8 (max 7.99...), width 8/4096 = 1/512: (j + f) / 512 is exact in float32 and lies in bin j
    bins = torch.randint(0, 4096, (5000,))
    bins[0] = 4095
    frac = torch.tensor([0.0, 0.25, 0.5, 0.75])[torch.randint(0, 4, (5000,))]
    cal = collected((bins + frac) / 512 * torch.where(torch.rand(5000) < 0.5, -1, 1))
    assert torch.equal(cal.bin_counts[0], torch.bincount(bins, minlength=4096))
    assert float(cal.bin_width[0]) == 1 / 512


def test_counts_are_exact_beyond_float32_saturation():
    # float32 counts (the seed's histc) stop at 2**24 = 16777216 in one bin
    x = torch.zeros(2**24 + 3)
    x[0] = 1.0
    counts = collected(x).bin_counts
    assert counts.dtype == torch.int64
    assert int(counts[0, 0]) == 2**24 + 2 and int(counts.sum()) == 2**24 + 3


def test_bin_count_stays_bounded_when_the_range_grows():
    small, large = torch.rand(1000), torch.rand(1000) * 1000
    cal = collected(small, large, num_bins=512)
    assert cal.bin_counts.shape == (1, 512)
    assert int(cal.bin_counts.sum()) == 2000
    # re-binning is exact: same counts as histogramming everything at the final range at once
    assert torch.equal(cal.bin_counts, collected(torch.cat([small, large]), num_bins=512).bin_counts)


def test_all_zero_first_batch():
    data = torch.randn(1000)
    cal = collected(torch.zeros(50), data)
    ref = collected(data, torch.zeros(50))
    assert torch.equal(cal.bin_counts, ref.bin_counts)
    for method in HistogramCalibrator.methods:
        amax = cal.compute_amax(method)
        assert torch.isfinite(amax) and 0 < float(amax) <= float(data.abs().max()) + float(cal.bin_width[0])


@pytest.mark.parametrize("method", HistogramCalibrator.methods)
def test_all_zero_channel_gives_zero(method):
    x = torch.randn(3, 10)
    x[1] = 0
    amax = collected(x, axis=0).compute_amax(method)
    assert float(amax[1, 0]) == 0 and bool((amax[[0, 2]] > 0).all())


def test_unsigned_histogram_clamps_negatives_to_zero():
    x = torch.tensor([-5.0, -1.0, 0.5, 3.0])
    cal = collected(x, unsigned=True)
    assert float(cal.compute_amax("max")) == 3.0
    assert int(cal.bin_counts[0, 0]) == 2  # both negatives quantize to 0
    assert int(collected(x, unsigned=True, skip_zeros=True).bin_counts.sum()) == 2


def test_skip_zeros_keeps_the_max():
    cal = collected(torch.tensor([0.0, 0.0, 3.0]), skip_zeros=True)
    assert float(cal.compute_amax("max")) == 3.0 and int(cal.bin_counts.sum()) == 1


@pytest.mark.parametrize("axis", [1, (0, 3), (-1,)])
@pytest.mark.parametrize("unsigned", [False, True])
def test_per_channel_equals_per_tensor_on_each_channel(axis, unsigned):
    x = torch.randn(2, 4, 30, 3) * torch.logspace(-3, 3, 4)[None, :, None, None]
    cal = collected(x, axis=axis, unsigned=unsigned, num_bins=256)
    keep = [a % 4 for a in ((axis,) if isinstance(axis, int) else axis)]
    channels = x.movedim(keep, list(range(len(keep)))).reshape(-1, *[x.shape[d] for d in range(4) if d not in keep])
    for method in HistogramCalibrator.methods:
        amax = cal.compute_amax(method, start_bin=16)
        assert amax.shape == tuple(x.shape[d] if d in keep else 1 for d in range(4))
        for c, channel in enumerate(channels):
            ref = collected(channel, unsigned=unsigned, num_bins=256).compute_amax(method, start_bin=16)
            assert float(amax.flatten()[c]) == float(ref), (method, c)


def test_input_dtypes():
    ints = collected(torch.tensor([1, -7, 3])).compute_amax("max")
    halves = collected(torch.tensor([1.0, -7.0, 3.0], dtype=torch.float16)).compute_amax("max")
    assert ints.dtype == halves.dtype == torch.float32 and float(ints) == float(halves) == 7.0
    assert not collected(torch.zeros(0, 3)).has_data  # empty tensors are ignored


# -- compute_amax options -------------------------------------------------------------------------------


def test_default_method_and_options():
    x = torch.randn(5000)
    cal = collected(x, method="percentile", percentile=90.0)
    assert torch.equal(cal.compute_amax(), cal.compute_amax("percentile", percentile=90.0))
    assert not torch.equal(cal.compute_amax(), cal.compute_amax(percentile=99.0))
    assert torch.equal(collected(x).compute_amax(), cal.compute_amax("entropy"))  # entropy is the default
    # options a method does not use are ignored, so one set of options serves every method
    assert torch.equal(cal.compute_amax("mse", percentile=50), cal.compute_amax("mse"))
    assert cal.compute_amax().dtype == torch.float32 and cal.compute_amax().shape == ()


def test_stride_and_start_bin_restrict_the_candidates():
    cal = collected(torch.randn(20000))
    width = float(cal.bin_width[0])
    for method, offset in (("entropy", 0.0), ("mse", 0.5)):
        position = float(cal.compute_amax(method, start_bin=1000, stride=7)) / width - offset
        assert position >= 1000 and (position - 1000) % 7 == 0


def test_unknown_method_and_options_raise():
    cal = collected(torch.randn(10))
    with pytest.raises(QdqConfigError, match="Did you mean 'entropy'"):
        cal.compute_amax("entropie")
    with pytest.raises(QdqTypeError, match="Did you mean 'percentile'"):
        cal.compute_amax("percentile", percentil=99)
    with pytest.raises(QdqConfigError, match="range"):
        cal.compute_amax("percentile", percentile=101)
    with pytest.raises(QdqConfigError, match="beyond num_bins"):
        cal.compute_amax("entropy", start_bin=8192)
    with pytest.raises(QdqConfigError, match=">= 1"):
        cal.compute_amax("mse", stride=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_bins": 1}, "num_bins"),
        ({"num_bins": 2.0}, "num_bins"),
        ({"method": "kl"}, "method"),
        ({"percentile": -1}, "range"),
        ({"start_bin": 0}, "start_bin"),
        ({"num_bits": 1}, "num_bits"),
        ({"axis": 1.0}, "axis"),
    ],
)
def test_constructor_errors(kwargs, match):
    # wrong types are QdqTypeError, wrong values QdqConfigError; both are QdqError
    with pytest.raises(QdqError, match=match):
        HistogramCalibrator(**kwargs)


@pytest.mark.parametrize(
    "bad, unsigned",
    [
        (float("nan"), False),
        (float("inf"), False),
        (float("-inf"), False),
        (float("-inf"), True),  # clamping to 0 must not hide it
        (float("nan"), True),
    ],
)
@pytest.mark.parametrize("axis", [None, 0])
def test_non_finite_data_raises_when_used_naming_the_batch(bad, unsigned, axis):
    x = torch.rand(4, 5)
    x[2, 3] = bad
    cal = HistogramCalibrator(unsigned=unsigned, axis=axis)
    cal.collect(torch.rand(4, 5))
    cal.collect(x)  # no host read while collecting: the check happens where the statistics are used
    cal.collect(torch.rand(4, 5))
    for method in HistogramCalibrator.methods:
        with pytest.raises(QdqCalibrationError, match="NaN or Inf values \\(batch 2 of 3\\)"):
            cal.compute_amax(method)
    with pytest.raises(QdqCalibrationError, match="batch 2 of the calibrator being merged"):
        HistogramCalibrator(unsigned=unsigned, axis=axis).merge(cal)
    cal.reset()
    cal.collect(torch.tensor([[1.0, 3.0, 0, 0, 0]] * 4))
    assert cal.compute_amax("max").max().item() == 3.0


def test_non_tensor_inputs_raise():
    cal = HistogramCalibrator()
    with pytest.raises(QdqTypeError, match=r"torch\.Tensor"):
        cal.collect([1.0, 2.0])
    with pytest.raises(QdqTypeError, match="complex"):
        cal.collect(torch.ones(3, dtype=torch.complex64))


def test_axis_out_of_range_raises():
    with pytest.raises(QdqConfigError, match="out of range"):
        HistogramCalibrator(axis=3).collect(torch.rand(2, 2))
    with pytest.raises(QdqConfigError, match="same dimension"):
        HistogramCalibrator(axis=(1, -1)).collect(torch.rand(2, 2))


def test_repr_names_the_configuration():
    text = repr(collected(torch.rand(3, 4), axis=0, num_bins=64))
    assert "HistogramCalibrator" in text and "num_bins=64" in text and "(3, 1)" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_cpu():
    batches = [torch.randn(8, 16, 10) * s for s in (0.1, 5.0, 1.0)]
    for axis in (None, 1):
        cpu = collected(*batches, axis=axis)
        gpu = collected(*[b.cuda() for b in batches], axis=axis)
        assert torch.equal(cpu.bin_counts, gpu.bin_counts.cpu())
        for method in HistogramCalibrator.methods:
            assert gpu.compute_amax(method).device.type == "cuda"
            assert torch.equal(cpu.compute_amax(method), gpu.compute_amax(method).cpu()), method


@pytest.mark.parametrize("kernel", ["_histogram_bincount", "_histogram_histc"])
@pytest.mark.parametrize("skip_zeros", [False, True])
@pytest.mark.parametrize("unsigned", [False, True])
def test_per_tensor_kernels_equal_the_scatter_path(monkeypatch, kernel, skip_zeros, unsigned):
    from qdq.calib import binning

    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(64, 32, generator=g).relu() * s for s in (0.5, 3.0)]
    batches.append(torch.randn(64, 32, generator=g) * 2)  # negatives: bin 0 (unsigned) or |x| (signed)
    batches.append(torch.tensor([0.0, 2.0**-30, 1.0 - 2.0**-24, 1.0, -1.0]))  # zeros, tiny, bin edges
    with monkeypatch.context() as patch:
        patch.setattr(binning, "_per_tensor_kernel", lambda x, channels, num_bins: None)
        reference = collected(*batches, unsigned=unsigned, skip_zeros=skip_zeros, num_bins=4096)
    monkeypatch.setattr(binning, "_per_tensor_kernel", lambda x, channels, num_bins: getattr(binning, kernel))
    monkeypatch.setattr(binning, "_DEVICE_CHUNK", 1000)  # several chunks per batch
    via_kernel = collected(*batches, unsigned=unsigned, skip_zeros=skip_zeros, num_bins=4096)
    assert torch.equal(reference.bin_counts, via_kernel.bin_counts)
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    via_kernel.collect(bad)  # bad data must not crash the histogram kernels; it is reported when used
    with pytest.raises(QdqCalibrationError, match="batch 5 of 5"):
        via_kernel.compute_amax()


def test_the_cpu_kernel_also_bins_counts_that_are_not_a_power_of_two():
    from qdq.calib import binning

    # range [0, 2): bin = floor(fl32(m * 500)); 0.7 (0.69999999 in float32) times 500 rounds to 350.0 in float32
    x = torch.tensor([0.0, 0.3, 0.7, 0.999, 1.0, 1.5, 1.999])
    assert binning._per_tensor_kernel(x, 1, 1000) is binning._histogram_bincount
    cal = collected(x, num_bins=1000)
    expected = torch.zeros(1000, dtype=torch.int64)
    for m in x.numpy():
        expected[min(int(np.floor(np.float32(m) * np.float32(500))), 999)] += 1
    assert expected[350] == 1 and expected[349] == 0
    assert torch.equal(cal.bin_counts.reshape(-1), expected)


def test_per_tensor_kernel_on_each_device(monkeypatch):
    """CPU: bincount. CUDA: the Triton kernel where triton imports, else histc; other accelerators: histc. Per channel
    or with bins that are not a power of two: the scatter path (None)."""
    from types import SimpleNamespace

    from qdq.calib import binning

    def on(device: str) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device))

    assert binning._per_tensor_kernel(on("cpu"), 1, 4096) is binning._histogram_bincount
    assert binning._per_tensor_kernel(on("meta"), 1, 4096) is binning._histogram_histc
    assert binning._per_tensor_kernel(on("meta"), 1, 3000) is None
    assert binning._per_tensor_kernel(on("cuda"), 2, 4096) is None
    monkeypatch.setattr(binning, "_triton_kernels", lambda: object())
    assert binning._per_tensor_kernel(on("cuda"), 1, 4096) is binning._histogram_triton
    monkeypatch.setattr(binning, "_triton_kernels", lambda: None)
    assert binning._per_tensor_kernel(on("cuda"), 1, 4096) is binning._histogram_histc

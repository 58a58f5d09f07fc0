"""No quantizer reads a device value on the host: counted with the profiler on a CPU training step.

On a GPU, ``.item()``, ``bool(tensor)`` and ``if tensor:`` wait for every queued kernel. They show up in
the profiler as ``aten::item`` / ``aten::_local_scalar_dense`` / ``aten::is_nonzero`` on any device, so
a CPU run catches them.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch.profiler import profile

import qdq
from qdq.calib import HistogramCalibrator, MaxCalibrator

_SYNCS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


@pytest.fixture(autouse=True)
def accelerator_kernels(monkeypatch):
    """Histograms with the kernel accelerators use (histc): the CPU's bincount reads its largest index on
    the host to size its output, which costs nothing where it runs (the CPU) and is never used elsewhere."""
    from qdq.calib import binning

    def kernel(x, channels, num_bins):
        return binning._histogram_histc if channels == 1 and num_bins & (num_bins - 1) == 0 else None

    monkeypatch.setattr(binning, "_per_tensor_kernel", kernel)


def _count_syncs(fn) -> dict[str, int]:
    with profile() as prof:
        fn()
    names = [event.name for event in prof.events()]
    return {name: names.count(name) for name in _SYNCS}


def _model(learned: bool = False, step_type: str = "float32") -> torch.nn.Module:
    torch.manual_seed(0)
    desc = qdq.QuantDescriptor(learn_amax=True, amax=2.0) if learned else None
    config = qdq.QuantConfig(quant_desc_input=desc)
    model = qdq.quantize_model(torchvision.models.resnet18(num_classes=10), config)
    for quantizer in model.modules():
        if isinstance(quantizer, qdq.TensorQuantizer):
            quantizer.step_type = step_type
    for quantizer in model.modules():
        if isinstance(quantizer, qdq.TensorQuantizer) and not quantizer.learn_amax:
            quantizer.amax = torch.tensor(3.0) if quantizer.axis is None else torch.rand(1) + 0.5
    return model


@pytest.mark.parametrize("step_type", ["float32", "float16"])  # float16: TensorRT 11 steps, rounded on the device
@pytest.mark.parametrize("learned", [False, True])
def test_training_step_has_no_host_reads(learned, step_type):
    model = _model(learned, step_type)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    assert _count_syncs(step) == dict.fromkeys(_SYNCS, 0)


@pytest.mark.parametrize("step_type", ["float32", "float16"])
def test_eval_and_dynamic_ranges_have_no_host_reads(step_type):
    model = qdq.quantize_model(torchvision.models.resnet18(num_classes=10)).eval()  # every range dynamic
    for quantizer in model.modules():
        if isinstance(quantizer, qdq.TensorQuantizer):
            quantizer.step_type = step_type
    with torch.no_grad():
        assert _count_syncs(lambda: model(torch.randn(2, 3, 32, 32))) == dict.fromkeys(_SYNCS, 0)


@pytest.mark.parametrize("calibrator", [MaxCalibrator, HistogramCalibrator])
@pytest.mark.parametrize("axis", [None, 1])
def test_collecting_statistics_has_no_host_reads(calibrator, axis):
    cal = calibrator(axis=axis)
    batches = [torch.randn(8, 16, 5, 5) * s for s in (1.0, 4.0, 0.5)]
    cal.collect(batches[0])

    def collect():
        for batch in batches:
            cal.collect(batch)

    assert _count_syncs(collect) == dict.fromkeys(_SYNCS, 0)
    assert cal.compute_amax() is not None  # the one read happens here, once


@pytest.mark.parametrize("method", ["max", "histogram"])
def test_calibration_forward_of_a_model_has_no_host_reads(method):
    model = qdq.quantize_model(
        torchvision.models.resnet18(num_classes=10),
        qdq.QuantConfig(quant_desc_input=qdq.QuantDescriptor(calib_method=method)),
    ).eval()
    quantizers = [m for m in model.modules() if isinstance(m, qdq.TensorQuantizer) and m.axis is None]
    for quantizer in quantizers:
        quantizer.disable_quant()
        quantizer.enable_calib()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model(x)
        assert _count_syncs(lambda: model(x)) == dict.fromkeys(_SYNCS, 0)
    assert all(q.calibrator.compute_amax("max") is not None for q in quantizers)


@pytest.mark.gpu
@pytest.mark.parametrize("step_type", ["float32", "float16"])
@pytest.mark.parametrize("learned", [False, True])
def test_cuda_training_and_calibration_never_synchronize(learned, step_type):
    """On the device itself: CUDA's sync debug mode raises at any operation that waits for the GPU."""
    model = _model(learned, step_type).cuda()
    x, y = torch.randn(4, 3, 32, 32, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()  # first call: lazy initialisation (cuDNN, Triton compilation) may synchronize
    cal = HistogramCalibrator()
    cal.collect(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        cal.collect(x * 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_default_calibration_copies_only_per_channel_figures_to_the_host(monkeypatch):
    """``calibrate``'s default (auto: equalization, every method, bias correction) reduces activations where they
    live. Before, bias correction and equalization copied whole conv inputs and outputs to the host, and on an
    H200 the default calibration of resnet50 took 500x its float forward (benchmarks/RESULTS.md, gpu_histogram)."""
    torch.manual_seed(0)
    model = qdq.quantize_model(torchvision.models.resnet18(num_classes=10)).eval()
    data = [torch.randn(4, 3, 32, 32) for _ in range(4)]
    shapes = []
    original = torch.Tensor.cpu

    def cpu(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    qdq.calibrate(model, data, progress=False)
    # weights (equalization rescales them on the host) and per-sample, per-channel means; no activation
    assert any(len(shape) == 2 and shape[1] == 64 for shape in shapes)  # bias correction's [samples, C] means
    assert not [shape for shape in shapes if len(shape) == 4 and shape[0] <= 4]  # no [n <= 4, C, H, W]

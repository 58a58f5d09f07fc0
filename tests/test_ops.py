"""The fused quantization operator: step arithmetic, Triton kernels (interpreted), CPU vs CUDA bits."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qdq import ops
from qdq.tensor_quant import fake_tensor_quant, max_bound, quant_bounds, quant_scale, quant_step, tensor_quant

_CONFIGS = [(bits, unsigned) for bits in range(2, 17) for unsigned in (False, True)]


def _amaxes(n: int = 20_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([rng.uniform(1e-3, 10, n), 10.0 ** rng.uniform(-6, 6, n)]).astype(np.float32)


@pytest.mark.parametrize(("num_bits", "unsigned"), _CONFIGS)
def test_step_equals_numpy_float32_division(num_bits, unsigned):
    amax = _amaxes()
    expected = amax / np.float32(max_bound(num_bits, unsigned))  # numpy: correctly rounded float32 division
    got = quant_step(torch.from_numpy(amax), num_bits, unsigned).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(("num_bits", "unsigned"), [(8, False), (8, True), (4, False)])
def test_seed_scale_is_correctly_rounded(num_bits, unsigned):
    amax = _amaxes()
    expected = np.float32(max_bound(num_bits, unsigned)) / amax
    np.testing.assert_array_equal(quant_scale(torch.from_numpy(amax), num_bits, unsigned).numpy(), expected)
    _, scale = tensor_quant(torch.zeros(3), torch.tensor(float(amax[7])), num_bits, unsigned)
    assert scale.item() == expected[7]


def test_tiny_amax_has_step_one_and_zero_output():
    assert quant_step(torch.tensor([0.0, 2.0**-24, 2.0**-23])).tolist() == [1.0, 1.0, np.float32(2.0**-23) / 127]
    assert fake_tensor_quant(torch.tensor([3.0, -1.0]), 0.0).tolist() == [0.0, 0.0]


def test_operator_is_registered_with_fake_and_autograd():
    x = torch.randn(4, 3, requires_grad=True)
    out = torch.ops.qdq.quantize(x, torch.tensor(1.0), -128, 127, True)
    out.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), (x.detach().abs() <= 1.0).float().numpy())
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = torch.ops.qdq.quantize(torch.empty(2, 5), torch.empty(()), -128, 127, True)
    assert fake.shape == (2, 5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_aten_bit_for_bit_under_the_interpreter():
    script = Path(__file__).with_name("_triton_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 17


# -- CUDA (skipped without a GPU) --------------------------------------------------------------------


def _cpu_and_cuda(x: torch.Tensor, amax: torch.Tensor, bits: int, unsigned: bool, narrow: bool):
    results = []
    for device in ("cpu", "cuda"):
        xd = x.to(device).requires_grad_(True)
        out = fake_tensor_quant(xd, amax.to(device), bits, unsigned, narrow)
        q, _ = tensor_quant(xd.detach(), amax.to(device), bits, unsigned, narrow)
        out.backward(torch.ones_like(out))
        results.append((out.detach().cpu(), q.cpu(), xd.grad.cpu()))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize(("num_bits", "unsigned"), [(b, u) for b in (2, 4, 6, 8) for u in (False, True)])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu_bit_for_bit(num_bits, unsigned, per_channel, dtype):
    g = torch.Generator().manual_seed(num_bits)
    x = (torch.randn(64, 32, 9, 9, generator=g) * 4).to(dtype)
    if unsigned:
        x = x.float().relu().to(dtype)
    amax = torch.rand(64, 1, 1, 1, generator=g) * 6 if per_channel else torch.rand((), generator=g) * 6
    for narrow in (False, True) if not unsigned else (False,):
        (cpu_out, cpu_q, cpu_grad), (gpu_out, gpu_q, gpu_grad) = _cpu_and_cuda(x, amax, num_bits, unsigned, narrow)
        assert torch.equal(cpu_out, gpu_out) and torch.equal(cpu_q, gpu_q) and torch.equal(cpu_grad, gpu_grad)


@pytest.mark.gpu
def test_cuda_step_equals_numpy_and_channels_last_works():
    amax = _amaxes()
    for bits, unsigned in _CONFIGS:
        got = quant_step(torch.from_numpy(amax).cuda(), bits, unsigned).cpu().numpy()
        np.testing.assert_array_equal(got, amax / np.float32(max_bound(bits, unsigned)))
    x = torch.randn(8, 16, 7, 7, device="cuda").to(memory_format=torch.channels_last)
    out = fake_tensor_quant(x, torch.tensor(2.0, device="cuda"))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out.cpu(), fake_tensor_quant(x.cpu().contiguous(), 2.0))


@pytest.mark.gpu
def test_cuda_uses_the_triton_kernel():
    if ops._triton_module() is None:
        pytest.skip("triton is not installed")
    x = torch.randn(1000, device="cuda")
    assert ops._triton_layout(x, torch.tensor(1.0, device="cuda")) == 1000
    qmin, qmax = quant_bounds(8)
    assert torch.equal(
        ops._quantize_cuda(x, torch.tensor(1.5, device="cuda"), qmin, qmax, True),
        ops._quantize_aten(x, torch.tensor(1.5, device="cuda"), qmin, qmax, True),
    )

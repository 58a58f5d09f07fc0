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


@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 255), (-8, 7)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_eager_entry_point_equals_the_operator_in_value_and_gradient(qmin, qmax, per_channel):
    g = torch.Generator().manual_seed(qmax)
    x = torch.randn(6, 4, 5, generator=g) * 3
    amax = torch.rand(6, 1, 1, generator=g) * 4 if per_channel else torch.tensor(2.5)
    grad = torch.randn(6, 4, 5, generator=g)
    results = []
    for fn in (ops.quantize_ste, torch.ops.qdq.quantize):
        xg = x.clone().requires_grad_(True)
        out = fn(xg, amax, qmin, qmax, True)
        out.backward(grad)
        results.append((out.detach(), xg.grad, type(out.grad_fn).__name__))
    (eager, eager_grad, eager_node), (op, op_grad, op_node) = results
    assert torch.equal(eager, op) and torch.equal(eager_grad, op_grad)
    lo = 0.0 if qmin == 0 else -amax
    assert torch.equal(eager_grad, grad * ((x >= lo) & (x <= amax)))  # the straight-through mask, inclusive
    assert eager_node == "_StraightThroughBackward" and eager_node != op_node  # eager skips the op's dispatch
    with torch.no_grad():
        assert ops.quantize_ste(x.requires_grad_(True), amax, qmin, qmax, True).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 255)])
def test_low_precision_gradient_keeps_the_float32_edge_of_the_range(dtype, qmin, qmax):
    # amax lies a quarter step below ``up``, the data type's next value after 3.0, so it rounds to ``up`` in that
    # type. The forward clamps in float32, so the straight-through mask must too: 3.0 passes, ``up`` is clipped
    # (found on a GPU, whose Triton kernel compares in float32, against this CPU path, which compared in the
    # data's type and let ``up`` through).
    up = torch.nextafter(torch.tensor(3.0, dtype=dtype), torch.tensor(4.0, dtype=dtype)).item()
    amax = torch.tensor(up - (up - 3.0) / 4)
    assert amax.to(dtype).item() == up
    x = torch.tensor([3.0, up, -3.0, 1.0], dtype=dtype)
    xg = x.clone().requires_grad_(True)
    ops.quantize_ste(xg, amax, qmin, qmax, True).backward(torch.ones_like(x))
    lo = 0.0 if qmin == 0 else -amax
    expected = ((x.float() >= lo) & (x.float() <= amax)).to(dtype)  # hand-checked: [1, 0, 1 signed / 0 unsigned, 1]
    assert expected.tolist() == [1.0, 0.0, float(qmin < 0), 1.0]
    assert xg.grad.dtype == dtype and torch.equal(xg.grad, expected)


@pytest.mark.parametrize(("num_bits", "unsigned"), [(2, False), (8, False), (8, True), (16, False), (16, True)])
def test_round_to_grid_equals_numpy_at_the_edges_of_the_rounding_trick(num_bits, unsigned):
    # the rounding constant 1.5 * 2**23 is added before the clamp: quotients beyond +-2**22 (where the sum
    # leaves [2**23, 2**24)), ties, signed zeros and non-finite values must still give QuantizeLinear's codes
    qmin, qmax = quant_bounds(num_bits, unsigned)
    step = np.float32(0.5)
    edges = [2.0**22, 2.0**23, 2.0**24, 3.0 * 2**22, 1e30, np.inf, qmax, qmax + 0.5, qmin - 0.5, 0.5, 1.5]
    edges = np.array(edges, np.float32)
    inward = np.nextafter(edges, np.float32(0))
    x = np.concatenate([edges, -edges, inward, -inward, np.float32([0.0, -0.0])]) * step
    rng = np.random.default_rng(num_bits)
    x = np.concatenate([x, (rng.integers(qmin - 3, qmax + 3, 5000) + 0.5).astype(np.float32) * step])
    got = ops.round_to_grid(torch.from_numpy(x), torch.tensor(step), qmin, qmax).numpy()
    expected = np.clip(np.rint(x / step), qmin, qmax).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    assert not np.signbit(got[got == 0]).any()  # +0 for -0 and small negatives, as QuantizeLinear gives
    nan = ops.round_to_grid(torch.tensor([float("nan")]), torch.tensor(step), qmin, qmax)
    assert torch.isnan(nan).all()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_aten_bit_for_bit_under_the_interpreter():
    script = Path(__file__).with_name("_triton_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    histograms = 0 if "skip histograms" in done.stdout else 9  # an old interpreter (the GPU tests then cover it)
    assert done.stdout.count("ok ") == 17 + histograms  # quantization cases, then histogram cases


# -- CUDA (skipped without a GPU) --------------------------------------------------------------------


def _cpu_and_cuda(x: torch.Tensor, amax: torch.Tensor, bits: int, unsigned: bool, narrow: bool):
    results = []
    for device in ("cpu", "cuda"):
        xd = x.detach().clone().to(device).requires_grad_(True)  # a leaf on each device
        out = fake_tensor_quant(xd, amax.to(device), bits, unsigned, narrow)
        q, _ = tensor_quant(xd.detach(), amax.to(device), bits, unsigned, narrow)
        out.backward(torch.ones_like(out))
        results.append((out.detach().cpu(), q.cpu(), xd.grad.cpu()))
    return results


_KERNEL_SIGNATURES = {
    "_quantize_kernel": dict(x_ptr="*bf16", amax_ptr="*fp32", out_ptr="*bf16", n="i32", inner="i32",
                             channels="i32", qmin="fp32", qmax="fp32", PER_TENSOR="constexpr",
                             DEQUANTIZE="constexpr", BLOCK="constexpr"),
    "_quantize_backward_kernel": dict(grad_ptr="*fp32", x_ptr="*fp32", amax_ptr="*fp32", out_ptr="*fp32", n="i32",
                                      inner="i32", channels="i32", PER_TENSOR="constexpr", UNSIGNED="constexpr",
                                      BLOCK="constexpr"),
    "_histogram_kernel": dict(x_ptr="*fp32", scale_ptr="*fp32", counts_ptr="*i32", n="i32", NUM_BINS="constexpr",
                              UNSIGNED="constexpr", COUNT_ZEROS="constexpr", BLOCK="constexpr"),
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("kernel", sorted(_KERNEL_SIGNATURES))
@pytest.mark.parametrize("per_tensor", [True, False])
def test_triton_kernels_compile_for_hopper_without_a_gpu(kernel, per_tensor):
    """The real compiler (to a cubin for sm_90), which the interpreter skips: it rejects what the interpreter runs
    (a non-constexpr global, two returns of different shapes), found only on a GPU before this test."""
    import triton
    from triton.backends.compiler import GPUTarget

    from qdq import triton_kernels

    flags = {"PER_TENSOR": per_tensor, "DEQUANTIZE": True, "UNSIGNED": False, "BLOCK": 1024, "NUM_BINS": 4096,
             "COUNT_ZEROS": per_tensor}
    signature = _KERNEL_SIGNATURES[kernel]
    source = triton.compiler.ASTSource(
        fn=getattr(triton_kernels, kernel),
        signature=signature,
        constexprs={name: value for name, value in flags.items() if name in signature},
    )
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


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
def test_cuda_uses_the_triton_kernels_in_both_directions(monkeypatch):
    kernels = ops._triton_module()
    if kernels is None:
        pytest.skip("triton is not installed")
    calls = []
    for name in ("quantize_triton", "quantize_backward_triton"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = torch.randn(1000, device="cuda", requires_grad=True)
    amax = torch.tensor(1.5, device="cuda")
    out = fake_tensor_quant(x, amax)
    out.backward(torch.ones_like(out))
    assert calls == ["quantize_triton", "quantize_backward_triton"]
    qmin, qmax = quant_bounds(8)
    assert torch.equal(out.detach(), ops._quantize_aten(x.detach(), amax, qmin, qmax, True))

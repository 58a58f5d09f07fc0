"""Run qdq's Triton kernels under the Triton interpreter (CPU) and compare them with the ATen operator.

Executed in a subprocess by tests/test_triton_kernels.py with TRITON_INTERPRET=1 (which must be set before
triton is imported). Prints one line per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from qdq import ops
from qdq.calib import binning
from qdq.calib.base import resolve_layout
from qdq.triton_kernels import quantize_backward_triton, quantize_triton


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 7, generator=g) * 3
    x.view(-1)[:4] = torch.tensor([float("nan"), 0.5, -0.5, 2.5])
    per_tensor = torch.tensor(2.0)
    per_channel0 = torch.rand(6, 1, 1, generator=g) * 4
    per_channel0[1] = 0.0  # a tiny channel quantizes to zeros
    per_channel1 = torch.rand(1, 5, 1, generator=g) * 4
    grids = [(8, False, False), (8, False, True), (8, True, False), (4, False, False), (4, True, False)]
    for bits, unsigned, narrow in grids:
        qmin, qmax = ops_bounds(bits, unsigned, narrow)
        for name, amax in [("tensor", per_tensor), ("axis0", per_channel0), ("axis1", per_channel1)]:
            yield f"{bits}bit unsigned={unsigned} narrow={narrow} {name}", x, amax, qmin, qmax, unsigned
    yield "bf16 per tensor", x.bfloat16(), per_tensor, -128, 127, False
    yield "fp16 axis0", x.half(), per_channel0, -128, 127, False


def ops_bounds(bits, unsigned, narrow):
    qmax = 2 ** (bits - 1 + int(unsigned)) - 1
    return (0 if unsigned else (-qmax if narrow else -qmax - 1)), qmax


def _inner(x, amax):
    varying = [d for d, n in enumerate(amax.shape) if n != 1]
    return x.numel() if not varying else int(np.prod(x.shape[varying[0] + 1 :]))


def main() -> int:
    for label, x, amax, qmin, qmax, unsigned in _cases():
        inner = _inner(x, amax)
        flat = amax.float().contiguous().reshape(-1)
        for dequantize in (True, False):
            # float32 output: the interpreter truncates float downcasts (a GPU rounds to nearest even,
            # checked by the GPU tests), so low-precision inputs are compared before the final cast.
            got = quantize_triton(x, flat, inner, qmin, qmax, dequantize, out_dtype=torch.float32)
            want = ops._quantize_aten(x.float(), amax, qmin, qmax, dequantize)
            if not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
                print(f"MISMATCH forward {label} dequantize={dequantize}")
                return 1
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
        got = quantize_backward_triton(grad, x, flat, inner, unsigned)
        want = ops._quantize_grad_aten(grad, x, amax, unsigned)
        if not torch.equal(got, want):
            print(f"MISMATCH backward {label}")
            return 1
        print(f"ok {label}")
    return _histograms()


def _histograms() -> int:
    """The Triton histogram equals the scatter_add_ path (no per-tensor kernel) on data with zeros, negatives,
    magnitudes below one bin and on bin edges, spread over both interpreter programs."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(3000, generator=g).relu() * 3, torch.randn(2000, generator=g) * 2])
    x = torch.cat([x, torch.tensor([0.0, 2.0**-30, 1.0 - 2.0**-24, 1.0, -1.0, -0.0])])
    exponent = binning.range_exponent(x.abs().amax().reshape(1))
    layout = resolve_layout(None, x.shape)
    for num_bins in (128, 4096):
        for unsigned in (False, True):
            for skip_zeros in (False, True):
                label = f"histogram bins={num_bins} unsigned={unsigned} skip_zeros={skip_zeros}"
                scale = (binning._pow2(-exponent) * num_bins).float().reshape(())
                try:
                    got = binning._histogram_triton(x, scale, num_bins, unsigned=unsigned, skip_zeros=skip_zeros)
                except Exception as error:  # Triton < 3.7's interpreter under NumPy 2: int() of a 1-element array
                    if "only 0-dimensional arrays" not in str(error):
                        raise
                    print(f"skip histograms: this Triton's interpreter cannot run a loop over a program id ({error})")
                    return 0
                kernel, binning._per_tensor_kernel = binning._per_tensor_kernel, lambda *args: None
                try:
                    want = binning.histogram(x, exponent, layout, num_bins, unsigned=unsigned, skip_zeros=skip_zeros)
                finally:
                    binning._per_tensor_kernel = kernel
                if not torch.equal(got, want):
                    print(f"MISMATCH {label}")
                    return 1
                print(f"ok {label}")
    return _chunked(x, exponent, layout)


def _chunked(x: torch.Tensor, exponent: torch.Tensor, layout) -> int:
    """A tensor longer than one launch takes (the chunk made small): the launches' counts add up to one histogram."""
    from qdq import triton_kernels

    scale = (binning._pow2(-exponent) * 4096).float().reshape(())
    chunk, triton_kernels.HISTOGRAM_CHUNK = triton_kernels.HISTOGRAM_CHUNK, 1000
    try:
        got = binning._histogram_triton(x, scale, 4096, unsigned=False, skip_zeros=False)
    finally:
        triton_kernels.HISTOGRAM_CHUNK = chunk
    kernel, binning._per_tensor_kernel = binning._per_tensor_kernel, lambda *args: None
    try:
        want = binning.histogram(x, exponent, layout, 4096, unsigned=False, skip_zeros=False)
    finally:
        binning._per_tensor_kernel = kernel
    if not torch.equal(got, want):
        print("MISMATCH histogram in chunks of 1000")
        return 1
    print("ok histogram in chunks of 1000")
    return 0


if __name__ == "__main__":
    sys.exit(main())

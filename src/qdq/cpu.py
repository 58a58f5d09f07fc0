"""The one CPU fact qdq's exports and runtimes depend on: do this CPU's int8 dot products saturate?

ONNX Runtime (MLAS) and oneDNN multiply uint8 activations by int8 weights. On x86 CPUs with VNNI
(``avx512_vnni``, ``avx_vnni``, AMX) one instruction sums four ``u8 * s8`` products into int32, exactly.
On x86 CPUs without it (AVX2 and AVX-512 before Cascade Lake, AMD before Zen 4) the kernels use
``vpmaddubsw``, which adds *pairs* of products into int16 with saturation: ``255 * 127 + 255 * 127 =
64770`` does not fit, and the int8 engine silently computes something else (ONNX Runtime's documentation
calls this the U8S8 saturation issue). A pair cannot saturate when its two weights sum to at most 128 in
magnitude, i.e. when every weight is in ``[-64, 64]`` (``255 * 128 = 32640``): :data:`SAFE_WEIGHT_MAGNITUDE`.
uint8 weights (ONNX Runtime's U8U8 kernels widen to int16 first) never saturate.

ARM CPUs (``sdot``/``udot`` or widening multiplies) do not saturate.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = ["SAFE_WEIGHT_MAGNITUDE", "VNNI_FLAGS", "cpu_flags", "int8_dot_saturates"]

#: int8 weights of at most this magnitude never saturate a ``u8 * s8`` pair sum (see the module doc)
SAFE_WEIGHT_MAGNITUDE = 64
#: ``/proc/cpuinfo`` flags of the x86 instructions that compute ``u8 * s8`` dot products without saturation
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux's ``/proc/cpuinfo`` lists them (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def int8_dot_saturates() -> bool:
    """True on an x86 CPU without VNNI, where int8 engines saturate ``u8 * s8`` pair sums.

    Where the flags cannot be read (an x86 system without ``/proc/cpuinfo``), torch's own detection of
    AVX-512 VNNI is asked, and without an answer the CPU is assumed to saturate: the exact encoding (uint8
    weights) is then chosen, which costs speed on a VNNI CPU but is never wrong.
    """
    if platform.machine().lower() not in _X86:
        return False
    flags = cpu_flags()
    if flags:
        return not (flags & VNNI_FLAGS)
    return not _torch_reports_vnni()


def _torch_reports_vnni() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_avx512_vnni_supported())  # type: ignore[attr-defined]  # private (torch >= 2.1): not in its stubs
    except (ImportError, AttributeError, RuntimeError):
        return False

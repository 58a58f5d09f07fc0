"""qdq.cpu: which CPUs saturate int8 dot products (x86 without VNNI), from the flags Linux lists."""

from __future__ import annotations

import pytest

import qdq.cpu as cpu


@pytest.fixture(autouse=True)
def fresh_cache():
    cpu.cpu_flags.cache_clear()
    cpu.int8_dot_saturates.cache_clear()
    yield
    cpu.cpu_flags.cache_clear()
    cpu.int8_dot_saturates.cache_clear()


@pytest.mark.parametrize(
    ("machine", "flags", "saturates"),
    [
        ("x86_64", {"sse4_1", "avx", "avx2", "fma"}, True),  # AVX2 only (this project's 2-core VMs)
        ("x86_64", {"avx2", "avx512f", "avx512bw"}, True),  # Skylake-SP: AVX-512 without VNNI
        ("x86_64", {"avx2", "avx512f", "avx512_vnni"}, False),  # Cascade Lake, Zen 4
        ("x86_64", {"avx2", "avx_vnni"}, False),  # Alder Lake
        ("AMD64", {"avx2"}, True),
        ("aarch64", {"asimd", "asimddp"}, False),  # ARM: no saturating instruction
        ("arm64", set(), False),
    ],
)
def test_saturation_by_flags(monkeypatch, machine, flags, saturates):
    monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert cpu.int8_dot_saturates() is saturates


def test_unreadable_flags_ask_torch_then_assume_the_exact_encoding(monkeypatch):
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(cpu, "_torch_reports_vnni", lambda: True)
    assert cpu.int8_dot_saturates() is False
    cpu.int8_dot_saturates.cache_clear()
    monkeypatch.setattr(cpu, "_torch_reports_vnni", lambda: False)
    assert cpu.int8_dot_saturates() is True


def test_flags_are_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512_vnni\n\n")
    monkeypatch.setattr(cpu, "Path", lambda _: info)
    assert cpu.cpu_flags() == frozenset({"fpu", "sse", "avx2", "avx512_vnni"})


def test_the_safe_magnitude_cannot_overflow_a_pair():
    # vpmaddubsw: u8 * s8 + u8 * s8 into int16
    assert 255 * cpu.SAFE_WEIGHT_MAGNITUDE * 2 <= 2**15 - 1 < 255 * (cpu.SAFE_WEIGHT_MAGNITUDE + 1) * 2

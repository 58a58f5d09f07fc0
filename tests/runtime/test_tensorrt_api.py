"""The TensorRT backend's use of the TensorRT API, against a stand-in ``tensorrt`` module (no TensorRT, no GPU).

What is checked: the network is strongly typed (TensorRT 10: the ``STRONGLY_TYPED`` flag; 11: no flag, strong
typing is always on), no precision flag is ever set on the builder config (a TensorRT 11 config has none),
an older TensorRT is refused with an upgrade hint, and a graph that breaks TensorRT's rules is refused before
any builder exists, naming the rules.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from qdq.errors import QdqBackendUnavailable, QdqConfigError
from qdq.runtime.tensorrt import TensorRtRuntime, build_engine, network_flags, tensorrt_version


class _Config:
    def __init__(self, log: dict) -> None:
        self.log = log

    def set_memory_pool_limit(self, pool: object, size: int) -> None:
        self.log["workspace"] = size

    def add_optimization_profile(self, profile: object) -> None:
        self.log["profile"] = profile

    def set_flag(self, flag: object) -> None:  # TensorRT 11 has no precision flags at all
        raise AssertionError(f"a builder flag was set: {flag}")


class _Profile:
    def __init__(self, log: dict) -> None:
        self.shapes = log.setdefault("shapes", {})

    def set_shape(self, name: str, low: list, opt: list, high: list) -> None:
        self.shapes[name] = (low, opt, high)


def fake_tensorrt(version: str, *, parses: bool = True) -> tuple[types.ModuleType, dict]:
    """A module with the parts of the TensorRT Python API that ``build_engine`` uses, recording the calls."""
    log: dict = {"builders": 0}
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class Builder:
        def __init__(self, logger: Logger) -> None:
            log["builders"] += 1

        def create_network(self, flags: int) -> SimpleNamespace:
            log["network_flags"] = flags
            tensor = SimpleNamespace(name="input", shape=[-1, 3, 8, 8])
            return SimpleNamespace(num_inputs=1, get_input=lambda i: tensor)

        def create_builder_config(self) -> _Config:
            return _Config(log)

        def create_optimization_profile(self) -> _Profile:
            return _Profile(log)

        def build_serialized_network(self, network: object, config: object) -> bytes:
            return b"plan"

    class OnnxParser:
        num_errors = 0 if parses else 1

        def __init__(self, network: object, logger: Logger) -> None:
            pass

        def parse_from_file(self, path: str) -> bool:
            log["parsed"] = path
            return parses

        def get_error(self, i: int) -> str:
            return "node 3 (Conv): unsupported"

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    trt.NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=1)
    trt.MemoryPoolType = SimpleNamespace(WORKSPACE=0)
    return trt, log


@pytest.fixture
def use_tensorrt(monkeypatch):
    def install(version: str, **kwargs) -> dict:
        trt, log = fake_tensorrt(version, **kwargs)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        return log

    return install


@pytest.mark.parametrize(
    ("version", "expected"), [("11.4.0", (11, 4)), ("10.12.0.36", (10, 12)), ("8.6.1.post1", (8, 6))]
)
def test_version_is_parsed(version, expected):
    assert tensorrt_version(SimpleNamespace(__version__=version)) == expected


def test_tensorrt_11_builds_without_flags(use_tensorrt, trt_onnx: Path):
    log = use_tensorrt("11.4.0")
    assert build_engine(trt_onnx, batch=4, workspace_mib=64) == b"plan"
    assert log["network_flags"] == 0  # strongly typed always; the deprecated flag is not passed
    assert log["parsed"] == str(trt_onnx) and log["workspace"] == 64 << 20
    assert log["shapes"]["input"] == ([1, 3, 8, 8], [4, 3, 8, 8], [4, 3, 8, 8])


def test_tensorrt_10_asks_for_a_strongly_typed_network(use_tensorrt, trt_onnx: Path):
    log = use_tensorrt("10.12.0.36")
    build_engine(trt_onnx)
    assert log["network_flags"] == 1 << 1  # 1 << STRONGLY_TYPED


@pytest.mark.parametrize("version", ["8.6.1", "9.3.0"])
def test_older_tensorrt_is_refused(use_tensorrt, trt_onnx: Path, version):
    log = use_tensorrt(version)
    with pytest.raises(QdqBackendUnavailable, match=r"TensorRT >= 10.*pip install"):
        build_engine(trt_onnx)
    assert log["builders"] == 0
    with pytest.raises(QdqBackendUnavailable, match="too old"):
        TensorRtRuntime.load(trt_onnx)  # refused before the GPU is looked for


def test_graph_breaking_tensorrt_rules_is_refused_before_building(use_tensorrt, u8_onnx: Path):
    log = use_tensorrt("11.4.0")
    with pytest.raises(QdqConfigError, match=r"breaks TensorRT's rules \(.*int8-type.*qdq check"):
        build_engine(u8_onnx)
    assert log["builders"] == 0
    assert build_engine(u8_onnx, check=False) == b"plan"  # the caller can still try


def test_parser_errors_are_reported(use_tensorrt, trt_onnx: Path):
    use_tensorrt("11.4.0", parses=False)
    with pytest.raises(QdqConfigError, match=r"cannot parse .*unsupported"):
        build_engine(trt_onnx)


def test_fp32_graph_builds(use_tensorrt, fp32_onnx: Path):
    log = use_tensorrt("11.4.0")
    assert build_engine(fp32_onnx) == b"plan" and log["network_flags"] == 0


def test_missing_tensorrt_says_how_to_install(monkeypatch, trt_onnx: Path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails
    with pytest.raises(QdqBackendUnavailable, match="pip install"):
        build_engine(trt_onnx)


def test_network_flags_of_each_major():
    ten, _ = fake_tensorrt("10.0.1")
    eleven, _ = fake_tensorrt("11.0.0")
    assert (network_flags(ten), network_flags(eleven)) == (2, 0)


def test_fp16_file_builds_strongly_typed(use_tensorrt, vit_fp16_onnx):
    """A TensorRT 11 file (INT8 Q/DQ, float16 elsewhere) passes the rule check and builds with no flags."""
    log = use_tensorrt("11.4.0")
    path, _ = vit_fp16_onnx
    assert build_engine(path) == b"plan" and log["network_flags"] == 0 and log["parsed"] == str(path)

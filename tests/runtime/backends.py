"""Skip markers for tests that need an optional runtime backend: they skip cleanly where it is not installed
(e.g. a CUDA machine without openvino), instead of failing on the import."""

from __future__ import annotations

import importlib.util

import pytest


def installed(package: str) -> bool:
    """Is ``package`` importable here (without importing it)?"""
    return importlib.util.find_spec(package) is not None


requires_openvino = pytest.mark.skipif(not installed("openvino"), reason="openvino is not installed")
requires_onnxruntime = pytest.mark.skipif(not installed("onnxruntime"), reason="onnxruntime is not installed")

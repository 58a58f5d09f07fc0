"""Every ``"tensorrt"``-target ONNX file the test suite exports is checked against TensorRT's rules.

:func:`checked_finish_onnx` wraps :func:`qdq.export.onnx_export.finish_onnx` (the common end of every qdq
export, PyTorch and Keras): after the file is written, a ``"tensorrt"`` export goes through
:func:`qdq.targets.tensorrt.check.check_tensorrt` and the test fails on any violation. A test that exports a graph
TensorRT cannot take on purpose names the rules it breaks with
``@pytest.mark.trt_rules_exempt("rule", ..., reason="...")``; any other broken rule still fails it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import pytest


def checked_finish_onnx(finish: Callable[..., Any], exempt: Iterable[str]) -> Callable[..., Any]:
    """``finish_onnx`` followed by the TensorRT rule check of a ``"tensorrt"`` export."""
    allowed = frozenset(exempt)

    @functools.wraps(finish)
    def finish_and_check(proto: Any, path: Any, target: Any, **kwargs: Any) -> Any:
        from qdq.targets.tensorrt.check import check_tensorrt

        written = finish(proto, path, target, **kwargs)
        if getattr(target, "name", None) == "tensorrt":
            report = check_tensorrt(written)
            broken = [v for v in report.violations if v.rule not in allowed]
            if broken:
                pytest.fail(f"the tensorrt export {written} breaks TensorRT's rules:\n{report}", pytrace=False)
        return written

    return finish_and_check


def exempt_rules(node: Any) -> set[str]:
    """The rules a test's ``trt_rules_exempt`` markers allow its exports to break."""
    return {rule for marker in node.iter_markers("trt_rules_exempt") for rule in marker.args}

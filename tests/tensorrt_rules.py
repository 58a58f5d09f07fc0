"""Every ``"tensorrt"``-target ONNX file the test suite exports is checked against TensorRT's rules.

The export already checks each file it writes against its target's rules (``Target.rule_check``; TensorRT's:
:func:`qdq.targets.tensorrt.check.check_tensorrt`) and warns once when some are broken
(``qdq.export.onnx_export._warn_broken_rules``). :func:`failing_rule_warning` wraps that step so that the test fails
on any violation instead, from the same report. A test that exports a graph TensorRT cannot take on purpose names
the rules it breaks with ``@pytest.mark.trt_rules_exempt("rule", ..., reason="...")``; its export then warns as
it does for a user, and any other broken rule still fails it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import pytest


def failing_rule_warning(warn: Callable[..., None], exempt: Iterable[str]) -> Callable[..., None]:
    """The export's rule check (``warn``: ``_warn_broken_rules(model, target, path)``), failing the test on a
    violation of a rule not in ``exempt``."""
    allowed = frozenset(exempt)

    @functools.wraps(warn)
    def check(model: Any, target: Any, path: Any) -> None:
        if target.rule_check is None:
            return
        report = target.rule_check(model)
        if any(v.rule not in allowed for v in report.violations):
            pytest.fail(f"the {target.name} export {path} breaks its runtime's rules:\n{report}", pytrace=False)
        if report.violations:
            warn(model, target, path)  # the exempt rules: the user's warning (checked once more, as a user's is)

    return check


def exempt_rules(node: Any) -> set[str]:
    """The rules a test's ``trt_rules_exempt`` markers allow its exports to break."""
    return {rule for marker in node.iter_markers("trt_rules_exempt") for rule in marker.args}

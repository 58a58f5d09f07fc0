"""Select parameters by name, build optimizer groups, freeze, and bake quantized weights in place."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from qdq.errors import QdqConfigError, QdqTypeError

__all__ = ["freeze_parameters", "group_parameters", "match_parameters", "quant_weight_inplace"]


def match_parameters(model: nn.Module, patterns: Sequence[str]) -> Iterator[nn.Parameter]:
    """Yield the parameters whose name matches any regular expression in ``patterns`` (``re.search``)."""
    compiled = [re.compile(p) for p in patterns]
    for name, param in model.named_parameters():
        if any(regex.search(name) for regex in compiled):
            yield param


def group_parameters(
    model: nn.Module,
    patterns_list: Sequence[Sequence[str]],
    lrs: Sequence[float] | None = None,
    momentums: Sequence[float] | None = None,
    weight_decays: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups, one per list of patterns, with optional per-group options."""
    if isinstance(patterns_list, str) or not all(isinstance(p, list | tuple) for p in patterns_list):
        raise QdqTypeError("patterns_list must be a list of lists of regular expressions, e.g. [['conv'], ['fc']].")
    groups: list[dict[str, Any]] = [{"params": list(match_parameters(model, p))} for p in patterns_list]
    for key, values in (("lr", lrs), ("momentum", momentums), ("weight_decay", weight_decays)):
        if values is None:
            continue
        if len(values) != len(groups):
            raise QdqConfigError(f"{key}s has {len(values)} values for {len(groups)} parameter groups.")
        for group, value in zip(groups, values):
            group[key] = value
    return groups


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> None:
    """Set ``requires_grad=False`` on the parameters matching ``patterns``."""
    for param in match_parameters(model, patterns):
        param.requires_grad = False


def quant_weight_inplace(model: nn.Module) -> None:
    """Replace each quantized module's weight by its fake-quantized value (weights then sit on the grid)."""
    with torch.no_grad():
        for module in model.modules():
            quantizer = getattr(module, "_weight_quantizer", None)
            weight = getattr(module, "weight", None)
            if quantizer is not None and isinstance(weight, torch.Tensor):
                weight.copy_(quantizer(weight))

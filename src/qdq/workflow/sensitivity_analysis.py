"""Per-layer sensitivity: which layers lose accuracy when quantized, and which to keep in float.

For each quantized layer, two scores: the model with **only** that layer quantized (how much this
layer alone costs), and with **every layer but** that one quantized (how much is recovered by keeping it
float). ``keep_float(model, names)`` applies the answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from qdq.errors import QdqConfigError
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer

__all__ = ["LayerSensitivity", "SensitivityResult", "keep_float", "layer_quantizers", "sensitivity"]

EvalFn = Callable[[nn.Module], float]


def layer_quantizers(model: nn.Module) -> dict[str, list[TensorQuantizer]]:
    """Quantized layers by name, each with its own (direct) quantizers; ModuleLists of quantizers included."""
    layers: dict[str, list[TensorQuantizer]] = {}
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer | nn.ModuleList):
            continue
        own: list[TensorQuantizer] = []
        for child in module.children():
            if isinstance(child, TensorQuantizer):
                own.append(child)
            elif isinstance(child, nn.ModuleList):
                own += [m for m in child if isinstance(m, TensorQuantizer)]
        if own:
            layers[name] = own
    return layers


@dataclass
class LayerSensitivity:
    name: str
    only_this_quantized: float
    all_but_this_quantized: float


@dataclass
class SensitivityResult:
    float_score: float
    quantized_score: float
    layers: list[LayerSensitivity]

    def most_sensitive(self, count: int = 3) -> list[str]:
        """Layers whose float-keeping recovers most (highest all-but-this score first)."""
        ranked = sorted(self.layers, key=lambda item: item.all_but_this_quantized, reverse=True)
        return [item.name for item in ranked[:count]]

    def table(self) -> str:
        """A line with the float and fully quantized scores, then a Markdown table of the layers."""
        rows = [[s.name, f"{s.only_this_quantized:.2f}", f"{s.all_but_this_quantized:.2f}"] for s in self.layers]
        table = markdown_table(["layer", "only this quantized", "all but this quantized"], rows)
        return f"float {self.float_score:.2f}, fully quantized {self.quantized_score:.2f}\n\n{table}"


@contextlib.contextmanager
def _enabled_only(model: nn.Module, enabled: set[int]) -> Iterator[None]:
    """Only the quantizers whose ``id`` is in ``enabled`` (and were enabled already) stay enabled."""
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    saved = [q.is_enabled for q in quantizers]
    try:
        for quantizer in quantizers:
            if id(quantizer) not in enabled:
                quantizer.disable()
        yield
    finally:
        for quantizer, was_enabled in zip(quantizers, saved):
            if was_enabled:
                quantizer.enable()


def sensitivity(model: nn.Module, eval_fn: EvalFn, layers: Sequence[str] | None = None) -> SensitivityResult:
    """Score ``model`` with one layer quantized at a time, and with one layer float at a time.

    The model must be calibrated; quantizers already disabled stay disabled.
    """
    by_layer = layer_quantizers(model)
    names = list(by_layer) if layers is None else list(layers)
    unknown = [n for n in names if n not in by_layer]
    if unknown:
        raise QdqConfigError(f"not quantized layers: {unknown[:5]}; quantized layers are e.g. {list(by_layer)[:5]}.")
    every = {id(q) for qs in by_layer.values() for q in qs}
    with _enabled_only(model, set()):
        float_score = float(eval_fn(model))
    quantized_score = float(eval_fn(model))
    results = []
    for name in names:
        own = {id(q) for q in by_layer[name]}
        with _enabled_only(model, own):
            only = float(eval_fn(model))
        with _enabled_only(model, every - own):
            all_but = float(eval_fn(model))
        results.append(LayerSensitivity(name, only, all_but))
    return SensitivityResult(float_score, quantized_score, results)


def keep_float(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """Disable the quantizers of the named layers (they then run in float, and export without Q/DQ)."""
    by_layer = layer_quantizers(model)
    unknown = [n for n in names if n not in by_layer]
    if unknown:
        raise QdqConfigError(f"keep_float: {unknown} are not quantized layers of this model.")
    for name in names:
        for quantizer in by_layer[name]:
            quantizer.disable()
    return model

"""SmoothQuant-style input smoothing: move activation outliers of Linear inputs into the weights.

A few channels of a transformer's Linear inputs are often tens of times larger than the rest; one per-tensor
int8 scale for the input then leaves the other channels a handful of levels. SmoothQuant (Xiao et al., 2023)
divides input channel ``j`` by ``s_j`` and multiplies weight column ``j`` by it, which leaves ``x Wᵀ``
unchanged::

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)        (alpha = 0.5 by default)

:func:`smooth_inputs` measures ``max|x_j|`` on calibration data (float: quantizers disabled), computes ``s``
and applies it, **before calibration** (the ranges are then calibrated on the smoothed model):

* each weight becomes ``W * s`` (per input column), in place;
* the division by ``s`` is **folded** into the LayerNorm that produces the input when that is exact: the
  LayerNorm's output feeds only Linears (``qkv`` after ``norm1``; ``fc1`` after ``norm2`` in a pre-LN block), so
  ``weight / s`` and ``bias / s`` make it produce ``x / s``. All Linears reading one LayerNorm share one ``s``
  (the max over their weights). The fold is checked on the first batch: the model's float output must not
  change; where it does (the LayerNorm's output also feeds a residual add, as in post-LN BERT) it is undone;
* otherwise the Linear's input quantizer gets ``pre_quant_scale = 1 / s`` (its forward multiplies by it before
  quantizing; exported as a ``Mul`` before the ``QuantizeLinear``).

Either way the PyTorch model and its export compute the same thing: a fold only changes parameters, and
``pre_quant_scale`` is part of the quantizer's forward in both. Calibrate (:func:`qdq.calibrate`) afterwards: the
weight ranges change with ``W * s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.markdown import markdown_table
from qdq.quantizer import TensorQuantizer, disabled_quantizers
from qdq.utils.batches import call_model, flatten_outputs
from qdq.utils.modes import eval_mode
from qdq.workflow.collection import ForwardFn, _batches

__all__ = ["SmoothingResult", "smooth_inputs", "smoothing_scales"]

_FOLD_TOLERANCE = 1e-4  # relative change of the float output a fold may cause (float rounding only)


@dataclass
class SmoothingResult:
    """What :func:`smooth_inputs` did: ``scales`` (``s``) by Linear name; ``folded``: LayerNorm name -> the
    Linears whose ``1 / s`` it absorbed; ``pre_quant_scaled``: Linears whose input quantizer carries ``1 / s``."""

    alpha: float
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    folded: dict[str, list[str]] = field(default_factory=dict)
    pre_quant_scaled: list[str] = field(default_factory=list)

    def table(self) -> str:
        """One row per smoothed Linear: where ``1 / s`` went, and the range of ``s``."""
        into = {linear: norm for norm, linears in self.folded.items() for linear in linears}
        rows = [
            [name, f"folded into {into[name]}" if name in into else "pre_quant_scale",
             f"{float(s.min()):.3g}", f"{float(s.max()):.3g}"]
            for name, s in self.scales.items()
        ]  # fmt: skip
        return markdown_table(["Linear", "1/s applied as", "min s", "max s"], rows)


def smoothing_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = act_max ** alpha / weight_max ** (1 - alpha)`` per input channel; 1 where either max is 0."""
    if not 0.0 <= alpha <= 1.0:
        raise QdqConfigError(f"alpha must be in [0, 1], got {alpha}.")
    act, weight = act_max.double(), weight_max.double()
    scales = act.pow(alpha) / weight.pow(1.0 - alpha)
    usable = (act > 0) & (weight > 0) & torch.isfinite(scales)
    return torch.where(usable, scales, torch.ones_like(scales)).float()


def _smoothable(model: nn.Module) -> dict[str, nn.Linear]:
    """Quantized Linears whose input quantizer is enabled and has no ``pre_quant_scale`` yet."""
    found = {}
    for name, module in model.named_modules():
        quantizer = getattr(module, "input_quantizer", None)
        usable = isinstance(quantizer, TensorQuantizer) and quantizer.is_enabled and quantizer.pre_quant_scale is None
        if isinstance(module, nn.Linear) and usable:
            found[name] = module
    return found


class _Observer:
    """Per-input-channel max |x| of each Linear, and which LayerNorm produced each input (first batch)."""

    def __init__(self, model: nn.Module, linears: dict[str, nn.Linear]) -> None:
        self.act_max: dict[str, torch.Tensor] = {}
        self.producer: dict[str, str] = {}
        self._norm_outputs: dict[int, tuple[str, torch.Tensor]] = {}  # the tensor kept: its id stays unique
        self._first = True
        self._handles = [m.register_forward_pre_hook(self._linear_hook(n)) for n, m in linears.items()]
        self._handles += [m.register_forward_hook(self._norm_hook(n)) for n, m in model.named_modules()
                          if isinstance(m, nn.LayerNorm)]  # fmt: skip

    def _norm_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self._first:
                self._norm_outputs[id(out)] = (name, out)

        return hook

    def _linear_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            if self._first and id(args[0]) in self._norm_outputs:
                self.producer[name] = self._norm_outputs[id(args[0])][0]
            amax = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            self.act_max[name] = amax if name not in self.act_max else torch.maximum(self.act_max[name], amax)

        return hook

    def end_batch(self) -> None:
        self._first = False
        self._norm_outputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def smooth_inputs(
    model: nn.Module,
    data: Iterable[Any],
    alpha: float = 0.5,
    *,
    num_batches: int | None = None,
    fold: bool = True,
    forward_fn: ForwardFn | None = None,
) -> SmoothingResult:
    """Smooth the inputs of every quantized Linear of ``model`` (see the module doc); call before calibrating.

    Args:
        model: a quantized model (:func:`qdq.quantize_model`); changed in place.
        data: calibration batches (the convention of :func:`qdq.calibrate`).
        alpha: migration strength, in [0, 1]: 0 leaves the inputs alone, 1 moves all of their range into the
            weights; SmoothQuant's default 0.5.
        num_batches: batches used to measure the input ranges (default: all).
        fold: fold ``1 / s`` into the producing LayerNorm where that is exact; False always uses
            ``pre_quant_scale``.
        forward_fn: ``forward_fn(model, batch)`` for batches of another layout.

    Returns:
        A :class:`SmoothingResult`.

    Raises:
        QdqConfigError: no quantized Linear to smooth, ``alpha`` outside [0, 1], or empty data.
    """
    linears = _smoothable(model)
    if not linears:
        raise QdqConfigError("no quantized Linear with an enabled input quantizer to smooth; quantize the model first.")
    forward = forward_fn or call_model
    observer = _Observer(model, linears)
    batches = list(_batches(data, num_batches))
    try:
        with eval_mode(model), disabled_quantizers(model), torch.no_grad():
            for batch in batches:
                forward(model, batch)
                observer.end_batch()
            result = _apply(model, linears, observer, alpha, fold, lambda: forward(model, batches[0]))
    finally:
        observer.remove()
    return result


def _apply(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    observer: _Observer,
    alpha: float,
    fold: bool,
    run: Callable[[], Any],
) -> SmoothingResult:
    result = SmoothingResult(alpha)
    groups: dict[str, list[str]] = {}
    for name in linears:
        if name not in observer.act_max:
            continue  # not used on this data: left alone
        norm = observer.producer.get(name) if fold else None
        groups.setdefault(norm or f"\0{name}", []).append(name)
    reference = _outputs(run()) if fold else None
    modules = dict(model.named_modules())
    for key, names in groups.items():
        weight_max = torch.stack([linears[n].weight.detach().abs().amax(dim=0).float() for n in names]).amax(dim=0)
        scales = smoothing_scales(observer.act_max[names[0]], weight_max, alpha)
        for n in names:
            with torch.no_grad():
                linears[n].weight.mul_(scales.to(linears[n].weight.dtype))
            result.scales[n] = scales
        norm = None if key.startswith("\0") else modules[key]
        if norm is not None and _fold(norm, scales, run, reference):
            result.folded[key] = names
            continue
        for n in names:
            quantizer = cast(TensorQuantizer, linears[n].input_quantizer)  # each Linear _smoothable kept has one
            quantizer.pre_quant_scale = 1.0 / scales
            result.pre_quant_scaled.append(n)
    return result


def _outputs(out: Any) -> list[torch.Tensor]:
    return [o.detach().clone() for o in flatten_outputs(out) if isinstance(o, torch.Tensor)]


def _fold(norm: nn.Module, scales: torch.Tensor, run: Callable[[], Any], reference: list[torch.Tensor] | None) -> bool:
    """Divide the LayerNorm's affine parameters by ``scales``; keep it if the float output is unchanged."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if reference is None or weight is None or weight.shape != scales.shape:
        return False
    params = [p for p in (weight, bias) if p is not None]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param in params:
            param.div_(scales.to(param.dtype))
    if _same(_outputs(run()), reference):
        return True
    with torch.no_grad():
        for param, value in zip(params, saved):
            param.copy_(value)
    return False


def _same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    for g, e in zip(got, expected):
        scale = float(e.abs().max()) or 1.0
        if float((g - e).abs().max()) > _FOLD_TOLERANCE * scale:
            return False
    return True

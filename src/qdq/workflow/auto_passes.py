"""The passes over the calibration data that ``method="auto"`` (:mod:`qdq.workflow.auto_calibration`) runs.

* **Which layer each quantizer feeds** (:func:`layers_of`): the nearest enclosing quantized module that declares
  it, run with its weight quantizers; a quantizer no quantized module declares is measured at its own output.
* **The comparison pass** (:func:`compare`): each layer, in the order the model runs it, tries each candidate range
  of each of its quantizers on its input as quantized so far, adds the squared error of its output against its
  float output to that candidate's sum, and hands on its output at the best candidate yet (one forward for all
  candidates where the layer treats its samples independently).
* **The model check** (:func:`model_errors`): the whole model's output error with the chosen ranges and with the
  widest, on the scored samples.

Both score a share of the samples (:func:`scored`); their sums stay on the device and are summed across processes
under ``torch.distributed``. The choice among candidates is :mod:`qdq.workflow.auto_calibration`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.calib import distributed as calib_distributed
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer
from qdq.utils.batches import leading_samples, sample_count
from qdq.workflow.collection import ForwardFn, batch_total, local_batches, named_quantizers
from qdq.workflow.distributed import collective
from qdq.workflow.progress import Progress, progress_bar

__all__ = ["Errors", "Layer", "compare", "layers_of", "model_errors", "scored"]


# -- which layer each quantizer feeds ------------------------------------------------------------------------------


@dataclass
class Layer:
    """A module whose output is compared, with the quantizers tuned there and the weight quantizers it runs."""

    name: str
    module: nn.Module
    tuned: list[tuple[str, TensorQuantizer]]
    weights: list[TensorQuantizer]


def _owner(modules: dict[str, nn.Module], name: str, quantizer: TensorQuantizer) -> str | None:
    """Name of the nearest enclosing quantized module (:class:`~qdq.nn.base.QuantModule`) that lists
    ``quantizer`` among its :meth:`~qdq.nn.base.QuantModule.quantizers`, if any."""
    parts = name.split(".")
    for cut in range(1, len(parts)):
        parent = ".".join(parts[:-cut])
        module = modules.get(parent)
        if isinstance(module, QuantModule):
            return parent if any(q is quantizer for q in module.quantizers().values()) else None
    return None


def layers_of(model: nn.Module, names: list[str]) -> list[Layer]:
    modules = dict(model.named_modules())
    layers: dict[str, Layer] = {}
    for name in names:
        quantizer = modules[name]
        owner = _owner(modules, name, quantizer)
        layer_name = name if owner is None else owner
        if layer_name not in layers:
            module = modules[layer_name]
            weights = [] if owner is None else [
                q for q in module.quantizers().values() if q.is_weight and q.is_enabled and q.quant_enabled
            ]  # fmt: skip
            layers[layer_name] = Layer(layer_name, module, [], weights)
        layers[layer_name].tuned.append((name, quantizer))
    return list(layers.values())


# -- the comparison pass ------------------------------------------------------------------------------


@dataclass
class Errors:
    """Per quantizer: squared output error per candidate and the float output's energy (device tensors)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    energy: dict[str, torch.Tensor] = field(default_factory=dict)
    batches: int = 0
    samples: int = 0
    layer_runs: int = 0
    busy: bool = False  # a layer is being re-run: hooks of modules inside it stay out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, or nested tuples / lists / dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _squared_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(t**2)`` over the tensors, as a float64 scalar (each tensor summed in its own precision: torch's
    pairwise summation keeps float32 sums of millions of terms within about 1e-6)."""
    return sum((t.float().square().sum().double() for t in tensors), torch.zeros((), dtype=torch.float64))


def _squared_error(output: Any, reference: list[torch.Tensor]) -> torch.Tensor:
    return _squared_sum(torch.sub(g, r) for g, r in zip(_tensors(output), reference))


@contextlib.contextmanager
def _float_mode(model: nn.Module) -> Iterator[list[tuple[TensorQuantizer, bool]]]:
    """Every quantizer off (no quantization, no statistics), eval mode; yields the saved quant modes."""
    everything = [q for _, q in named_quantizers(model)]
    saved = [(q, q.quant_enabled, q.calib_enabled) for q in everything]
    was_training = model.training
    try:
        for quantizer in everything:
            quantizer.disable_quant()
            quantizer.disable_calib()
        model.eval()
        yield [(q, quant) for q, quant, _ in saved]
    finally:
        for quantizer, quant, calib in saved:
            (quantizer.enable_quant if quant else quantizer.disable_quant)()
            (quantizer.enable_calib if calib else quantizer.disable_calib)()
        model.train(was_training)


@contextlib.contextmanager
def _quantizing(ranges: list[tuple[TensorQuantizer, torch.Tensor]], weights: list[TensorQuantizer]) -> Iterator[None]:
    """Each quantizer of ``ranges`` quantizes with its range (:func:`_ranges`), and so do the layer's weight
    quantizers."""
    quantizers = (*(q for q, _ in ranges), *weights)
    with _ranges(ranges):
        try:
            for q in quantizers:
                q.enable_quant()
            yield
        finally:
            for q in quantizers:
                q.disable_quant()


@contextlib.contextmanager
def _ranges(ranges: list[tuple[TensorQuantizer, torch.Tensor]]) -> Iterator[None]:
    """Each quantizer with its range for a while (set without the checks of the ``amax`` setter, which read the
    device: the candidates were checked once)."""
    stored = [(quantizer, quantizer._amax) for quantizer, _ in ranges]
    try:
        for quantizer, amax in ranges:
            quantizer._amax = amax
        yield
    finally:
        for quantizer, amax in stored:
            quantizer._amax = amax


def scored(batches: Iterable[Any], fraction: float, errors: Errors) -> Iterator[Any]:
    """The batches cut to the samples scored: after ``n`` samples, ``ceil(n * fraction)`` of them, the first of
    each batch (a batch of no tensor counts as one sample); batches with none to score are skipped."""
    seen = 0
    for batch in batches:
        size = sample_count(batch)
        seen += 1 if size is None else size
        take = min(1 if size is None else size, math.ceil(seen * fraction - 1e-9) - errors.samples)
        if take > 0:
            errors.samples += take
            yield batch if size is None else leading_samples(batch, take)


def compare(
    model: nn.Module,
    module: nn.Module,
    data: Iterable[Any],
    layers: list[Layer],
    options: dict[str, dict[str, torch.Tensor]],
    budget: tuple[int | None, float],
    forward: ForwardFn,
    progress: Progress,
) -> Errors:
    """The comparison pass: each layer, in the order the model runs it, tries each candidate on its input as
    quantized so far and hands on its output at the best candidate yet (see the module docstring)."""
    errors = Errors()
    stacked: dict[str, torch.Tensor] = {}
    current: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name, quantizer in layer.tuned:
            device = quantizer.amax.device  # type: ignore[union-attr]  # a tuned quantizer is calibrated: amax set
            errors.sums[name] = torch.zeros(len(options[name]), dtype=torch.float64, device=device)
            errors.energy[name] = torch.zeros((), dtype=torch.float64, device=device)
            stacked[name] = torch.stack(list(options[name].values()))
            current[name] = stacked[name][0]

    def hook(layer: Layer) -> Any:
        def compare(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if errors.busy:
                return None
            errors.busy = True
            try:
                return _compare_layer(mod, layer, args, kwargs, output, options, stacked, current, errors)
            finally:
                errors.busy = False

        return compare

    handles = [layer.module.register_forward_hook(hook(layer), with_kwargs=True) for layer in layers]
    num_batches, fraction = budget
    total = batch_total(data, num_batches)
    try:
        with _float_mode(module) as saved, torch.no_grad():
            hooked = {id(q) for layer in layers for q in (*layer.weights, *(q for _, q in layer.tuned))}
            for quantizer, quant in saved:  # the rest (ranges not chosen here: learned, no calibrator) as they were
                if quant and id(quantizer) not in hooked and quantizer.amax is not None:
                    quantizer.enable_quant()
            batches = local_batches(data, num_batches)
            for batch in scored(progress_bar(batches, progress, "auto: comparing ranges", total=total), fraction,
                                 errors):  # fmt: skip
                forward(model, batch)
                errors.batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if calib_distributed.is_initialized():
        _all_reduce(errors)
    return errors


def _compare_layer(
    mod: nn.Module,
    layer: Layer,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    options: dict[str, dict[str, torch.Tensor]],
    stacked: dict[str, torch.Tensor],
    current: dict[str, torch.Tensor],
    errors: Errors,
) -> Any:
    """Add each candidate's error to the sums of the layer's tuned quantizers (one at a time, those before it
    at their best range yet, those after it in float), then return the layer's output at the best ranges."""
    reference = [t.detach() for t in _tensors(output)]  # the float layer on this input
    energy = _squared_sum(reference)
    if _stackable(mod, layer, args, kwargs, options, reference):
        name, quantizer = layer.tuned[0]
        errors.energy[name] += energy.to(errors.energy[name].device)
        return _compare_stacked(mod, layer, args[0], reference[0], stacked[name], current, errors)
    outputs: list[Any] = []
    for i, (name, quantizer) in enumerate(layer.tuned):
        errors.energy[name] += energy.to(errors.energy[name].device)
        outputs = []
        if len(options[name]) < 2:
            continue
        before = [(q, current[n]) for n, q in layer.tuned[:i]]
        for amax in options[name].values():
            with _quantizing([*before, (quantizer, amax)], layer.weights):
                outputs.append(mod.forward(*args, **kwargs))
            errors.layer_runs += 1
        errors.sums[name] += torch.stack([_squared_error(out, reference) for out in outputs]).to(errors.sums[name])
        best = errors.sums[name].argmin().reshape(1)  # on the device: no host read
        current[name] = stacked[name].index_select(0, best)[0]
    if outputs and all(isinstance(out, torch.Tensor) for out in outputs):
        return torch.stack(outputs).index_select(0, best.to(outputs[0].device))[0]
    with _quantizing([(q, current[n]) for n, q in layer.tuned], layer.weights):
        return mod.forward(*args, **kwargs)


#: module types whose forward treats the samples of its input's first dimension independently, by the input's
#: number of dimensions (None: any): their candidates run as one batch
_PER_SAMPLE: tuple[tuple[type[nn.Module], Any], ...] = (
    (nn.modules.conv._ConvNd, lambda m, x: x.dim() == len(m.kernel_size) + 2),
    (nn.Linear, lambda m, x: x.dim() >= 2),
    (nn.modules.pooling._MaxPoolNd, None),
    (nn.modules.pooling._AvgPoolNd, None),
    (nn.modules.pooling._AdaptiveAvgPoolNd, None),
    (TensorQuantizer, None),
)


def _stackable(
    mod: nn.Module,
    layer: Layer,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, dict[str, torch.Tensor]],
    reference: list[torch.Tensor],
) -> bool:
    """Whether the layer's candidates can run as one batch: one tuned per-tensor quantizer with at least two
    candidates, one input tensor, one output tensor, a module that treats its input's samples independently."""
    if len(layer.tuned) != 1 or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return False
    ranges = options[layer.tuned[0][0]]
    if len(ranges) < 2 or any(amax.numel() != 1 for amax in ranges.values()) or len(reference) != 1:
        return False
    for kind, rank_ok in _PER_SAMPLE:
        if isinstance(mod, kind):
            return args[0].dim() >= 1 and (rank_ok is None or rank_ok(mod, args[0]))
    return False


def _compare_stacked(
    mod: nn.Module,
    layer: Layer,
    x: torch.Tensor,
    reference: torch.Tensor,
    ranges: torch.Tensor,
    current: dict[str, torch.Tensor],
    errors: Errors,
) -> torch.Tensor:
    """All candidates of a single-input layer in one forward: the input repeated once per candidate, each copy
    quantized with its own range (a per-sample amax), the weights quantized once."""
    name, quantizer = layer.tuned[0]
    count, trailing = ranges.shape[0], [1] * (x.dim() - 1)
    amax = ranges.reshape(count, 1).expand(count, x.shape[0]).reshape(count * x.shape[0], *trailing)
    with _quantizing([(quantizer, amax)], layer.weights):
        out = mod.forward(x.repeat(count, *trailing))
    out = out.reshape(count, *reference.shape)
    diff = out.reshape(count, -1).float() - reference.reshape(1, -1)  # float32 at least (a half square overflows)
    errors.sums[name] += diff.square_().sum(1).to(errors.sums[name])  # in place: one output-sized buffer less
    errors.layer_runs += count
    best = errors.sums[name].argmin().reshape(1)  # on the device: no host read
    current[name] = ranges.index_select(0, best)[0]
    return out.index_select(0, best.to(out.device))[0]


def _all_reduce(errors: Errors) -> None:
    """Sum every quantizer's errors and energy over the ranks, in one collective."""
    names = sorted(errors.sums)
    flat = torch.cat([torch.cat([errors.sums[n].cpu(), errors.energy[n].cpu().reshape(1)]) for n in names])
    with collective("summing the output errors of the auto calibration"):
        flat = calib_distributed.all_reduce(flat, "sum")
    start = 0
    for name in names:
        size = errors.sums[name].numel()
        errors.sums[name] = flat[start : start + size].to(errors.sums[name].device)
        errors.energy[name] = flat[start + size].to(errors.energy[name].device)
        start += size + 1


# -- the model check ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _checking(model: nn.Module) -> Iterator[None]:
    """Eval mode, statistics off for every quantizer; restored after."""
    quantizers = [q for _, q in named_quantizers(model)]
    calibrating = [q.calib_enabled for q in quantizers]
    was_training = model.training
    try:
        for quantizer in quantizers:
            quantizer.disable_calib()
        model.eval()
        yield
    finally:
        for quantizer, calib in zip(quantizers, calibrating):
            (quantizer.enable_calib if calib else quantizer.disable_calib)()
        model.train(was_training)


def model_errors(
    model: nn.Module,
    module: nn.Module,
    data: Iterable[Any],
    widest: dict[str, torch.Tensor],
    budget: tuple[int | None, float],
    forward: ForwardFn,
    progress: Progress,
) -> tuple[float, float] | None:
    """The model's output error against the float model's, over its energy, on the scored samples: with the chosen
    ranges (``auto``) and with the ``widest`` (quantizer name -> range; ``max``); None without a scored sample."""
    quantizers = dict(module.named_modules())
    wide_ranges = [(quantizers[name], amax) for name, amax in widest.items()]
    num_batches, fraction = budget
    total: torch.Tensor | None = None  # energy, auto's error, max's error: summed on the device
    with _checking(module), torch.no_grad():
        batches = progress_bar(
            local_batches(data, num_batches), progress, "auto: checking the model", total=batch_total(data, num_batches)
        )
        for batch in scored(batches, fraction, Errors()):
            with _float_mode(module):
                reference = [t.detach() for t in _tensors(forward(model, batch))]
            chosen = _squared_error(forward(model, batch), reference)
            with _ranges(wide_ranges):
                wide = _squared_error(forward(model, batch), reference)
            sums = torch.stack([_squared_sum(reference), chosen, wide])
            total = sums if total is None else total + sums
    if total is None:
        return None
    if calib_distributed.is_initialized():
        with collective("summing the model check of the auto calibration"):
            total = calib_distributed.all_reduce(total.cpu(), "sum")
    energy, chosen_error, wide_error = total.cpu().tolist()
    energy = energy or 1.0
    return chosen_error / energy, wide_error / energy

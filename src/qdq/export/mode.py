"""Export mode: every quantizer of a model emits one ONNX ``QuantizeLinear -> DequantizeLinear`` pair.

:func:`export_mode` is a context manager. On entry it runs the model once on the example input (to learn
which quantizers are used and on what ranks), checks that each used quantizer can be exported, and gives
each one an ``export_fn`` built from its stored range; :class:`~qdq.quantizer.TensorQuantizer` calls that
function in place of its fake quantization. On exit (also on error) the quantizers are exactly as before.
No global state is touched.

How each quantizer setting is exported so that the graph computes what PyTorch computes, bit for bit:

* ``step`` (ONNX's ``y_scale``) is the quantizer's step (:meth:`~qdq.quantizer.TensorQuantizer.step`: ``amax /
  max_bound`` in float32, 127 signed, 255 unsigned, of its effective range), the zero point is 0 of type int8 (uint8
  when ``unsigned``); per-channel ranges give ``step`` of shape ``[C]`` and the ``axis`` attribute (needs opset >=
  13).
* ``narrow_range`` (grid ``[-127, 127]``): Q/DQ saturates at -128, so the input is first raised to at least
  ``-amax`` (``Max`` node); ``round(-amax / step) = -127`` makes this exact. For a weight the ``Max`` is only
  emitted when it changes a value (never with max-calibrated weights).
* ``amax <= 2**-24`` quantizes to zeros in PyTorch. The exported step is 1 for those channels and the input
  is multiplied by a 0/1 channel mask first, so the graph also gives zeros (for finite inputs). For a
  weight the mask is only emitted when it changes a value (not for all-zero pruned channels).
* ``num_bits < 8``: the grid is a subset of the 8-bit one with the same step; the input is clamped to
  ``[qmin * step, qmax * step]`` (``Max``/``Min``) before an int8/uint8 Q/DQ, which then saturates exactly
  where PyTorch does. For a weight the clamps are only emitted when they change a value (never with
  max-calibrated weights), so W4A8 weights stay plain Q/DQ on the initializer.
* ``learn_amax``: the learned bounds are exported as a ``Clip`` followed by Q/DQ with
  ``amax = max(-min, max)``, as in training.
* ``pre_quant_scale``: the quantizer's forward multiplies by it before quantizing (a ``Mul`` node).
* fp16 / bf16 inputs: cast to float32 around the Q/DQ pair, the arithmetic PyTorch does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qdq.errors import QdqExportError
from qdq.export._ops import _fake_qdq_eager, fake_qdq
from qdq.ops import AMAX_EPSILON
from qdq.quantizer import TensorQuantizer

__all__ = ["QdqSpec", "export_mode", "exportable_quantizers", "quantizer_specs"]


@dataclass
class QdqSpec:
    """What one quantizer becomes in ONNX.

    Attributes:
        name: the quantizer's module name in the model.
        step: float32 step (ONNX's ``y_scale``), 0-d (per tensor) or ``[C]`` (per channel).
        zero_point: int8 / uint8 zeros of ``step``'s shape.
        axis: ONNX ``axis`` of a per-channel scale (non-negative), -1 per tensor.
        unsigned: True for uint8.
        clip: learned ``(min, max)`` applied before quantizing, or None.
        lower: broadcastable float32 lower bound (``-amax`` narrow range, ``qmin * step`` below 8 bits), or None.
        upper: broadcastable float32 upper bound (``qmax * step``, below 8 bits), or None.
        mask: broadcastable float32 0/1 mask zeroing channels with amax <= 2**-24, or None.
        amax: the effective float32 range (for calibration caches), same shape as ``step``.
        is_constant: the quantizer quantizes a weight (its role), not an activation.
        ranks: ranks of the inputs the quantizer was called on.
        traced: the (traced) tensors it was called on during the last export; lets the exporter tell a
            quantizer merged into an identical one (same input, same parameters) from a lost one.
    """

    name: str
    step: torch.Tensor
    zero_point: torch.Tensor
    axis: int
    unsigned: bool
    amax: torch.Tensor
    clip: tuple[float, float] | None = None
    lower: torch.Tensor | None = None
    upper: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    is_constant: bool = False
    ranks: set[int] = field(default_factory=set)
    traced: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def per_channel(self) -> bool:
        return self.axis >= 0

    def same_qdq(self, other: QdqSpec) -> bool:
        """Both emit the same nodes for the same input (so an exporter may merge them)."""

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

        return (
            self.axis == other.axis
            and self.clip == other.clip
            and self.zero_point.dtype == other.zero_point.dtype
            and same(self.step, other.step)
            and same(self.lower, other.lower)
            and same(self.upper, other.upper)
            and same(self.mask, other.mask)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The export-time forward: the pre-ops, then the Q/DQ operator, in float32."""
        self.traced.append(x)
        dtype = x.dtype
        y = x if dtype == torch.float32 else x.float()
        if self.clip is not None:
            y = torch.clamp(y, self.clip[0], self.clip[1])
        if self.lower is not None and self.upper is not None and self.lower.numel() == self.upper.numel() == 1:
            # One Clip with scalar bounds: the dynamo exporter's optimizer mis-orders a Max/Min pair here.
            y = torch.clamp(y, float(self.lower), float(self.upper))
        else:
            if self.lower is not None:
                y = torch.maximum(y, self.lower)
            if self.upper is not None:
                y = torch.minimum(y, self.upper)
        if self.mask is not None:
            y = y * self.mask
        y = fake_qdq(y, self.step, self.zero_point, self.axis, self.name)
        return y if dtype == torch.float32 else y.to(dtype)


def exportable_quantizers(model: nn.Module) -> dict[TensorQuantizer, str]:
    """Quantizers that quantize in forward (:attr:`~qdq.quantizer.TensorQuantizer.is_quantizing`), each with
    its first module name."""
    found: dict[TensorQuantizer, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TensorQuantizer) and module.is_quantizing:
            found.setdefault(module, name)
    return found


@dataclass
class _Seen:
    ranks: set[int] = field(default_factory=set)
    constant: torch.Tensor | None = None
    calls: int = 0


def _probe(
    model: nn.Module, quantizers: dict[TensorQuantizer, str], args: tuple, kwargs: Mapping[str, Any]
) -> dict[TensorQuantizer, _Seen]:
    """Run ``model`` once; record, per quantizer, the input ranks and, for a weight quantizer, the weight."""
    seen: dict[TensorQuantizer, _Seen] = {q: _Seen() for q in quantizers}

    def hook(module: nn.Module, inputs: tuple) -> None:
        record = seen[module]  # type: ignore[index]  # hooked on the quantizers only
        x = inputs[0]
        record.calls += 1
        record.ranks.add(x.dim())
        if module.is_weight:
            record.constant = x.detach()

    handles = [q.register_forward_pre_hook(hook) for q in quantizers]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {q: s for q, s in seen.items() if s.calls}


def _effective_amax(q: TensorQuantizer, name: str) -> torch.Tensor:
    amax = q.effective_amax()
    if amax is None:
        raise QdqExportError(
            f"{name} has no amax: its range is dynamic and cannot be exported. Calibrate the model "
            f"(qdq.calib), set it with `{name}.amax = ...`, or disable the quantizer (`.disable()`)."
        )
    return amax.float()


def _channel_axis(q: TensorQuantizer, name: str, amax: torch.Tensor, rank: int) -> int:
    """ONNX axis of a per-channel amax against an input of ``rank``."""
    if amax.dim() == 1:
        if q.axis is None or len(q.axis) != 1:
            raise QdqExportError(f"{name}: a 1-D amax of {amax.numel()} values needs a single quantization axis.")
        return q.axis[0] % rank
    big = [d for d, n in enumerate(amax.shape) if n != 1]
    if len(big) != 1:
        raise QdqExportError(
            f"{name}: amax of shape {tuple(amax.shape)} varies along {len(big)} axes; ONNX Q/DQ supports one "
            "axis (per-channel) or none (per-tensor)."
        )
    return rank - amax.dim() + big[0]


def _broadcast(values: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    """``values`` of shape ``[C]`` viewed for broadcasting along ``axis`` of a rank-``rank`` tensor."""
    if axis < 0:
        return values.reshape(())
    shape = [1] * rank
    shape[axis] = values.numel()
    return values.reshape(shape)


def _check_settings(q: TensorQuantizer, name: str) -> None:
    if not q.fake_quant:
        raise QdqExportError(
            f"{name} has fake_quant=False (it outputs integers); only fake-quantizing quantizers export "
            "to Q/DQ. Build it with QuantDescriptor(fake_quant=True)."
        )
    if q.num_bits > 8:
        raise QdqExportError(
            f"{name} quantizes to {q.num_bits} bits; ONNX int8/uint8 Q/DQ holds at most 8 bits. "
            "Use num_bits <= 8 for layers you export."
        )


def _build_spec(q: TensorQuantizer, name: str, seen: _Seen) -> QdqSpec:
    _check_settings(q, name)
    amax = _effective_amax(q, name)
    if amax.numel() > 1 and len(seen.ranks) > 1:
        raise QdqExportError(f"{name} is per-channel and used on inputs of ranks {sorted(seen.ranks)}.")
    rank = max(seen.ranks)
    axis = _channel_axis(q, name, amax, rank) if amax.numel() > 1 else -1
    flat = amax.reshape(-1) if axis >= 0 else amax.reshape(())
    qmin, qmax = q.quant_bounds
    tiny = flat <= AMAX_EPSILON  # the step is 1 there; the mask below makes the output 0, as in PyTorch
    scale = q.step().reshape(flat.shape)
    zp_dtype = torch.uint8 if q.unsigned else torch.int8
    spec = QdqSpec(
        name=name,
        step=scale.contiguous(),
        zero_point=torch.zeros(flat.shape, dtype=zp_dtype, device=flat.device),
        axis=axis,
        unsigned=q.unsigned,
        amax=flat.clone(),
        is_constant=seen.constant is not None,
        ranks=set(seen.ranks),
    )
    if q.learn_amax:
        spec.clip = (q.clip.clip_value_min.detach().item(), q.clip.clip_value_max.detach().item())
    if not q.unsigned and qmin > -qmax - 1:
        spec.lower = _broadcast(-flat, axis, rank).contiguous()
    if q.num_bits < 8:
        # A sub-8-bit grid is a subset of the int8/uint8 grid with the same step: clamping the input to
        # [qmin * step, qmax * step] first makes the 8-bit Q/DQ saturate exactly where PyTorch does.
        if not q.unsigned and spec.lower is None:
            spec.lower = _broadcast(qmin * scale, axis, rank).contiguous()
        spec.upper = _broadcast(qmax * scale, axis, rank).contiguous()
    if bool(tiny.any()):
        spec.mask = _broadcast((~tiny).float(), axis, rank).contiguous()
    if seen.constant is not None:
        _drop_needless_preops(q, spec, seen.constant)
    return spec


def _drop_needless_preops(q: TensorQuantizer, spec: QdqSpec, weight: torch.Tensor) -> None:
    """For a constant input, keep the narrow-range ``Max`` and the tiny-channel mask only if they matter.

    A weight quantizer's Q/DQ is best left directly on the initializer (what TensorRT and ONNX Runtime
    expect); with max-calibrated weights neither pre-op ever changes a value.
    """
    if spec.lower is None and spec.upper is None and spec.mask is None:
        return
    with torch.no_grad():
        reference = q(weight.float())  # the quantizer's own forward (pre_quant_scale, clip, fake quant)
        if q.pre_quant_scale is not None:
            weight = weight * q.pre_quant_scale
        plain = _fake_qdq_eager(weight.float(), spec.step, spec.zero_point, spec.axis)
    if torch.equal(reference, plain):
        spec.lower, spec.upper, spec.mask = None, None, None


def quantizer_specs(
    model: nn.Module, *example_inputs: Any, example_kwargs: Mapping[str, Any] | None = None
) -> dict[TensorQuantizer, QdqSpec]:
    """Build the export spec of every quantizer ``model`` uses on ``example_inputs`` (and ``example_kwargs``).

    Raises:
        QdqExportError: a used quantizer has no stored range, is not 8-bit, or is not fake-quantizing.
    """
    quantizers = exportable_quantizers(model)
    with _calibration_off(model):
        seen = _probe(model, quantizers, example_inputs, example_kwargs or {})
        return {q: _build_spec(q, quantizers[q], s) for q, s in seen.items()}


@contextlib.contextmanager
def _calibration_off(model: nn.Module) -> Iterator[None]:
    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.calib_enabled]
    for q in quantizers:
        q.disable_calib()
    try:
        yield
    finally:
        for q in quantizers:
            q.enable_calib()


@contextlib.contextmanager
def export_mode(
    model: nn.Module,
    *example_inputs: Any,
    specs: dict[TensorQuantizer, QdqSpec] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[dict[TensorQuantizer, QdqSpec]]:
    """Within the block, the model's quantizers emit ONNX Q/DQ (for ``torch.onnx.export``).

    Args:
        model: the quantized model.
        example_inputs: the inputs ``model`` will be exported with (used to find the used quantizers);
            ``example_kwargs`` its keyword arguments.
        specs: specs from :func:`quantizer_specs`, to skip the probing forward pass.

    Yields:
        The spec of each quantizer that will appear in the graph.

    Calibration is switched off inside the block. Outside, the model computes what it computed before.
    :func:`qdq.export.export_onnx` is the usual entry point; to call ``torch.onnx.export`` yourself inside
    the block, pass ``custom_translation_table=qdq.export.dynamo_translation_table()`` (dynamo) or call
    ``qdq.export.register_torchscript_symbolic()`` first and pass ``custom_opsets={"qdq": 1}``
    (TorchScript); then tag the graph with ``qdq.export.annotate_quantizers``.
    """
    if specs is None:
        specs = quantizer_specs(model, *example_inputs, example_kwargs=example_kwargs)
    installed: list[TensorQuantizer] = []
    with _calibration_off(model):
        try:
            for quantizer, spec in specs.items():
                quantizer.export_fn = _as_fn(spec)
                installed.append(quantizer)
            yield specs
        finally:
            for quantizer in installed:
                del quantizer.export_fn


def _as_fn(spec: QdqSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    return spec.__call__

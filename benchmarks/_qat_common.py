"""Shared by the QAT benchmarks: max-calibrated ranges, the torch-native fake-quant peer, a train step.

The peer is the same model with torch's own fake-quant kernels (``fake_quantize_per_tensor_affine`` for
inputs, ``fake_quantize_per_channel_affine`` for weights) on the layers qdq quantizes, with the same
ranges. It is what a user gets from ``torch.ao`` eager QAT; note that it multiplies by the reciprocal of
the step, so it is not bit-exact with ONNX Runtime (qdq divides, as ONNX does).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import qdq


def calibrate_max(model: nn.Module, batch: torch.Tensor) -> None:
    """Static amax = max |x| of one batch for every quantizer (what max calibration gives)."""
    quantizers = [m for m in model.modules() if isinstance(m, qdq.TensorQuantizer)]
    seen: dict[int, torch.Tensor] = {}

    def hook(module, inputs, _out):
        x = inputs[0].detach().float()
        if module.axis is None:
            seen[id(module)] = x.abs().max()
        else:
            dims = [d for d in range(x.dim()) if d not in module.axis]
            seen[id(module)] = x.abs().amax(dim=dims, keepdim=True)

    handles = [q.register_forward_hook(hook) for q in quantizers]
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    for quantizer in quantizers:
        quantizer.amax = seen[id(quantizer)]


def _native_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.fake_quantize_per_tensor_affine(x, module.in_scale, 0, -128, 127)


def _native_weight(module: nn.Module) -> torch.Tensor:
    return torch.fake_quantize_per_channel_affine(module.weight, module.w_scale, module.w_zero, 0, -128, 127)


class NativeFQConv(nn.Conv2d):
    """Peer conv: per-tensor input, per-output-channel weight, torch's native fake-quant kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(_native_input(self, x), _native_weight(self), self.bias)


class NativeFQLinear(nn.Linear):
    """Peer linear layer, quantized like :class:`NativeFQConv`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_native_input(self, x), _native_weight(self), self.bias)


def native_model(float_model: nn.Module, quantized: nn.Module) -> nn.Module:
    """A copy of ``float_model`` whose convs and linears use torch's fake-quant with ``quantized``'s ranges."""
    model = copy.deepcopy(float_model)
    for name, module in list(model.named_modules()):
        peer = {nn.Conv2d: NativeFQConv, nn.Linear: NativeFQLinear}.get(type(module))
        quant = quantized.get_submodule(name)
        if peer is None or not hasattr(quant, "weight_quantizer"):  # left in float in the qdq model too
            continue
        module.__class__ = peer
        module.in_scale = float(quant.input_quantizer.amax) / 127  # a Python float: no device read per call
        module.w_scale = (quant.weight_quantizer.amax.flatten() / 127).to(module.weight.device)
        module.w_zero = torch.zeros_like(module.w_scale, dtype=torch.int32)
    return model


def train_step(model: nn.Module, batch: torch.Tensor, labels: torch.Tensor, autocast: torch.dtype | None = None):
    """One SGD(momentum) step: forward, cross-entropy, backward, update (under autocast if given)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    device_type = batch.device.type

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(model(batch), labels)
        loss.backward()
        optimizer.step()

    return step

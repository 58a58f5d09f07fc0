"""Quantized LSTM: ``QuantLSTMCell`` and ``QuantLSTM`` (seed: ``quant_nn.LSTMCell``, ``quant_nn.LSTM``).

Both use the seed's *fused* quantization. At every time step the input quantizer sees
``cat([x_t, h_{t-1}], dim=1)`` and the weight quantizer (per row, axis 0) sees
``cat([weight_ih, weight_hh], dim=1)``; then

    gates = q(cat([x_t, h_{t-1}])) @ q(cat([W_ih, W_hh])).T + b_ih + b_hh
    i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of the four chunks of gates
    c_t = f * c_{t-1} + i * g;  h_t = o * tanh(c_t)

in float. Biases are never quantized. ``QuantLSTM`` has one input and one weight quantizer per
layer × direction (``_input_quantizers[layer * num_directions + direction]``), runs a Python loop over
time steps (no cuDNN), and keeps ``nn.LSTM``'s parameter names so state_dicts load both ways.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from qdq import descriptor as d
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.base import QuantMixin, _adopt, _check_desc, _quantizers_on_device_of
from qdq.nn.registry import quantizes
from qdq.quantizer import TensorQuantizer

__all__ = ["QuantLSTM", "QuantLSTMCell"]

HiddenState = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------------- cell math
def _lstm_update(gates: torch.Tensor, c: torch.Tensor) -> HiddenState:
    """Standard LSTM state update from pre-activation gates ``(N, 4H)`` (order i, f, g, o)."""
    i, f, g, o = gates.chunk(4, dim=1)
    c_next = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_next = torch.sigmoid(o) * torch.tanh(c_next)
    return h_next, c_next


def _quant_lstm_step(
    x: torch.Tensor,
    state: HiddenState,
    quant_weight: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    input_quantizer: TensorQuantizer,
) -> HiddenState:
    """One fused quantized LSTM step on 2-D ``x`` ``(N, I)`` and state ``(N, H)`` each.

    ``quant_weight`` is the already quantized ``cat([W_ih, W_hh], dim=1)`` of shape ``(4H, I + H)``.
    """
    h, c = state
    quant_input = input_quantizer(torch.cat([x, h], dim=1))
    gates = torch.mm(quant_input, quant_weight.t())
    if biases is not None:
        gates = gates + biases[0] + biases[1]
    return _lstm_update(gates, c)


def _fused_weight(weight_ih: torch.Tensor, weight_hh: torch.Tensor) -> torch.Tensor:
    """``cat([W_ih, W_hh], dim=1)``: the tensor the weight quantizer sees."""
    return torch.cat([weight_ih, weight_hh], dim=1)


def _reject_projection(module: nn.Module) -> None:
    if getattr(module, "proj_size", 0) > 0:
        raise QdqConfigError(
            f"{type(module).__name__} does not support proj_size > 0 (got proj_size={module.proj_size}); "
            "build the LSTM without projections, or leave it unquantized."
        )


# -------------------------------------------------------------------------------------- the cell
@quantizes(nn.LSTMCell)
class QuantLSTMCell(QuantMixin, nn.LSTMCell):
    """``nn.LSTMCell`` with the fused quantization of ``cat([x, h])`` and ``cat([W_ih, W_hh])``.

    Takes every ``nn.LSTMCell`` argument plus ``quant_desc_input=`` and ``quant_desc_weight=``
    (defaults: 8-bit per tensor, and 8-bit per row, axis 0).
    """

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def forward(self, input: torch.Tensor, hx: HiddenState | None = None) -> HiddenState:
        """``(h_1, c_1)`` for input ``(N, input_size)`` or ``(input_size,)``, like ``nn.LSTMCell``."""
        is_batched = _check_cell_dims(input, hx)
        x = input if is_batched else input.unsqueeze(0)
        state = self._initial_state(x, hx, is_batched)
        self._check_sizes(x, state)
        quant_weight = self._weight_quantizer(_fused_weight(self.weight_ih, self.weight_hh))
        biases = None if self.bias_ih is None else (self.bias_ih, self.bias_hh)
        h, c = _quant_lstm_step(x, state, quant_weight, biases, self._input_quantizer)
        return (h, c) if is_batched else (h.squeeze(0), c.squeeze(0))

    def quantized_weights(self) -> Iterator[tuple[str, torch.Tensor, TensorQuantizer]]:
        """``("", cat([W_ih, W_hh]), weight quantizer)``: what :func:`qdq.calib.calibrate_weights` calibrates."""
        yield "", _fused_weight(self.weight_ih, self.weight_hh).detach(), self._weight_quantizer

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        """None: the input quantizer reads ``cat([x, h])``, not the argument ``x`` itself."""
        return (None,)

    def _initial_state(self, x: torch.Tensor, hx: HiddenState | None, is_batched: bool) -> HiddenState:
        if hx is None:
            zeros = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)
            return zeros, zeros
        return (hx[0], hx[1]) if is_batched else (hx[0].unsqueeze(0), hx[1].unsqueeze(0))

    def _check_sizes(self, x: torch.Tensor, state: HiddenState) -> None:
        if x.size(1) != self.input_size:
            raise RuntimeError(f"input has inconsistent input_size: got {x.size(1)} expected {self.input_size}")
        expected = (x.size(0), self.hidden_size)
        for idx, value in enumerate(state):
            if tuple(value.shape) != expected:
                raise RuntimeError(f"Expected hx[{idx}] of size {expected}, got {tuple(value.shape)}")


def _check_cell_dims(input: torch.Tensor, hx: HiddenState | None) -> bool:
    """Validate ranks as ``nn.LSTMCell`` does; return whether the input is batched."""
    if input.dim() not in (1, 2):
        raise ValueError(f"LSTMCell: Expected input to be 1D or 2D, got {input.dim()}D instead")
    for idx, value in enumerate(hx or ()):
        if value.dim() not in (1, 2):
            raise ValueError(f"LSTMCell: Expected hx[{idx}] to be 1D or 2D, got {value.dim()}D instead")
    return input.dim() == 2


# ------------------------------------------------------------------------------------- the layer
@quantizes(nn.LSTM)
class QuantLSTM(QuantMixin, nn.LSTM):
    """``nn.LSTM`` with fused quantization per layer × direction, computed by a Python time loop.

    Takes every ``nn.LSTM`` argument plus ``quant_desc_input=`` and ``quant_desc_weight=``;
    ``proj_size > 0`` raises :class:`~qdq.errors.QdqConfigError`. Quantizers live in the ModuleLists
    ``_input_quantizers`` and ``_weight_quantizers`` (``input_quantizers`` / ``weight_quantizers``),
    indexed ``layer * num_directions + direction``; there is no single ``input_quantizer``.
    PackedSequence input is not supported.
    """

    default_quant_desc_weight: ClassVar[QuantDescriptor] = d.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def init_quantizer(
        self, quant_desc_input: QuantDescriptor | None = None, quant_desc_weight: QuantDescriptor | None = None
    ) -> None:
        """One input and one weight quantizer per layer × direction (class defaults when None)."""
        _reject_projection(self)
        desc_input = self.default_quant_desc_input if quant_desc_input is None else quant_desc_input
        desc_weight = self.default_quant_desc_weight if quant_desc_weight is None else quant_desc_weight
        _check_desc(desc_input, "quant_desc_input")
        _check_desc(desc_weight, "quant_desc_weight")
        count = self.num_layers * self._num_directions
        self._input_quantizers = nn.ModuleList(TensorQuantizer(desc_input, role="input") for _ in range(count))
        self._weight_quantizers = nn.ModuleList(TensorQuantizer(desc_weight, role="weight") for _ in range(count))

    def argument_quantizers(self) -> tuple[TensorQuantizer | None, ...]:
        """None: each layer's input quantizer reads ``cat([x_t, h])``, not the argument itself."""
        return (None,)

    @classmethod
    def from_float(  # type: ignore[override]  # a weight descriptor where the input-only base takes **_ (ignored)
        cls,
        module: nn.Module,
        quant_desc_input: QuantDescriptor | None = None,
        quant_desc_weight: QuantDescriptor | None = None,
    ) -> QuantLSTM:
        """A QuantLSTM sharing ``module``'s parameters (the float LSTM is left unchanged)."""
        new = _adopt(cls, module)
        # RNNBase updates these lists in place on ``lstm.weight_ih_l0 = ...``: do not share them.
        new.__dict__["_flat_weights"] = list(module.__dict__.get("_flat_weights", []))
        new.__dict__["_flat_weight_refs"] = list(module.__dict__.get("_flat_weight_refs", []))
        new.init_quantizer(quant_desc_input, quant_desc_weight)
        return _quantizers_on_device_of(new, module)

    @property
    def input_quantizers(self) -> nn.ModuleList:
        """Input quantizers, index ``layer * num_directions + direction``."""
        return self._input_quantizers

    @property
    def weight_quantizers(self) -> nn.ModuleList:
        """Weight quantizers (per row of ``cat([W_ih, W_hh])``), index ``layer * num_directions + direction``."""
        return self._weight_quantizers

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    # ------------------------------------------------------------------------------- forward
    def forward(  # type: ignore[override]  # a tensor input only: nn.LSTM's PackedSequence overload raises here
        self,
        input: torch.Tensor,
        hx: HiddenState | None = None,
    ) -> tuple[torch.Tensor, HiddenState]:
        """``(output, (h_n, c_n))`` with ``nn.LSTM``'s shapes, for batched or unbatched input."""
        if isinstance(input, PackedSequence):
            raise QdqTypeError(
                "QuantLSTM does not support PackedSequence input; pass a padded tensor "
                "(torch.nn.utils.rnn.pad_packed_sequence) instead."
            )
        self._update_flat_weights()
        x, state, is_batched = self._prepare_input(input, hx)
        output, h_n, c_n = self._run_layers(x, state)
        if self.batch_first:
            output = output.transpose(0, 1)
        if not is_batched:
            return output.squeeze(0 if self.batch_first else 1), (h_n.squeeze(1), c_n.squeeze(1))
        return output, (h_n, c_n)

    def _prepare_input(
        self,
        input: torch.Tensor,
        hx: HiddenState | None,
    ) -> tuple[torch.Tensor, HiddenState, bool]:
        """Time-major 3-D input, 3-D initial state, and whether the input was batched; checks like torch."""
        if input.dim() not in (2, 3):
            raise ValueError(f"LSTM: Expected input to be 2D or 3D, got {input.dim()}D instead")
        is_batched = input.dim() == 3
        if not is_batched:
            input = input.unsqueeze(0 if self.batch_first else 1)
        state = self._initial_state(input, hx, is_batched)
        self.check_forward_args(input, state, None)
        x = input.transpose(0, 1) if self.batch_first else input
        return x, state, is_batched

    def _initial_state(self, input: torch.Tensor, hx: HiddenState | None, is_batched: bool) -> HiddenState:
        if hx is None:
            batch = input.size(0 if self.batch_first else 1)
            shape = (self.num_layers * self._num_directions, batch, self.hidden_size)
            zeros = torch.zeros(shape, dtype=input.dtype, device=input.device)
            return zeros, zeros
        rank = 3 if is_batched else 2
        if hx[0].dim() != rank or hx[1].dim() != rank:
            kind = "batched 3-D" if is_batched else "unbatched 2-D"
            raise RuntimeError(
                f"For {kind} input, hx and cx should also be {rank}-D but got "
                f"({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
            )
        return (hx[0], hx[1]) if is_batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))

    def _run_layers(self, x: torch.Tensor, state: HiddenState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run every layer on time-major ``x``; dropout between layers in training, like torch."""
        h_n: list[torch.Tensor] = []
        c_n: list[torch.Tensor] = []
        layer_input = x
        for layer in range(self.num_layers):
            if layer > 0:
                layer_input = F.dropout(layer_input, self.dropout, self.training)
            outputs = []
            for direction in range(self._num_directions):
                idx = layer * self._num_directions + direction
                out, (h, c) = self._run_direction(layer_input, (state[0][idx], state[1][idx]), idx)
                outputs.append(out)
                h_n.append(h)
                c_n.append(c)
            layer_input = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        return layer_input, torch.stack(h_n), torch.stack(c_n)

    def quantized_weights(self) -> Iterator[tuple[str, torch.Tensor, TensorQuantizer]]:
        """``(f"weight_quantizers.{i}", cat([W_ih, W_hh]) of layer x direction i, its quantizer)`` for every i:
        what :func:`qdq.calib.calibrate_weights` calibrates."""
        for idx, quantizer in enumerate(self._weight_quantizers):
            weight_ih, weight_hh, _ = self._layer_params(idx)
            weight = _fused_weight(weight_ih, weight_hh).detach()
            yield f"weight_quantizers.{idx}", weight, cast(TensorQuantizer, quantizer)

    def _run_direction(self, x: torch.Tensor, state: HiddenState, idx: int) -> tuple[torch.Tensor, HiddenState]:
        """One layer × direction over time-major ``x`` ``(L, N, I)``; output ``(L, N, H)``."""
        weight_ih, weight_hh, biases = self._layer_params(idx)
        quant_weight = self._weight_quantizers[idx](_fused_weight(weight_ih, weight_hh))
        input_quantizer = cast(TensorQuantizer, self._input_quantizers[idx])
        steps = range(x.size(0) - 1, -1, -1) if idx % self._num_directions == 1 else range(x.size(0))
        outputs: list[torch.Tensor] = [x.new_empty(0)] * x.size(0)
        for t in steps:
            state = _quant_lstm_step(x[t], state, quant_weight, biases, input_quantizer)
            outputs[t] = state[0]
        if not outputs:
            return x.new_empty(0, x.size(1), self.hidden_size), state
        return torch.stack(outputs), state

    def _layer_params(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(weight_ih, weight_hh, (bias_ih, bias_hh) or None)`` of layer × direction ``idx``."""
        names = self._all_weights[idx]
        params = [getattr(self, name) for name in names]
        return params[0], params[1], (params[2], params[3]) if self.bias else None

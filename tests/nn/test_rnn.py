"""Tests of QuantLSTM / QuantLSTMCell: float equivalence, fused quantization numerics, conversions."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from qdq import nn as quant_nn
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn import QuantLinear, QuantLSTM, QuantLSTMCell, TensorQuantizer

INPUT, HIDDEN, SEQ, BATCH = 5, 6, 4, 3
EXACT = {"atol": 1e-6, "rtol": 0.0}


# ------------------------------------------------------------------------------------------ helpers
def _disable_quantizers(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, TensorQuantizer):
            sub.disable()


def _float_and_quant_lstm(**kwargs: object) -> tuple[nn.LSTM, QuantLSTM]:
    """A float LSTM and a QuantLSTM (quantizers disabled) holding the same weights."""
    torch.manual_seed(0)
    ref = nn.LSTM(INPUT, HIDDEN, **kwargs)
    quant = QuantLSTM(INPUT, HIDDEN, **kwargs)
    quant.load_state_dict(ref.state_dict())
    _disable_quantizers(quant)
    return ref, quant


def _float_and_quant_cell(**kwargs: object) -> tuple[nn.LSTMCell, QuantLSTMCell]:
    torch.manual_seed(0)
    ref = nn.LSTMCell(INPUT, HIDDEN, **kwargs)
    quant = QuantLSTMCell(INPUT, HIDDEN, **kwargs)
    quant.load_state_dict(ref.state_dict())
    _disable_quantizers(quant)
    return ref, quant


def _initial_state(lstm: nn.LSTM, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
    count = lstm.num_layers * (2 if lstm.bidirectional else 1)
    shape = (count, BATCH, HIDDEN) if batched else (count, HIDDEN)
    return torch.randn(shape), torch.randn(shape)


def _np_fake_quant(x: torch.Tensor, amax: float | torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Independent oracle: ``clamp(round_half_even(x / step), -2**(n-1), 2**(n-1) - 1) * step`` in float32."""
    qmax = np.float32(2 ** (num_bits - 1) - 1)
    amax_np = amax.detach().numpy() if isinstance(amax, torch.Tensor) else amax
    step = np.asarray(amax_np, dtype=np.float32) / qmax
    q = np.clip(np.rint(x.detach().numpy().astype(np.float32) / step), -qmax - 1, qmax)
    return torch.from_numpy((q * step).astype(np.float32))


def _ref_step(
    x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], q_weight: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None, input_amax: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step with the seed's fused quantization, written with plain torch ops."""
    h, c = state
    gates = _np_fake_quant(torch.cat([x, h], dim=1), input_amax) @ q_weight.t()
    if biases is not None:
        gates = gates + biases[0] + biases[1]
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _ref_direction(
    lstm: nn.LSTM, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
    name: str, input_amax: float, weight_amax: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer × direction of a time-major reference LSTM whose parameters end in ``name``."""
    weight = torch.cat([getattr(lstm, f"weight_ih_{name}"), getattr(lstm, f"weight_hh_{name}")], dim=1)
    q_weight = _np_fake_quant(weight, weight_amax.view(-1, 1))
    biases = (getattr(lstm, f"bias_ih_{name}"), getattr(lstm, f"bias_hh_{name}")) if lstm.bias else None
    steps = range(x.size(0) - 1, -1, -1) if name.endswith("_reverse") else range(x.size(0))
    outputs = {}
    for t in steps:
        state = _ref_step(x[t], state, q_weight, biases, input_amax)
        outputs[t] = state[0]
    return torch.stack([outputs[t] for t in range(x.size(0))]), state[0], state[1]


def _ref_lstm(
    lstm: nn.LSTM, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor],
    input_amax: list[float], weight_amax: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference quantized LSTM (time-major, batched) from a float ``nn.LSTM``'s parameters."""
    directions = 2 if lstm.bidirectional else 1
    layer_input, h_n, c_n = x, [], []
    for layer in range(lstm.num_layers):
        outputs = []
        for direction in range(directions):
            idx = layer * directions + direction
            name = f"l{layer}" + ("_reverse" if direction else "")
            out, h, c = _ref_direction(
                lstm, layer_input, (hx[0][idx], hx[1][idx]), name, input_amax[idx], weight_amax[idx]
            )
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
        layer_input = torch.cat(outputs, dim=2)
    return layer_input, torch.stack(h_n), torch.stack(c_n)


def _set_static_amax(quant: QuantLSTM) -> tuple[list[float], list[torch.Tensor]]:
    """Static ranges that clip a few values: input amax 1.5 / 0.4, weight amax 0.9 × each row's max."""
    input_amax, weight_amax = [], []
    directions = 2 if quant.bidirectional else 1
    for idx, (q_in, q_w) in enumerate(zip(quant.input_quantizers, quant.weight_quantizers)):
        names = quant._all_weights[idx]
        weight = torch.cat([getattr(quant, names[0]), getattr(quant, names[1])], dim=1).detach()
        input_amax.append(1.5 if idx < directions else 0.4)
        weight_amax.append(0.9 * weight.abs().amax(dim=1))
        q_in.amax = input_amax[-1]
        q_w.amax = weight_amax[-1]
    return input_amax, weight_amax


@pytest.fixture
def restore_defaults() -> Iterator[None]:
    classes = (QuantLSTM, QuantLSTMCell, QuantLinear)
    saved = {cls: (cls.default_quant_desc_input, cls.default_quant_desc_weight) for cls in classes}
    yield
    for cls, (desc_input, desc_weight) in saved.items():
        cls.default_quant_desc_input = desc_input
        cls.default_quant_desc_weight = desc_weight


# ----------------------------------------------------------------- disabled quantizers == torch
LSTM_CONFIGS = [
    {"num_layers": 1},
    {"num_layers": 2},
    {"num_layers": 1, "bidirectional": True},
    {"num_layers": 2, "bidirectional": True},
    {"num_layers": 2, "batch_first": True},
    {"num_layers": 2, "bidirectional": True, "batch_first": True, "bias": False},
]


@pytest.mark.parametrize("kwargs", LSTM_CONFIGS, ids=str)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "no_hx"])
def test_lstm_disabled_equals_torch(kwargs: dict, batched: bool, given_state: bool) -> None:
    ref, quant = _float_and_quant_lstm(**kwargs)
    shape = (BATCH, SEQ, INPUT) if kwargs.get("batch_first") else (SEQ, BATCH, INPUT)
    x = torch.randn(shape if batched else (SEQ, INPUT))
    hx = _initial_state(ref, batched) if given_state else None
    out_ref, (h_ref, c_ref) = ref(x, hx)
    out, (h, c) = quant(x, hx)
    assert out.shape == out_ref.shape and h.shape == h_ref.shape and c.shape == c_ref.shape
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(h, h_ref, **EXACT)
    torch.testing.assert_close(c, c_ref, **EXACT)


@pytest.mark.parametrize("kwargs", [{"num_layers": 2, "bidirectional": True}, {"batch_first": True}], ids=str)
def test_lstm_disabled_gradients_equal_torch(kwargs: dict) -> None:
    ref, quant = _float_and_quant_lstm(**kwargs)
    shape = (BATCH, SEQ, INPUT) if kwargs.get("batch_first") else (SEQ, BATCH, INPUT)
    x = torch.randn(shape)
    h0, c0 = _initial_state(ref, batched=True)
    grads = []
    for module in (ref, quant):
        inputs = [t.clone().requires_grad_() for t in (x, h0, c0)]
        out, (h, c) = module(inputs[0], (inputs[1], inputs[2]))
        torch.manual_seed(1)
        loss = (out * torch.randn_like(out)).sum() + (h * torch.randn_like(h)).sum() + c.sum()
        wrt = inputs + list(module.parameters())
        grads.append(torch.autograd.grad(loss, wrt))
    assert len(grads[0]) == len(grads[1])
    for g_ref, g in zip(*grads):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "no_hx"])
def test_cell_disabled_equals_torch(bias: bool, batched: bool, given_state: bool) -> None:
    ref, quant = _float_and_quant_cell(bias=bias)
    lead = (BATCH,) if batched else ()
    x = torch.randn(*lead, INPUT)
    hx = (torch.randn(*lead, HIDDEN), torch.randn(*lead, HIDDEN)) if given_state else None
    for got, want in zip(quant(x, hx), ref(x, hx)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **EXACT)


def test_cell_disabled_gradients_equal_torch() -> None:
    ref, quant = _float_and_quant_cell()
    x, h0, c0 = torch.randn(BATCH, INPUT), torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
    grads = []
    for module in (ref, quant):
        inputs = [t.clone().requires_grad_() for t in (x, h0, c0)]
        h, c = module(inputs[0], (inputs[1], inputs[2]))
        loss = (h * torch.linspace(-1, 1, HIDDEN)).sum() + (c**2).sum()
        grads.append(torch.autograd.grad(loss, inputs + list(module.parameters())))
    for g_ref, g in zip(*grads):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)


def test_float64_and_factory_kwargs() -> None:
    torch.manual_seed(0)
    ref = nn.LSTM(INPUT, HIDDEN, num_layers=2, device="cpu", dtype=torch.float64)
    quant = QuantLSTM(INPUT, HIDDEN, num_layers=2, device="cpu", dtype=torch.float64)
    quant.load_state_dict(ref.state_dict())
    _disable_quantizers(quant)
    assert quant.weight_ih_l0.dtype == torch.float64
    x = torch.randn(SEQ, BATCH, INPUT, dtype=torch.float64)
    torch.testing.assert_close(quant(x)[0], ref(x)[0], atol=1e-12, rtol=0)


def test_dropout_between_layers_like_torch() -> None:
    ref, quant = _float_and_quant_lstm(num_layers=2, dropout=1.0)
    x = torch.randn(SEQ, BATCH, INPUT)
    for training in (True, False):  # p=1 zeroes layer 1's input in training only: deterministic
        ref.train(training)
        quant.train(training)
        torch.testing.assert_close(quant(x)[0], ref(x)[0], **EXACT)
    quant.train()
    assert not torch.allclose(quant(x)[0], quant.eval()(x)[0])


# ------------------------------------------------------------------- quantized numerics == oracle
@pytest.mark.parametrize("kwargs", [{"num_layers": 1}, {"num_layers": 2, "bidirectional": True}], ids=str)
def test_lstm_static_amax_equals_reference(kwargs: dict) -> None:
    torch.manual_seed(0)
    float_lstm = nn.LSTM(INPUT, HIDDEN, **kwargs)
    quant = QuantLSTM.from_float(float_lstm)
    input_amax, weight_amax = _set_static_amax(quant)
    x = 1.5 * torch.randn(SEQ, BATCH, INPUT)
    hx = _initial_state(float_lstm, batched=True)
    with torch.no_grad():
        out, (h, c) = quant(x, hx)
        out_ref, h_ref, c_ref = _ref_lstm(float_lstm, x, hx, input_amax, weight_amax)
        out_float = float_lstm(x, hx)[0]
    torch.testing.assert_close(out, out_ref, **EXACT)
    torch.testing.assert_close(h, h_ref, **EXACT)
    torch.testing.assert_close(c, c_ref, **EXACT)
    assert (out - out_float).abs().max() > 1e-3  # quantization did happen


def test_cell_static_amax_equals_reference() -> None:
    torch.manual_seed(0)
    cell = QuantLSTMCell(INPUT, HIDDEN)
    weight = torch.cat([cell.weight_ih, cell.weight_hh], dim=1).detach()
    row_amax = 0.8 * weight.abs().amax(dim=1)
    cell.input_quantizer.amax = 1.2
    cell.weight_quantizer.amax = row_amax
    x, h0, c0 = 1.5 * torch.randn(BATCH, INPUT), torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
    with torch.no_grad():
        h, c = cell(x, (h0, c0))
        q_weight = _np_fake_quant(weight, row_amax.view(-1, 1))
        h_ref, c_ref = _ref_step(x, (h0, c0), q_weight, (cell.bias_ih, cell.bias_hh), 1.2)
    torch.testing.assert_close(h, h_ref, **EXACT)
    torch.testing.assert_close(c, c_ref, **EXACT)


def test_dynamic_amax_uses_max_of_fused_input() -> None:
    torch.manual_seed(0)
    cell = QuantLSTMCell(INPUT, HIDDEN)
    x, h0, c0 = torch.randn(BATCH, INPUT), torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN)
    fused_input = torch.cat([x, h0], dim=1)
    weight = torch.cat([cell.weight_ih, cell.weight_hh], dim=1).detach()
    with torch.no_grad():
        h, c = cell(x, (h0, c0))
        q_weight = _np_fake_quant(weight, weight.abs().amax(dim=1, keepdim=True))
        h_ref, c_ref = _ref_step(x, (h0, c0), q_weight, (cell.bias_ih, cell.bias_hh), fused_input.abs().max())
    torch.testing.assert_close(h, h_ref, **EXACT)
    torch.testing.assert_close(c, c_ref, **EXACT)


def test_quantized_gradients_flow() -> None:
    quant = QuantLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    x = torch.randn(SEQ, BATCH, INPUT, requires_grad=True)
    out, (h, c) = quant(x)
    (out.sum() + h.sum() + c.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in quant.parameters())


def test_16bit_close_to_float_but_not_identical() -> None:
    desc_input, desc_weight = QuantDescriptor(num_bits=16), QuantDescriptor(num_bits=16, axis=0)
    torch.manual_seed(0)
    ref = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    quant = QuantLSTM.from_float(ref, quant_desc_input=desc_input, quant_desc_weight=desc_weight)
    cell_ref = nn.LSTMCell(INPUT, HIDDEN)
    cell = QuantLSTMCell.from_float(cell_ref, quant_desc_input=desc_input, quant_desc_weight=desc_weight)
    x = torch.randn(SEQ, BATCH, INPUT)
    with torch.no_grad():
        pairs = [(quant(x)[0], ref(x)[0]), (cell(x[0])[0], cell_ref(x[0])[0])]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert not torch.equal(got, want)


# ------------------------------------------------------------------------------- module plumbing
def test_quantizer_layout_and_properties() -> None:
    quant = QuantLSTM(INPUT, HIDDEN, num_layers=3, bidirectional=True)
    assert isinstance(quant, nn.LSTM)
    assert isinstance(quant._input_quantizers, nn.ModuleList)
    assert quant.input_quantizers is quant._input_quantizers
    assert quant.weight_quantizers is quant._weight_quantizers
    assert len(quant.input_quantizers) == len(quant.weight_quantizers) == 6
    assert all(q.axis is None for q in quant.input_quantizers)
    assert all(q.axis == (0,) for q in quant.weight_quantizers)
    assert "_input_quantizers.5._amax" in quant.state_dict()
    cell = QuantLSTMCell(INPUT, HIDDEN)
    assert cell.input_quantizer.axis is None and cell.weight_quantizer.axis == (0,)


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    source = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    quant = QuantLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    quant.load_state_dict(source.state_dict())  # strict: quantizer ranges may be missing
    _set_static_amax(quant)
    state = quant.state_dict()
    quant_again = QuantLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    quant_again.load_state_dict(state)
    for q_a, q_b in zip(quant.weight_quantizers, quant_again.weight_quantizers):
        torch.testing.assert_close(q_b.amax, q_a.amax, atol=0, rtol=0)
    x = torch.randn(SEQ, BATCH, INPUT)
    torch.testing.assert_close(quant_again(x)[0], quant(x)[0], atol=0, rtol=0)
    back = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    back.load_state_dict({k: v for k, v in state.items() if "_quantizers." not in k})
    for name, value in source.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, atol=0, rtol=0)


def test_from_float_shares_parameters() -> None:
    float_lstm = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    quant = QuantLSTM.from_float(float_lstm)
    for (name, param), (q_name, q_param) in zip(float_lstm.named_parameters(), quant.named_parameters()):
        assert name == q_name and param is q_param
    assert "_input_quantizers" not in float_lstm._modules
    assert len(quant.input_quantizers) == 4
    with torch.no_grad():
        float_lstm.weight_hh_l1_reverse.add_(1.0)  # in-place updates are seen by the quantized copy
    assert torch.equal(quant.weight_hh_l1_reverse, float_lstm.weight_hh_l1_reverse)
    float_cell = nn.LSTMCell(INPUT, HIDDEN)
    cell = QuantLSTMCell.from_float(float_cell)
    assert cell.weight_ih is float_cell.weight_ih and "_input_quantizer" not in float_cell._modules
    _disable_quantizers(quant)
    x = torch.randn(SEQ, BATCH, INPUT)
    torch.testing.assert_close(quant(x)[0], float_lstm(x)[0], **EXACT)


def test_from_float_rejects_other_modules() -> None:
    with pytest.raises(QdqTypeError, match="LSTM"):
        QuantLSTM.from_float(nn.GRU(INPUT, HIDDEN))
    with pytest.raises(QdqConfigError, match="proj_size"):
        QuantLSTM.from_float(nn.LSTM(INPUT, HIDDEN, proj_size=2))


def test_proj_size_raises() -> None:
    with pytest.raises(QdqConfigError, match="proj_size"):
        QuantLSTM(INPUT, HIDDEN, proj_size=2)


def test_packed_sequence_raises() -> None:
    packed = pack_padded_sequence(torch.randn(SEQ, BATCH, INPUT), [SEQ, SEQ - 1, 1])
    with pytest.raises(QdqTypeError, match="PackedSequence"):
        QuantLSTM(INPUT, HIDDEN)(packed)


def test_bad_inputs_raise_like_torch() -> None:
    quant = QuantLSTM(INPUT, HIDDEN)
    with pytest.raises(ValueError, match="2D or 3D"):
        quant(torch.randn(SEQ))
    with pytest.raises(RuntimeError, match="input_size"):
        quant(torch.randn(SEQ, BATCH, INPUT + 1))
    with pytest.raises(RuntimeError, match="3-D"):
        quant(torch.randn(SEQ, BATCH, INPUT), (torch.zeros(1, HIDDEN), torch.zeros(1, HIDDEN)))
    with pytest.raises(ValueError, match="1D or 2D"):
        QuantLSTMCell(INPUT, HIDDEN)(torch.randn(1, BATCH, INPUT))
    with pytest.raises(QdqConfigError, match="fake"):
        QuantLSTM(INPUT, HIDDEN, quant_desc_input=QuantDescriptor(fake_quant=False))


def _check_defaults_independent() -> None:
    assert QuantLSTMCell.default_quant_desc_weight.num_bits == 8
    assert QuantLSTM.default_quant_desc_input.num_bits == 8
    assert QuantLinear.default_quant_desc_weight.num_bits == 8
    lstm, cell = QuantLSTM(INPUT, HIDDEN, num_layers=2), QuantLSTMCell(INPUT, HIDDEN)
    assert all(q.num_bits == 4 for q in lstm.weight_quantizers)
    assert all(q.num_bits == 8 for q in lstm.input_quantizers)
    assert cell.weight_quantizer.num_bits == 8 and cell.input_quantizer.num_bits == 6


def test_default_descriptors_are_per_class(restore_defaults: None) -> None:
    QuantLSTM.set_default_quant_desc_weight(QuantDescriptor(num_bits=4, axis=0))
    QuantLSTMCell.set_default_quant_desc_input(QuantDescriptor(num_bits=6))
    _check_defaults_independent()


def test_seed_aliases_exported() -> None:
    assert quant_nn.LSTM is QuantLSTM and quant_nn.LSTMCell is QuantLSTMCell
    assert {"LSTM", "LSTMCell", "QuantLSTM", "QuantLSTMCell"} <= set(quant_nn.__all__)

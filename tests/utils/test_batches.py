"""qdq's batch convention (qdq.utils.batches): tensors, tuples (positional), dicts (keywords), labels."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.utils.batches import (
    ModelInputs,
    call_model,
    flatten_outputs,
    model_inputs,
    onnx_input_names,
    output_names,
    sample_count,
    sample_slice,
    split_labels,
)


class OneInput(nn.Module):
    def forward(self, x):
        return x * 2


class TwoInputs(nn.Module):
    def forward(self, ids, mask):
        return ids * mask


class OptionalMask(nn.Module):
    def forward(self, x, mask=None):
        return x if mask is None else x * mask


class VarArgs(nn.Module):
    def forward(self, *tensors):
        return sum(tensors)


X = torch.arange(6.0).reshape(2, 3)
IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
LABELS = torch.tensor([3, 7])


def test_tensor_is_the_one_input():
    inputs, labels = split_labels(X, OneInput())
    assert inputs.args == (X,) and inputs.kwargs == {} and labels is None


def test_dict_is_keyword_arguments_and_none_values_are_left_out():
    inputs = model_inputs({"ids": IDS, "mask": MASK, "token_type_ids": None}, TwoInputs())
    assert inputs.args == () and list(inputs.kwargs) == ["ids", "mask"]
    assert torch.equal(call_model(TwoInputs(), {"mask": MASK, "ids": IDS}), IDS * MASK)


def test_tuple_is_positional_arguments():
    inputs, labels = split_labels((IDS, MASK), TwoInputs())
    assert inputs.args == (IDS, MASK) and labels is None
    assert torch.equal(call_model(TwoInputs(), [IDS, MASK]), IDS * MASK)


def test_pair_to_a_one_input_model_drops_the_labels():
    inputs, labels = split_labels((X, LABELS), OneInput())
    assert inputs.args == (X,) and labels is LABELS
    assert torch.equal(call_model(OneInput(), (X, LABELS)), X * 2)


def test_labels_after_a_container_are_dropped():
    inputs, labels = split_labels(((IDS, MASK), LABELS), TwoInputs())
    assert inputs.args == (IDS, MASK) and labels is LABELS
    inputs, labels = split_labels(({"ids": IDS, "mask": MASK}, LABELS, "extra"), TwoInputs())
    assert inputs.kwargs == {"ids": IDS, "mask": MASK} and labels == (LABELS, "extra")
    inputs, labels = split_labels(((X,), LABELS), OptionalMask())
    assert inputs.args == (X,) and labels is LABELS


def test_labels_in_an_optional_positional_slot_are_ambiguous():
    with pytest.raises(QdqConfigError, match=r"ambiguous batch.*\(\(inputs\.\.\.\), labels\)"):
        split_labels((X, LABELS), OptionalMask())
    with pytest.raises(QdqConfigError, match="ambiguous"):
        split_labels((X, LABELS), VarArgs())
    # a float or 2-D second element is an argument, not labels
    assert split_labels((X, X), OptionalMask())[0].args == (X, X)
    assert split_labels((IDS, MASK), VarArgs())[0].args == (IDS, MASK)


def test_labelled_batches_take_the_last_element_as_labels():
    inputs, labels = split_labels((IDS, MASK, LABELS), TwoInputs(), labelled=True)
    assert inputs.args == (IDS, MASK) and labels is LABELS
    inputs, labels = split_labels((X, LABELS), OptionalMask(), labelled=True)
    assert inputs.args == (X,) and labels is LABELS
    inputs, labels = split_labels({"ids": IDS, "labels": LABELS}, TwoInputs(), labelled=True)
    assert set(inputs.kwargs) == {"ids", "labels"} and labels is None


def test_wrappers_are_seen_through():
    compiled = torch.compile(OneInput())  # compiles lazily: nothing runs here
    assert split_labels((X, LABELS), compiled)[1] is LABELS
    parallel = nn.DataParallel(OneInput())
    assert split_labels((X, LABELS), parallel)[1] is LABELS


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ("text", "type str"),
        (None, "type NoneType"),
        ((), "empty batch"),
        ({1: X}, "keys must be strings"),
        ({"x": None}, "no value"),
        ((X, None), "positional argument 1"),
    ],
)
def test_other_batches_raise_one_clear_error(batch, match):
    with pytest.raises(QdqConfigError, match=match):
        model_inputs(batch, OptionalMask())


def test_every_error_names_the_escape_hatch():
    with pytest.raises(QdqConfigError, match="forward_fn"):
        model_inputs(object(), OneInput())


def test_model_without_positional_parameters_wants_a_dict():
    class KeywordsOnly(nn.Module):
        def forward(self, *, x):
            return x

    with pytest.raises(QdqConfigError, match="pass the batch as a dict"):
        model_inputs((X,), KeywordsOnly())


def test_to_moves_tensors_only():
    inputs = ModelInputs((X, 3), {"mask": MASK, "flag": True}).to("meta")
    assert inputs.args[0].device.type == "meta" and inputs.args[1] == 3
    assert inputs.kwargs["mask"].device.type == "meta" and inputs.kwargs["flag"] is True


def test_onnx_names_positional_then_keywords():
    assert onnx_input_names(ModelInputs((X,))) == ["input"]
    assert onnx_input_names(ModelInputs((IDS, MASK))) == ["input_0", "input_1"]
    assert onnx_input_names(ModelInputs((), {"input_ids": IDS, "flag": True, "attention_mask": MASK})) == [
        "input_ids",
        "attention_mask",
    ]
    assert onnx_input_names(ModelInputs((X,), {"attention_mask": MASK})) == ["input", "attention_mask"]
    with pytest.raises(QdqConfigError, match="collide"):
        onnx_input_names(ModelInputs((X,), {"input": MASK}))


def test_outputs_flatten_in_export_order():
    out = {"loss": None, "logits": X, "hidden_states": (IDS, MASK)}
    assert [t is v for t, v in zip(flatten_outputs(out), (X, IDS, MASK))] == [True] * 3
    assert output_names(out) == ["logits", "hidden_states_0", "hidden_states_1"]
    assert output_names((X, IDS)) == ["output_0", "output_1"] and output_names(X) == ["output"]


def test_sample_count_is_dimension_zero_of_the_first_tensor():
    assert sample_count(torch.zeros(5, 3)) == 5
    assert sample_count(((None, torch.zeros(4, 2)), torch.zeros(9))) == 4  # depth first
    assert sample_count({"mask": None, "input_ids": torch.zeros(3, 7, dtype=torch.long)}) == 3
    assert sample_count(torch.tensor(2.0)) is None and sample_count("text") is None and sample_count([]) is None


def test_sample_slice_cuts_every_per_sample_tensor_alike():
    Pair = namedtuple("Pair", "x y")
    x, y, shared = torch.arange(12.0).reshape(6, 2), torch.arange(6), torch.ones(1, 2)
    cut = sample_slice(((x, shared), {"y": y, "n": 3}), 0, 2)
    assert torch.equal(cut[0][0], x[:2]) and cut[0][1] is shared  # dimension 0 of another size: as it is
    assert torch.equal(cut[1]["y"], y[:2]) and cut[1]["n"] == 3
    named = sample_slice(Pair(x, y), 0, 4)
    assert isinstance(named, Pair) and named.x.shape == (4, 2) and named.y.shape == (4,)
    tail = sample_slice(Pair(x, y), 4, 6)
    assert torch.equal(tail.x, x[4:]) and torch.equal(tail.y, y[4:])
    assert sample_slice(x, 0, 6) is x and sample_slice("text", 0, 1) == "text"

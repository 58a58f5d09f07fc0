"""calibrate / collect_stats / ptq / qat / verify take batches as tensors, tuples, dicts and (inputs, labels)
pairs (qdq.utils.batches); a two-input model gets the ranges an independent max gives."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qdq
from qdq.errors import QdqConfigError
from qdq.workflow.calibration import collect_stats, load_amax
from qdq.workflow.fine_tuning import qat
from qdq.workflow.post_training import ptq


class Tagger(nn.Module):
    """Token ids and an attention mask in, per-sequence logits out (a tiny text classifier)."""

    def __init__(self, vocab: int = 20, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, classes)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.fc(h.mean(dim=1))


class LossModel(Tagger):
    """Returns a dict with the loss when given labels, as Hugging Face models do."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = super().forward(input_ids, attention_mask)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def _batches(n=3):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 20, (4, 6), generator=g)
        mask = (torch.rand(4, 6, generator=g) > 0.3).long()
        labels = torch.randint(0, 3, (4,), generator=g)
        out.append((ids, mask, labels))
    return out


def _fc_input_max(model: Tagger, data) -> float:
    """The max |fc input| computed by hand from the embedding table (the max calibrator's range)."""
    with torch.no_grad():
        table = model.embed.weight
        return max(float((table[ids] * mask.unsqueeze(-1)).mean(dim=1).abs().max()) for ids, mask, _ in data)


FORMS = {
    "tuple": lambda ids, mask, y: (ids, mask),
    "dict": lambda ids, mask, y: {"input_ids": ids, "attention_mask": mask},
    "pair_of_tuple": lambda ids, mask, y: ((ids, mask), y),
    "pair_of_dict": lambda ids, mask, y: ({"attention_mask": mask, "input_ids": ids}, y),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_calibrate_feeds_every_form_to_the_model(form):
    model = qdq.quantize_model(Tagger())
    data = _batches()
    qdq.calibrate(model, [FORMS[form](*b) for b in data], progress=False, method="max")
    assert model.fc.input_quantizer.amax.item() == pytest.approx(_fc_input_max(model, data), rel=1e-6)


def test_labels_next_to_positional_inputs_are_an_error_not_a_mask():
    model = qdq.quantize_model(Tagger())
    ids, _, labels = _batches(1)[0]
    with pytest.raises(QdqConfigError, match="ambiguous"):
        qdq.calibrate(model, [(ids, labels)], progress=False, method="max")


def test_images_with_labels_still_calibrate_a_one_input_model():
    model = qdq.quantize_model(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)))
    x = torch.randn(5, 3, 4)
    qdq.calibrate(model, [(x, torch.zeros(5, dtype=torch.long))], progress=False, method="max")
    assert model[1].input_quantizer.amax.item() == float(x.abs().max())


def test_collect_stats_then_load_amax_with_dict_batches():
    model = qdq.quantize_model(Tagger())
    data = _batches()
    collect_stats(model, [FORMS["dict"](*b) for b in data], calibrator="histogram", progress=False)
    load_amax(model, "max")
    assert model.fc.input_quantizer.amax.item() == pytest.approx(_fc_input_max(model, data), rel=1e-6)


def test_ptq_with_dict_batches():
    model = qdq.quantize_model(Tagger())
    data = [FORMS["dict"](*b) for b in _batches()]
    result = ptq(model, data, lambda m: 1.0, methods=("max", "mse"), progress=False)
    assert [r.label for r in result.results] == ["max", "mse"]


@pytest.mark.parametrize("form", ["pair_of_dict", "pair_of_tuple", "triple", "dict_with_labels"])
def test_qat_step_on_each_labelled_form_is_sgd_on_the_cross_entropy(form):
    """One QAT step (momentum 0, the first step runs at lr * lr_scale) equals one SGD step computed by hand on
    cross_entropy(logits, labels) of a copy of the model; the reported loss is that cross-entropy."""
    ids, mask, y = _batches(1)[0]
    model = qdq.quantize_model(LossModel())
    qdq.calibrate(model, [(ids, mask)], progress=False, method="max")
    reference = copy.deepcopy(model)
    loss = nn.functional.cross_entropy(reference(ids, mask)["logits"], y)
    loss.backward()
    expected = reference.fc.weight.detach() - 0.5 * reference.fc.weight.grad
    make = {
        "pair_of_dict": lambda: ({"input_ids": ids, "attention_mask": mask}, y),
        "pair_of_tuple": lambda: ((ids, mask), y),
        "triple": lambda: (ids, mask, y),
        "dict_with_labels": lambda: {"input_ids": ids, "attention_mask": mask, "labels": y},
    }[form]
    result = qat(model, [make()], None, epochs=1, lr=0.5, lr_scale=1.0, momentum=0.0, progress=False)
    assert result.epochs[0]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert torch.allclose(model.fc.weight.detach(), expected, atol=1e-6)


def test_qat_without_labels_says_what_it_needs():
    model = qdq.quantize_model(Tagger())
    ids, mask, _ = _batches(1)[0]
    qdq.calibrate(model, [(ids, mask)], progress=False, method="max")
    with pytest.raises(QdqConfigError, match="QAT needs labels"):
        qat(model, [{"input_ids": ids, "attention_mask": mask}], None, epochs=1, lr=0.1, progress=False)


def test_verify_feeds_dict_batches_by_name(tmp_path):
    pytest.importorskip("onnxruntime")
    model = qdq.quantize_model(Tagger())
    data = _batches()
    qdq.calibrate(model, [(ids, mask) for ids, mask, _ in data], progress=False, method="max")
    path = qdq.export_onnx(model, {"attention_mask": data[0][1], "input_ids": data[0][0]}, tmp_path / "t.onnx")
    forms = [FORMS["dict"](*data[0]), FORMS["pair_of_dict"](*data[1]), FORMS["pair_of_dict"](*data[2])]
    result = qdq.verify(model, path, forms)
    assert result.samples == 12 and result.top1_agreement == 100.0 and result.max_error_steps <= 1.0
    with pytest.raises(QdqConfigError, match="inputs are"):
        qdq.verify(model, path, [(data[0][0], data[0][1])])  # positional names input_0/1 are not in the file

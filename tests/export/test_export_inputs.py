"""export_onnx with tuple and dict example inputs: ONNX inputs named after the keywords, dynamic batch and
sequence axes, and the engine fed by name computing what PyTorch computes at other batch/sequence sizes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_helpers import calibrate_max, ort_session, steps_apart
from torch import nn

import qdq
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.export import export_onnx


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask=None, inputs_embeds=None):
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = torch.relu(self.fc1(h))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        return {"logits": self.fc2(h.sum(dim=1)), "hidden": h}


def _tokens(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2 :] = 0
    return ids, mask


def _quantized():
    torch.manual_seed(0)
    model = qdq.quantize_model(Tagger()).eval()
    ids, _ = _tokens(4, 8)
    calibrate_max(model, ids)  # a positional call: the max of every quantizer's input
    return model


def _dims(path):
    proto = onnx.load(str(path))
    shape = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {v.name: shape(v) for v in proto.graph.input}, [v.name for v in proto.graph.output]


def _ort(path, feed):
    # qdq's session: int8 weights run as uint8 on a CPU whose int8 dot products saturate (x86 without VNNI),
    # where a plain InferenceSession's MatMulIntegerToFloat departs by tens of steps
    return ort_session(path).run(None, {k: v.numpy() for k, v in feed.items()})


@pytest.mark.parametrize("dynamo", [True, False])
def test_dict_inputs_are_named_by_keyword_with_batch_and_sequence_axes(tmp_path, dynamo):
    model = _quantized()
    ids, mask = _tokens(2, 8)
    path = export_onnx(model, {"attention_mask": mask, "input_ids": ids}, tmp_path / "t.onnx", dynamo=dynamo)
    inputs, outputs = _dims(path)
    assert inputs == {"attention_mask": ["batch", "sequence"], "input_ids": ["batch", "sequence"]}
    assert outputs == ["logits", "hidden"]
    for batch, seq in ((3, 5), (1, 11)):
        ids, mask = _tokens(batch, seq, seed=batch)
        logits, hidden = _ort(path, {"input_ids": ids, "attention_mask": mask})
        with torch.no_grad():
            expected = model(ids, attention_mask=mask)
        assert logits.shape == (batch, 4) and hidden.shape == (batch, seq, 16)
        assert steps_apart(expected["logits"].numpy(), logits) <= 0.01
        assert steps_apart(expected["hidden"].numpy(), hidden) <= 0.01


@pytest.mark.parametrize("dynamo", [True, False])
def test_tuple_inputs_are_input_0_input_1(tmp_path, dynamo):
    model = _quantized()
    ids, mask = _tokens(2, 8)
    path = export_onnx(model, (ids, mask), tmp_path / "t.onnx", dynamo=dynamo)
    inputs, _ = _dims(path)
    assert inputs == {"input_0": ["batch", "sequence"], "input_1": ["batch", "sequence"]}
    ids, mask = _tokens(3, 6, seed=5)
    logits, _ = _ort(path, {"input_0": ids, "input_1": mask})
    with torch.no_grad():
        assert steps_apart(model(ids, mask)["logits"].numpy(), logits) <= 0.01


def test_inputs_embeds_get_a_sequence_axis_and_float_images_do_not(tmp_path):
    model = _quantized()
    embeds = torch.randn(2, 8, 16)
    ids, _ = _tokens(2, 8)
    path = export_onnx(model, {"input_ids": ids, "inputs_embeds": embeds}, tmp_path / "t.onnx")
    inputs, _ = _dims(path)
    assert inputs["inputs_embeds"] == ["batch", "sequence", 16]
    image_model = qdq.quantize_model(nn.Sequential(nn.Flatten(), nn.Linear(12, 2))).eval()
    calibrate_max(image_model, torch.randn(2, 3, 4))
    path = export_onnx(image_model, torch.randn(2, 3, 4), tmp_path / "i.onnx")
    assert _dims(path)[0] == {"input": ["batch", 3, 4]}


def test_explicit_dynamic_axes_and_fixed_sequence(tmp_path):
    model = _quantized()
    ids, mask = _tokens(2, 8)
    example = {"input_ids": ids, "attention_mask": mask}
    axes = {"input_ids": {0: "n", -1: "len"}, "attention_mask": {0: "n", 1: "len"}}
    path = export_onnx(model, example, tmp_path / "a.onnx", dynamic_axes=axes)
    assert _dims(path)[0] == {"input_ids": ["n", "len"], "attention_mask": ["n", "len"]}
    path = export_onnx(model, example, tmp_path / "a2.onnx", dynamic_axes={"input_ids": {}, "attention_mask": {}})
    assert _dims(path)[0] == {"input_ids": [2, 8], "attention_mask": [2, 8]}
    path = export_onnx(model, example, tmp_path / "b.onnx", dynamic_sequence=False)
    assert _dims(path)[0] == {"input_ids": ["batch", 8], "attention_mask": ["batch", 8]}
    path = export_onnx(model, example, tmp_path / "c.onnx", dynamic_batch=False, dynamic_sequence=False)
    assert _dims(path)[0] == {"input_ids": [2, 8], "attention_mask": [2, 8]}


def test_bad_examples_raise_one_clear_error(tmp_path):
    model = _quantized()
    ids, _ = _tokens(2, 8)
    with pytest.raises(QdqConfigError, match=r"dynamic_axes names inputs \['mask'\]"):
        export_onnx(model, {"input_ids": ids}, tmp_path / "x.onnx", dynamic_axes={"mask": {0: "batch"}})
    with pytest.raises(QdqConfigError, match="maps axes to names"):
        export_onnx(model, {"input_ids": ids}, tmp_path / "x.onnx", dynamic_axes={"input_ids": {5: "batch"}})
    with pytest.raises(QdqTypeError, match="example_input"):
        export_onnx(model, "ids", tmp_path / "x.onnx")
    with pytest.raises(QdqTypeError, match="at least one tensor"):
        export_onnx(model, {"flag": True}, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_hugging_face_bert_from_a_config_exports_with_dict_inputs(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = qdq.quantize_model(transformers.BertForSequenceClassification(config).eval())
    data = []
    for seed in range(2):
        ids, mask = _tokens(4, 12, seed)
        data.append({"input_ids": ids % 50, "attention_mask": mask})
    qdq.calibrate(model, data, progress=False, method="max")
    path = export_onnx(model, data[0], tmp_path / "bert.onnx")
    inputs, outputs = _dims(path)
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    assert outputs == ["logits"]
    ids, mask = _tokens(3, 20, seed=7)
    result = qdq.verify(model, path, [({"input_ids": ids % 50, "attention_mask": mask}, torch.zeros(3))])
    assert result.samples == 3 and result.max_error_steps <= 1.0
    assert np.isfinite(result.sqnr_db).all() or result.sqnr_db == [float("inf")]

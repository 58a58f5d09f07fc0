"""A Hugging Face BERT through both doors: exported to ONNX then :func:`qdq.quantize_onnx`, against
:func:`qdq.quantize_model` then :func:`qdq.export_onnx`. The ONNX door finds the attention the export writes out op
by op (MatMul, scale, mask Add, Softmax, MatMul) and the target's attention facts place its Q/DQ as they place the
PyTorch door's attention module's: the query, the key, the probabilities and V read quantized by the two attention
MatMuls with the same steps, the softmax scale on the query where the target says (ONNX Runtime: folded into the
query's QuantizeLinear by the rewrite in both files), on the same calibration data (max, as the CNN test of
``test_two_doors.py``). Random init (seeded), the biases 0 as transformers initializes them (the onnxruntime
target's PyTorch door folds the key and value biases away, a change of the float model the ONNX door does not make).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import qdq
from qdq.graphs.onnx_tags import INPUT_SCALE_KEY

transformers = pytest.importorskip("transformers")

_LAYOUT = ("Transpose", "Reshape")
_QDQ = ("QuantizeLinear", "DequantizeLinear")


class _Encoder(torch.nn.Module):
    """The model's last hidden state from positional ids and mask (the TorchScript exporter's calling form)."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=16)  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation("eager")  # attention written out op by op in the float export
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    found = []
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[0, 5 + seed :] = 0  # padding: the mask takes part
        found.append({"input_ids": torch.randint(0, 64, (2, 8), generator=generator), "attention_mask": mask})
    return found


def attention_reads(path) -> dict[tuple[int, int], tuple[np.ndarray, int, float | None]]:
    """``(rank among the MatMuls of two activations, input index) -> (step, zero point, factor folded into the Q)``
    for each input of such a MatMul (Q·Kᵀ, probs·V) read through a DequantizeLinear, looking through the layout ops
    between them (the key's transpose); steps as float64 arrays, the factor None where the Q has none."""
    graph = onnx.load(str(path)).graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant"})  # fmt: skip
    producer = {out: node for node in graph.node for out in node.output}

    def dequantized(name: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        while node is not None and node.op_type in _LAYOUT:
            node = producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    def source(name: str) -> str:
        while (node := producer.get(name)) is not None and node.op_type in (*_LAYOUT, *_QDQ):
            name = node.input[0]
        return name

    matmuls = [n for n in graph.node if n.op_type == "MatMul" and not any(source(i) in constants for i in n.input)]
    reads = {}
    for rank, matmul in enumerate(matmuls):
        for index, name in enumerate(matmul.input):
            dq = dequantized(name)
            if dq is None:
                continue
            q = producer[dq.input[0]]
            factor = {p.key: p.value for p in q.metadata_props}.get(INPUT_SCALE_KEY)
            step, zero = constants[dq.input[1]].astype(np.float64), int(constants[dq.input[2]].reshape(-1)[0])
            reads[(rank, index)] = (step.reshape(-1), zero, None if factor is None else float(factor))
    return reads


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_both_doors_quantize_the_same_attention_reads_with_the_same_steps(tmp_path, target):
    model, data = _bert(), _batches()
    float_path = tmp_path / "float.onnx"
    dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, transformers' tracer warnings
        torch.onnx.export(_Encoder(model), (data[0]["input_ids"], data[0]["attention_mask"]), str(float_path),
                          dynamo=False, opset_version=17, input_names=list(dynamic), output_names=["hidden"],
                          dynamic_axes=dynamic)  # fmt: skip
        onnx_door = qdq.quantize_onnx(float_path, [{k: v.numpy() for k, v in d.items()} for d in data],
                                      tmp_path / "onnx_door.onnx", target=target, method="max",
                                      bias_correction=False, progress=False).path  # fmt: skip
        quantized = qdq.quantize_model(_Encoder(copy.deepcopy(model)), qdq.QuantConfig(target=target))
        qdq.calibrate(quantized, [tuple(d.values()) for d in data], method="max", progress=False)
        torch_door = qdq.export_onnx(quantized, tuple(data[0].values()), tmp_path / "torch_door.onnx",
                                     dynamo=False)  # fmt: skip

    ours, theirs = attention_reads(onnx_door), attention_reads(torch_door)
    assert sorted(ours) == sorted(theirs) == [(rank, index) for rank in range(4) for index in (0, 1)]
    for read, (step, zero, factor) in ours.items():
        other_step, other_zero, other_factor = theirs[read]
        assert (zero, factor) == (other_zero, other_factor), read
        # max calibration on the same data: ranges equal up to float32 summation order (ORT vs PyTorch kernels)
        np.testing.assert_allclose(step, other_step, rtol=2e-6, err_msg=str(read))
    folded = [factor for _, _, factor in ours.values() if factor is not None]
    assert folded == ([0.25, 0.25] if target == "onnxruntime" else [])  # the softmax scale, 1/sqrt(16), on Q

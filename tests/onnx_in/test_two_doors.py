"""One PyTorch model through both doors: exported to ONNX then :func:`qdq.quantize_onnx`, against
:func:`qdq.quantize_model` then :func:`qdq.export_onnx`. On the same calibration data the two files quantize the
same reads of the same tensors with the same steps (the placement rules are written once), whatever names and
exporter details differ.

The BatchNorms are folded into the convolutions before either door: the ONNX door folds them before quantizing
the weights, the PyTorch door quantizes a convolution's own weight (BatchNorm folded at export), so unfolded models
differ in their weight ranges by design. The ONNX door's bias correction is off: the PyTorch door has none, and a
corrected zero bias (MobileNetV2's classifier) would add a bias read the other file leaves out.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import qdq

torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.slow

_QDQ = ("QuantizeLinear", "DequantizeLinear")


def _folded(name: str) -> torch.nn.Module:
    from torch.fx.experimental.optimization import fuse

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    for module in model.modules():  # BatchNorms that do something, so that folding them matters
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
    return fuse(model)


def quantized_reads(path) -> dict[tuple, tuple]:
    """``(consumer op type, its rank among ops of that type, input index) -> (source role, step, zero point)`` for
    every input read through a DequantizeLinear: the source is the float tensor behind the Q/DQ (the producer op's
    type and rank, ``("graph input",)`` or ``("weight",)``), steps as float64 arrays."""
    graph = onnx.load(str(path)).graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    producer = {out: node for node in graph.node for out in node.output}
    ops = [n for n in graph.node if n.op_type not in (*_QDQ, "Constant")]
    rank = {id(n): (n.op_type, sum(m.op_type == n.op_type for m in ops[:k])) for k, n in enumerate(ops)}

    def source(name: str) -> tuple:
        node = producer.get(name)
        while node is not None and node.op_type in _QDQ:
            name, node = node.input[0], producer.get(node.input[0])
        if node is not None and node.op_type != "Constant":
            return rank[id(node)]
        return ("weight",) if name in constants or node is not None else ("graph input",)

    reads = {}
    for op in ops:
        for index, name in enumerate(op.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            step = constants[dq.input[1]].astype(np.float64)
            zero = int(constants[dq.input[2]].reshape(-1)[0]) if len(dq.input) > 2 else 0
            reads[(*rank[id(op)], index)] = (source(dq.input[0]), step, zero)
    return reads


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_both_doors_quantize_the_same_reads_with_the_same_steps(tmp_path, name, target):
    model = _folded(name)
    data = [torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    float_path = tmp_path / "float.onnx"
    torch.onnx.export(model, (data[0][:1],), str(float_path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    onnx_door = qdq.quantize_onnx(float_path, [{"x": d.numpy()} for d in data], tmp_path / "onnx_door.onnx",
                                  target=target, method="max", bias_correction=False,
                                  progress=False).path  # fmt: skip
    quantized = qdq.quantize_model(copy.deepcopy(model), qdq.QuantConfig(target=target))
    qdq.calibrate(quantized, data, method="max", progress=False)
    torch_door = qdq.export_onnx(quantized, data[0][:1], tmp_path / "torch_door.onnx", dynamo=False)

    ours, theirs = quantized_reads(onnx_door), quantized_reads(torch_door)
    assert sorted(ours) == sorted(theirs)  # the same inputs of the same ops read through Q/DQ
    weights = sum(1 for source, _, _ in ours.values() if source == ("weight",))
    assert weights >= {"resnet18": 21, "mobilenet_v2": 53}[name]  # every conv and the classifier
    for read, (source, step, zero) in ours.items():
        other_source, other_step, other_zero = theirs[read]
        assert (source, zero) == (other_source, other_zero), read
        # max calibration on the same data: ranges equal up to float32 summation order (ORT vs PyTorch kernels)
        np.testing.assert_allclose(step, other_step, rtol=2e-6, err_msg=str(read))


def test_both_doors_choose_the_same_method_by_default(tmp_path):
    """The default calibration (auto) of a torchvision ResNet-18 through both doors: the same held-out batches, the
    same candidates with the same output fidelity (up to float32 kernels and the roundings they flip: 0.5 dB) and
    the same method chosen. Its inputs have rare large values that a linear first layer carries."""
    model = _folded("resnet18")
    data = []
    for i in range(8):
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i))
        x[:, :, i % 4, (3 * i) % 32] = 40.0  # a bright spot in every image
        data.append(x)
    float_path = tmp_path / "float.onnx"
    torch.onnx.export(model, (data[0][:1],), str(float_path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    onnx_door = qdq.quantize_onnx(float_path, [{"x": d.numpy()} for d in data], tmp_path / "onnx_door.onnx",
                                  target="onnxruntime", bias_correction=False, progress=False)  # fmt: skip
    quantized = qdq.quantize_model(copy.deepcopy(model), qdq.QuantConfig(target="onnxruntime"))
    torch_door = qdq.workflow.select_amax(quantized, data, progress=False, bias_correction=False)
    assert onnx_door.auto is not None and onnx_door.auto.held_out and torch_door.held_out
    assert onnx_door.auto.batches == torch_door.batches == 2
    assert onnx_door.auto.chosen == torch_door.chosen and onnx_door.method == f"auto: {torch_door.chosen}"
    for label, score in torch_door.scores.items():
        assert abs(onnx_door.auto.scores[label] - score) < 0.5, (label, onnx_door.auto.table(), torch_door.table())

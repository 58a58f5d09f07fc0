"""PreparedModel: an FP32 ONNX file loaded and prepared once, placed and written again with other float tensors.

The expectation is derived without the object under test: each file written from one prepared model must hold the
same nodes and initializers as ``quantize_onnx`` makes from the file itself (its own load, preparation and
calibration), for every set of float tensors.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from onnx_models import ConvNet, batches, export
from qdq.errors import QdqConfigError
from qdq.onnx_in.prepared import PreparedModel
from qdq.onnx_in.quantize import quantize_onnx
from qdq.targets import ONNXRUNTIME, TENSORRT


def _nodes(graph: onnx.GraphProto) -> list[tuple]:
    return [(n.op_type, n.domain, tuple(n.input), tuple(n.output), tuple(a.SerializeToString() for a in n.attribute))
            for n in graph.node]  # fmt: skip


def _initializers(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}


def _assert_same_graph(path, expected_path) -> None:
    graph, expected = onnx.load(str(path)).graph, onnx.load(str(expected_path)).graph
    assert _nodes(graph) == _nodes(expected)
    found, wanted = _initializers(graph), _initializers(expected)
    assert found.keys() == wanted.keys()
    for name, array in wanted.items():
        assert found[name].dtype == array.dtype and np.array_equal(found[name], array), name


@pytest.mark.filterwarnings(r"ignore:.*Conv\(s\) will run in float")  # the unit left float, on purpose
@pytest.mark.parametrize("target", [ONNXRUNTIME, TENSORRT], ids=lambda t: t.name)
def test_placed_twice_with_other_float_tensors_it_writes_what_quantize_onnx_writes_from_the_file(target, tmp_path):
    path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "convnet.onnx")
    data = batches((2, 3, 16, 16), count=3)
    prepared = PreparedModel.load(path)
    before = prepared.model.SerializeToString()
    units = prepared.units(target)
    assert len(units) >= 3 and all(units)
    for floated in ([], list(units[1])):  # plain INT8, then one unit left float
        out = tmp_path / f"prepared_{len(floated)}.onnx"
        expected = tmp_path / f"file_{len(floated)}.onnx"
        quantize_onnx(prepared, data, out, target=target, method="max", float_values=floated, progress=False)
        from_file = quantize_onnx(str(path), data, expected, target=target, method="max", float_values=floated,
                                  progress=False)  # fmt: skip
        _assert_same_graph(out, expected)
        assert from_file.prepared == prepared.changes  # what preparing did, done once here
        quantized = {n.input[0] for n in onnx.load(str(out)).graph.node if n.op_type == "QuantizeLinear"}
        assert not set(floated) & quantized
    assert prepared.model.SerializeToString() == before  # each placement wrote a copy


def test_a_placement_lists_its_units_and_a_model_placed_without_a_copy_is_spent(tmp_path):
    path = export(ConvNet(), torch.randn(1, 3, 16, 16), tmp_path / "convnet.onnx")
    prepared = PreparedModel.load(path)
    assert PreparedModel.load(prepared) is prepared
    units = prepared.units(ONNXRUNTIME)
    placed = prepared.place(ONNXRUNTIME, float_values=list(units[0]))
    assert placed.model is not prepared.model and units[0] not in placed.units() and placed.units() == units[1:]
    values = prepared.values(list(units[0]), batches((2, 3, 16, 16), count=1)[0])
    assert set(values) == set(units[0]) and all(v.shape[0] == 2 for v in values.values())
    with pytest.raises(QdqConfigError, match="does not have"):
        prepared.place(ONNXRUNTIME, float_values=["no_such_tensor"])
    assert prepared.place(ONNXRUNTIME, copy=False).model is prepared.model
    with pytest.raises(QdqConfigError, match="copy=False"):
        prepared.place(ONNXRUNTIME)

"""PrecisionReport (qdq.runtime.openvino.precision) on hand-made layer lists: counts, compute layers, Markdown.

No OpenVINO needed: the report is plain data; ``openvino._layer`` is fed a stand-in for a runtime-graph node.
"""

from __future__ import annotations

from qdq.runtime.openvino.compiled import _layer
from qdq.runtime.openvino.precision import COMPUTE_LAYER_TYPES, INT8_PRECISIONS, LayerPrecision, PrecisionReport

LAYERS = (
    LayerPrecision("input", "Input", "f32"),
    LayerPrecision("conv1", "Convolution", "u8"),
    LayerPrecision("relu1", "Eltwise", "f32"),
    LayerPrecision("conv2", "Convolution", "u8"),
    LayerPrecision("dw", "GroupConvolution", "i8"),
    LayerPrecision("conv3", "Convolution", "u8"),
    LayerPrecision("conv4", "Convolution", "f32"),
    LayerPrecision("fc", "FullyConnected", "bf16"),
)


def report(layers=LAYERS) -> PrecisionReport:
    return PrecisionReport("m.onnx", "f32", tuple(layers))


def table(markdown: str) -> list[list[str]]:
    """The cells of the Markdown table rows in ``markdown`` (header first, separator left out)."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [row for row in cells if not set("".join(row)) <= {"-"}]


def test_counts_by_layer_type_and_precision():
    r = report()
    assert r.counts() == {"u8": 3, "f32": 1}  # Convolution by default
    assert r.counts("GroupConvolution") == {"i8": 1}
    assert r.counts("Deconvolution") == {}
    assert {"u8", "i8"} == INT8_PRECISIONS
    assert "Eltwise" not in COMPUTE_LAYER_TYPES


def test_compute_layers_and_those_left_in_float():
    r = report()
    assert [layer.name for layer in r.compute_layers] == ["conv1", "conv2", "dw", "conv3", "conv4", "fc"]
    assert [layer.name for layer in r.float_compute_layers] == ["conv4", "fc"]


def test_markdown_table_and_float_layers_line():
    text = report().to_markdown()
    assert text.splitlines()[0] == "OpenVINO runtime precision: m.onnx (inference precision f32)"
    assert table(text) == [
        ["layer type", "bf16", "f32", "i8", "u8", "total"],
        ["Convolution", "0", "1", "0", "3", "4"],
        ["GroupConvolution", "0", "0", "1", "0", "1"],
        ["FullyConnected", "1", "0", "0", "0", "1"],
    ]
    assert text.splitlines()[-1] == "compute layers not in int8: conv4 (f32), fc (bf16)"
    assert str(report()) == text


def test_all_float_or_all_int8_models_have_no_float_layers_line():
    floats = report([LayerPrecision(f"c{i}", "Convolution", "f32") for i in range(3)])
    assert table(floats.to_markdown())[1:] == [["Convolution", "3", "3"]]
    assert "not in int8" not in floats.to_markdown()  # every layer float: nothing to single out
    ints = report([LayerPrecision("c", "Convolution", "u8")])
    assert "not in int8" not in ints.to_markdown()


def test_long_float_layer_lists_are_cut_after_ten():
    layers = [LayerPrecision(f"f{i}", "MatMul", "f32") for i in range(12)] + [LayerPrecision("q", "MatMul", "u8")]
    line = report(layers).to_markdown().splitlines()[-1]
    assert line.endswith("f9 (f32), … (+2)") and "f10" not in line


def test_no_compute_layers():
    text = report([LayerPrecision("in", "Input", "f32")]).to_markdown()
    assert table(text)[1] == ["(none)", "0"]


class _Value:
    def __init__(self, text: str) -> None:
        self.text = text

    def astype(self, kind: type) -> str:
        assert kind is str
        return self.text


class _Node:
    """Stands in for an ``openvino.Node`` of a compiled model's runtime graph."""

    def __init__(self, name: str, info: dict[str, str]) -> None:
        self._name, self._info = name, {k: _Value(v) for k, v in info.items()}

    def get_friendly_name(self) -> str:
        return self._name

    def get_rt_info(self) -> dict[str, _Value]:
        return self._info


def test_layers_are_read_from_runtime_info():
    node = _Node("conv1", {"layerType": "Convolution", "runtimePrecision": "u8"})
    assert _layer(node) == LayerPrecision("conv1", "Convolution", "u8")
    assert _layer(_Node("odd", {})) == LayerPrecision("odd", "?", "?")

"""A third target registered from outside qdq runs end to end: quantize -> calibrate -> export -> ONNX Runtime.

The toy target, written here as a user would write one, quantizes only Linear layers: its one placement rule, a
function of the front-end-neutral graph view, keeps every other quantized op float, its ONNX rewrite takes one
option with an export default, and it says ONNX Runtime runs its graphs with a caveat. Nothing in qdq is edited;
the target is removed afterwards.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import qdq
from qdq.export import export_onnx, qdq_sites
from qdq.runtime import load_runtime
from qdq.targets import (
    ExportDefaults,
    PlacementRule,
    RuntimeSupport,
    Target,
    get_target,
    register_target,
    unregister_target,
)
from qdq.targets.marks import placed_target

X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))


def linear_layers_only(view) -> None:
    """Every quantized op but the Linear layers (ONNX ``Gemm``) stays float: one rule on the graph view."""
    for op in view.ops:
        quantized = any(view.reads_quantized(op, i) for i in range(len(op.inputs)))
        if op.type != "Gemm" and quantized:
            view.keep_float(op, "the toy NPU runs Linear layers only")


def tag_graph(model: onnx.ModelProto, *, tag: str) -> dict[str, int]:
    model.doc_string = f"for the toy NPU ({tag})"
    return {"tagged": 1}


TOY = Target(
    name="toy_npu",
    description="a toy accelerator that runs Linear layers in int8",
    placement_rules=(PlacementRule("linear_layers_only", linear_layers_only),),
    onnx_rewrite=tag_graph,
    export=ExportDefaults(options={"tag": "default"}),
    runtimes=(RuntimeSupport("onnxruntime", "runs", "only its Linear layers are quantized"),),
)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv(x))).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture
def toy_target():
    register_target(TOY)
    yield TOY
    unregister_target(TOY.name)


@pytest.mark.parametrize("options", [None, {"tag": "given"}], ids=["export-defaults", "target-options"])
def test_a_target_registered_from_outside_runs_end_to_end(toy_target, options, tmp_path):
    torch.manual_seed(0)
    model = qdq.quantize_model(Classifier().eval(), qdq.QuantConfig(target="toy_npu"))
    assert placed_target(model) == "toy_npu" and get_target("toy_npu") is TOY
    enabled = sorted(n for n, m in model.named_modules() if isinstance(m, qdq.TensorQuantizer) and m.is_enabled)
    assert enabled == [f"fc{i}._{kind}_quantizer" for i in (1, 2) for kind in ("input", "weight")]
    qdq.calibrate(model, [X[:2], X[2:]], method="max", progress=False)

    path = export_onnx(model, X, tmp_path / "toy.onnx", dynamo=False, target_options=options)
    proto = onnx.load(str(path))
    assert {p.key: p.value for p in proto.metadata_props}["qdq.target"] == "toy_npu"
    assert proto.doc_string == f"for the toy NPU ({(options or {}).get('tag', 'default')})"
    assert sorted(n for s in qdq_sites(proto) for n in s.quantizers) == enabled

    with load_runtime(path, "onnxruntime", threads=1) as runtime:
        engine = runtime.run(X.numpy())[0]
        assert runtime.advice == (
            "1 of 1 Convs run in float on ONNX Runtime. toy.onnx was exported for target 'toy_npu': only its Linear "
            "layers are quantized. Quantize the float "
            "model for target 'onnxruntime' (qdq.QuantConfig(target='onnxruntime')) and export it again for this "
            "runtime."
        )
    with torch.no_grad():
        reference = model(X).numpy()
    step = np.abs(reference).max() / 127
    assert np.abs(engine - reference).max() <= step  # float convs, int8 Linear layers: within one output step


def test_the_toy_target_is_gone_after_the_test():
    from qdq.targets import target_names

    assert "toy_npu" not in target_names()

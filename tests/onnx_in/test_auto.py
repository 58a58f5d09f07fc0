"""The ONNX door's auto: one session whose activation steps are inputs scores any ranges exactly as a Q/DQ copy of
the graph written with those ranges (what the candidates and the refinement's trials are scored by)."""

from __future__ import annotations

import numpy as np
import pytest

from qdq.onnx_in.auto import _score, _StepFed
from qdq.onnx_in.calibrate import collect, weight_ranges
from qdq.onnx_in.prepared import PreparedModel
from qdq.onnx_in.samples import SampleAxes
from qdq.targets import resolve_target
from qdq.workflow.auto_calibration import candidates, held_out
from qdq.workflow.refinement import halves, samples_of

from .test_attention import _attention, _feeds
from .test_families import batches, if_with_weights


def _conv_model():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                              torch.nn.Sigmoid()).eval()  # fmt: skip
    return net


@pytest.mark.parametrize("which", ["attention", "convs", "if"])
def test_fed_steps_score_as_a_written_copy(tmp_path, which):
    """The attention's query step carries the softmax scale moved onto it; the convs inside an If branch read their
    steps from the outer scope."""
    if which == "if":
        if_with_weights(tmp_path / "if.onnx")
        model = str(tmp_path / "if.onnx")
        feeds = [{**b, "cond": np.array(True)} for b in batches((4, 3, 8, 8), name="x", count=8)]
    elif which == "attention":
        model, feeds = _attention("div"), _feeds(_attention("div"), count=8)
    else:
        import torch

        path = tmp_path / "convs.onnx"
        torch.onnx.export(_conv_model(), torch.zeros(2, 3, 8, 8), path, input_names=["x"], opset_version=17,
                          dynamic_axes={"x": {0: "n"}}, dynamo=False)  # fmt: skip
        model = str(path)
        rng = np.random.default_rng(0)
        feeds = [{"x": rng.normal(size=(4, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    placement = PreparedModel.load(model).place(resolve_target("onnxruntime"), None, (), [], copy=True,
                                                batches=feeds[:4])  # fmt: skip
    proto, view = placement.model, placement.view
    statistics = collect(proto, view, feeds, "histogram", held_out=held_out, progress=False)
    weights = weight_ranges(proto, view)
    grid = candidates()
    first = statistics.ranges(grid[0][0].name, **grid[0][1])
    fed = _StepFed(proto, view, first, weights, None)
    assert fed.steps.keys() == first.keys()  # every activation step is an input
    for method, options in grid:
        ranges = statistics.ranges(method.name, **options)
        written = _score(proto, view, {**ranges, **weights}, statistics.scored, None)
        assert fed.meter(ranges, statistics.scored).score() == pytest.approx(written, abs=1e-6), method.name


def test_one_held_out_batch_is_split_by_its_samples_where_the_front_end_can():
    feed = {"x": np.arange(8.0).reshape(8, 1)}
    pair = (feed, [np.arange(8.0) * 2])
    rows = SampleAxes({"x": 0}, (0,)).halves  # dimension 0 dynamic in the input: the outputs along dimension 0 too
    first, second = halves([pair], lambda p: samples_of(p[1]), rows)
    assert len(first) == len(second) == 1
    assert first[0][0]["x"].ravel().tolist() == [0, 1, 2, 3] and second[0][1][0].tolist() == [8, 10, 12, 14]
    assert halves([pair], lambda p: samples_of(p[1]), lambda p: None) is None  # the front end cannot split it
    # an output whose samples are not along dimension 0 (a state [layers, batch, width] no name says): not split
    assert rows((feed, [np.zeros((2, 8, 4))])) is None and rows(({"x": np.zeros((1, 3))}, [np.zeros(1)])) is None


def test_a_file_with_a_fixed_batch_holds_whole_batches_out(tmp_path):
    """A graph input whose dimension 0 is a number (an export without a dynamic batch axis) cannot run a part of a
    batch: the default holds every 4th batch out whole (each was split by one sample, which ONNX Runtime refused)."""
    import torch

    from qdq.onnx_in.calibrate import kept_parts

    path = tmp_path / "static.onnx"
    torch.onnx.export(_conv_model(), torch.zeros(4, 3, 8, 8), path, input_names=["x"], opset_version=17, dynamo=False)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.normal(size=(4, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    placement = PreparedModel.load(str(path)).place(resolve_target("onnxruntime"), None, (), [], copy=True)
    statistics = collect(placement.model, placement.view, feeds, "histogram", held_out=held_out, progress=False)
    assert [feed["x"].shape[0] for feed, _ in statistics.scored] == [4, 4]  # batches 3 and 7, whole
    assert [part["x"].shape[0] for part in kept_parts(placement.model, feeds, held_out)] == [4, 4, 4, 4, 4, 4]
    from qdq.onnx_in.quantize import quantize_onnx

    result = quantize_onnx(str(path), feeds, tmp_path / "int8.onnx", target="onnxruntime", progress=False)
    assert result.auto is not None and result.auto.held_out

"""qdq.quantize_onnx on the families of graphs real files hold, one small generated graph per family.

Each graph stands for a family a public model showed (issue 44): its file is written here with ``onnx.helper`` or
exported from a tiny PyTorch module, quantized, and checked against numbers derived apart from qdq: the node types
ONNX Runtime runs, counts of int8 kernels, node-name uniqueness, outputs against FP32 within a number of steps.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torchvision.ops import roi_align

import qdq
from onnx_models import batches, export
from qdq.runtime.ort import fusion_report, inference_session, session_options


def run(path: Path, feed: dict[str, np.ndarray], optimize: bool = True) -> np.ndarray:
    """The first output of ``path`` on ONNX Runtime: its int8 kernels, or (``optimize=False``) the Q/DQ graph
    computed in float, what the file means."""
    options = session_options(threads=1, optimization_level="all" if optimize else "disable")
    return np.asarray(inference_session(path, options).run(None, feed)[0])


def steps_apart(reference: np.ndarray, other: np.ndarray) -> float:
    """The largest difference, in steps of an 8-bit grid over ``reference``'s range."""
    return float(np.abs(reference - other).max() / (np.abs(reference).max() / 127))


class UpsampleLike(nn.Module):
    """U²-Net's ``_upsample_like``: a ReLU conv output upsampled (bilinear) to the size of an earlier tensor, read
    from that tensor's shape at run time, and concatenated with it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        early = self.a(x)
        late = self.b(early)
        up = nn.functional.interpolate(late, size=early.shape[2:], mode="bilinear", align_corners=False)
        return self.head(torch.cat([up, early], 1))


def test_a_conv_upsampled_to_a_size_computed_at_run_time_runs_in_int8(tmp_path: Path) -> None:
    """u2netp: a Resize whose sizes come from Shape arithmetic (an int64 tensor, not a constant) read the ReLU
    conv's output; the sizes counted as data said nothing is >= 0 after the Resize, so the shared range went
    signed, the ReLU could not fold and the conv ran in float. Every conv is a QLinearConv now."""
    torch.manual_seed(0)
    path = export(UpsampleLike(), torch.randn(1, 3, 16, 16), tmp_path / "up.onnx",
                  dynamic={"images": {0: "batch", 2: "height", 3: "width"}})  # fmt: skip
    resize = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Resize")
    assert resize.input[3] and resize.input[3] not in {t.name for t in onnx.load(str(path)).graph.initializer}
    result = qdq.quantize_onnx(path, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False, method="max")  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 3} and not report.float_kernels


class SamePadConv(nn.Conv2d):
    """``efficientnet_pytorch``'s ``Conv2dDynamicSamePadding`` (timm's ``Conv2dSame``): TensorFlow's same padding,
    the amounts computed from the input's shape at run time, then the conv unpadded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (height, width), (kh, kw), (sh, sw) = x.shape[-2:], self.weight.shape[-2:], self.stride
        ph = max((math.ceil(height / sh) - 1) * sh + kh - height, 0)
        pw = max((math.ceil(width / sw) - 1) * sw + kw - width, 0)
        x = nn.functional.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class SamePadNet(nn.Module):
    """Two same-padding convs (strided, then depthwise) with ReLU6, then a constant pad before a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = SamePadConv(3, 8, 3, stride=2), SamePadConv(8, 8, 3, groups=8)
        self.c = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu6(self.b(nn.functional.relu6(self.a(x))))
        return self.c(nn.functional.pad(x, [1, 1, 1, 1]))


def test_padding_before_a_conv_runs_on_int8_data(tmp_path: Path) -> None:
    """EfficientNet-Lite's same-padding convs: ``Pad`` nodes fed by Shape/Slice/Concat arithmetic, and a constant
    pad. Every conv is a QLinearConv, and each Pad after an int8 op pads the integers (ONNX Runtime leaves
    ``DQ -> Pad -> Q`` in float): no Q/DQ is left without an int8 kernel behind it."""
    torch.manual_seed(0)
    float_path = export(SamePadNet(), torch.randn(1, 3, 16, 16), tmp_path / "same.onnx",
                        dynamic={"images": {0: "batch", 2: "height", 3: "width"}})  # fmt: skip
    assert sum(n.op_type == "Pad" for n in onnx.load(str(float_path)).graph.node) == 3
    result = qdq.quantize_onnx(float_path, batches((2, 3, 16, 16)), tmp_path / "int8.onnx", target="onnxruntime",
                               progress=False, method="max")  # fmt: skip
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 3} and not report.float_kernels
    assert not report.idle
    model = onnx.load(str(result.path))
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    pads = [n for n in model.graph.node if n.op_type == "Pad"]
    assert [producers.get(n.input[0]) for n in pads] == [None, "QuantizeLinear", "QuantizeLinear"]  # input, int8
    feed = batches((2, 3, 20, 18), count=1, seed=4)[0]  # another size: other pad amounts
    assert steps_apart(run(float_path, feed), run(result.path, feed)) <= 6.0
    engine, graph = run(result.path, feed), run(result.path, feed, optimize=False)
    assert steps_apart(graph, engine) <= 1.0


def old_export(path: Path) -> Path:
    """What an old PyTorch wrote (IR version 3, opset 9): every initializer listed among the graph inputs too (a
    BatchNorm's ``num_batches_tracked`` included, which no node reads), no node named; x -> Conv(+b) -> BN -> Relu
    -> Conv(+b) -> Relu -> Conv(+b) -> y."""
    rng = np.random.default_rng(0)
    shapes = {"c1.weight": (4, 3, 3, 3), "c1.bias": (4,), "bn.weight": (4,), "bn.bias": (4,), "bn.running_mean": (4,),
              "c2.weight": (4, 4, 3, 3), "c2.bias": (4,), "c3.weight": (2, 4, 1, 1), "c3.bias": (2,)}  # fmt: skip
    arrays = {name: (rng.normal(size=shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
              for name, shape in shapes.items()}  # fmt: skip
    arrays["bn.running_var"] = rng.uniform(0.5, 1.5, 4).astype(np.float32)
    inits = [numpy_helper.from_array(value, name) for name, value in arrays.items()]
    inits.append(numpy_helper.from_array(np.array(7, np.int64), "bn.num_batches_tracked"))
    norm = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    nodes = [
        helper.make_node("Conv", ["x", "c1.weight", "c1.bias"], ["1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["1", *norm], ["2"]),
        helper.make_node("Relu", ["2"], ["3"]),
        helper.make_node("Conv", ["3", "c2.weight", "c2.bias"], ["4"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["4"], ["5"]),
        helper.make_node("Conv", ["5", "c3.weight", "c3.bias"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 8, 8])
    model = helper.make_model(helper.make_graph(nodes, "old", inputs, [output], inits),
                              opset_imports=[helper.make_opsetid("", 9)])  # fmt: skip
    model.ir_version = 3
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_an_old_export_with_initializers_among_its_inputs_and_unnamed_nodes(tmp_path: Path, target: str) -> None:
    """CenterFace's family: calibration asks for the image alone (the initializers listed as inputs are constants,
    not data), and the file written names every node once (two unnamed convs' bias DequantizeLinears were both
    '/bias_DequantizeLinear', which ONNX Runtime refuses)."""
    float_path = old_export(tmp_path / "old.onnx")
    result = qdq.quantize_onnx(float_path, batches((4, 3, 8, 8), name="x", count=6), tmp_path / "int8.onnx",
                               target=target, progress=False, method="max")  # fmt: skip
    model = onnx.load(str(result.path))
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert [i.name for i in model.graph.input] == ["x"]
    assert result.int8_ops == {"Conv": 3}
    feed = batches((2, 3, 8, 8), name="x", count=1, seed=5)[0]
    assert steps_apart(run(float_path, feed), run(result.path, feed, optimize=False)) <= 12.0
    if target == "onnxruntime":
        assert fusion_report(result.path).int8_kernels == {"com.microsoft:QLinearConv": 3}


def if_with_weights(path: Path) -> dict[str, np.ndarray]:
    """silero-vad's family: the network inside the branches of an ``If`` (on a graph input).

    x -> Conv(w0, b0) -> Relu = r0 -> If(cond) {then: Conv(t.w, t.b: Constant nodes of the branch) -> Relu = t2 ->
    Conv(shared.w, shared.b: main-graph initializers read only inside the branches) -> Relu; else: Conv(e.w: an
    initializer of the branch) -> Relu -> Conv(shared.w, shared.b) -> Relu} -> Conv(w9) -> y. Returns the weights."""
    rng = np.random.default_rng(0)
    shapes = {"w0": (4, 3, 3, 3), "b0": (4,), "t.w": (8, 4, 3, 3), "t.b": (8,), "e.w": (8, 4, 3, 3),
              "shared.w": (8, 8, 1, 1), "shared.b": (8,), "w9": (2, 8, 1, 1)}  # fmt: skip
    w = {k: (rng.normal(size=s) / np.sqrt(np.prod(s[1:]) if len(s) > 1 else 4)).astype(np.float32)
         for k, s in shapes.items()}  # fmt: skip

    def branch(name: str, first: list[str], nodes: list, inits: list) -> onnx.GraphProto:
        body = [helper.make_node("Conv", ["r0", *first], [f"{name}1"], pads=[1, 1, 1, 1]),
                helper.make_node("Relu", [f"{name}1"], [f"{name}2"]),
                helper.make_node("Conv", [f"{name}2", "shared.w", "shared.b"], [f"{name}3"]),
                helper.make_node("Relu", [f"{name}3"], [f"{name}_out"])]  # fmt: skip
        output = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)
        return helper.make_graph(nodes + body, name, [], [output], inits)

    constants = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(w[k], k)) for k in ("t.w", "t.b")]
    then = branch("t", ["t.w", "t.b"], constants, [])
    other = branch("e", ["e.w"], [], [numpy_helper.from_array(w["e.w"], "e.w")])
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=other),
        helper.make_node("Conv", ["branch", "w9"], ["y"]),
    ]
    inits = [numpy_helper.from_array(w[k], k) for k in ("w0", "b0", "shared.w", "shared.b", "w9")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"]),
              helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]  # fmt: skip
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "height", "width"])
    model = helper.make_model(helper.make_graph(nodes, "if_weights", inputs, [output], inits),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    model.ir_version = 8
    onnx.save(model, str(path))
    return w


def conv_relu(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """ReLU of a 3x3 conv padded by 1, in torch."""
    out = nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(weight), torch.from_numpy(bias), padding=1)
    return torch.relu(out).numpy()


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_convolutions_inside_if_branches_are_quantized_on_what_the_taken_branch_computes(tmp_path: Path,
                                                                                          target: str) -> None:
    """The convs of the branch the data takes are quantized (ONNX Runtime runs them as QLinearConv inside the
    branch), their activation ranges the max of what the branch computes (here by hand, with torch); the branch
    no batch takes stays float, and says why. A main-graph weight read only inside the branches stays in the file
    (silero_vad_16k_op15 lost its LSTM weights and ONNX Runtime refused the file)."""
    w = if_with_weights(tmp_path / "if.onnx")
    data = [{**b, "cond": np.array(True)} for b in batches((2, 3, 8, 8), name="x", count=4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qdq.quantize_onnx(
            tmp_path / "if.onnx", data, tmp_path / "int8.onnx", target=target, progress=False, method="max",
        )
    said = [str(w.message) for w in caught if "Conv(s)" in str(w.message)]
    if target == "onnxruntime":  # said once, with the reason, not the PyTorch door's advice
        assert len(said) == 1 and "never reached" in said[0] and "quantize_model" not in said[0], said
    t2 = [conv_relu(conv_relu(b["x"], w["w0"], w["b0"]), w["t.w"], w["t.b"]) for b in data]
    assert np.isclose(float(result.value_ranges["t2"]), max(float(np.abs(t).max()) for t in t2), rtol=1e-5)
    unreached = {name for name, why in result.float_ops.items() if "never reached" in why}
    assert len(unreached) == 1 and result.int8_ops["Conv"] == 5  # the else branch's first conv reads r0, reached
    feed = {**batches((2, 3, 8, 8), name="x", count=1, seed=9)[0], "cond": np.array(True)}
    assert steps_apart(run(tmp_path / "if.onnx", feed), run(result.path, feed, optimize=False)) <= 12.0
    if target == "onnxruntime":
        report = fusion_report(result.path)  # the branches' kernels counted with the main graph's
        assert report.int8_kernels == {"com.microsoft:QLinearConv": 3}  # 2 in the then branch, the head
        assert steps_apart(run(result.path, feed, optimize=False), run(result.path, feed)) <= 1.0


def nhwc_input(path: Path) -> Path:
    """What tf2onnx writes for a Keras/TensorFlow CNN: an NHWC input, a Transpose to NCHW right after it, then
    x -> Conv(+b) -> Relu -> MaxPool -> Conv(+b) -> y (OpenNSFW's family)."""
    rng = np.random.default_rng(0)
    w = {"w1": (8, 3, 3, 3), "b1": (8,), "w2": (4, 8, 1, 1), "b2": (4,)}
    inits = [numpy_helper.from_array((rng.normal(size=s) / 3).astype(np.float32), k) for k, s in w.items()]
    nodes = [
        helper.make_node("Transpose", ["input:0"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("input:0", TensorProto.FLOAT, ["batch", 16, 16, 3])]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])
    model = helper.make_model(helper.make_graph(nodes, "nhwc", inputs, [output], inits),
                              opset_imports=[helper.make_opsetid("", 13)])  # fmt: skip
    model.ir_version = 7
    onnx.save(model, str(path))
    return path


def test_an_nhwc_input_transposed_in_the_graph(tmp_path: Path) -> None:
    """tf2onnx's NHWC input: calibration feeds the input as the file names it, the Transpose moves int8 data (the
    input quantized before it) and both convs run as QLinearConv, no Q/DQ idle."""
    float_path = nhwc_input(tmp_path / "nhwc.onnx")
    data = [{"input:0": b["x"]} for b in batches((2, 16, 16, 3), name="x", count=4)]
    result = qdq.quantize_onnx(
        float_path, data, tmp_path / "int8.onnx", target="onnxruntime", progress=False, method="max",
    )
    report = fusion_report(result.path)
    assert report.int8_kernels == {"com.microsoft:QLinearConv": 2} and not report.float_kernels
    assert not report.idle
    feed = {"input:0": batches((2, 16, 16, 3), name="x", count=1, seed=8)[0]["x"]}
    assert steps_apart(run(float_path, feed), run(result.path, feed)) <= 12.0


class StatefulRecurrent(nn.Module):
    """A streaming recognizer's step: conv features, then a GRU or LSTM whose initial state is a graph input (the
    caller carries it from call to call), then a Linear; returns the output and the new state."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.rnn = nn.LSTM(8, 8, batch_first=True) if kind == "LSTM" else nn.GRU(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = torch.relu(self.conv(x)).transpose(1, 2)
        out, new = self.rnn(features, state if self.kind == "LSTM" else state[0])
        return self.fc(out), *(new if self.kind == "LSTM" else (new,))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_a_recurrent_layer_with_state_inputs_stays_float(tmp_path: Path, kind: str, target: str) -> None:
    """initial_h (and initial_c) from graph inputs: the recurrent op reads every input float (float_recurrent on
    ONNX Runtime; no rule quantizes it for TensorRT), the conv before it is int8, outputs and state stay near
    FP32."""
    torch.manual_seed(0)
    path, names = tmp_path / "rnn.onnx", ["x", "h", "c"] if kind == "LSTM" else ["x", "h"]
    example = (torch.randn(1, 4, 10), *(torch.zeros(1, 1, 8) for _ in names[1:]))
    torch.onnx.export(StatefulRecurrent(kind).eval(), example, str(path), dynamo=False, opset_version=17,
                      input_names=names, output_names=["y", "h_out", "c_out"][: len(names)])  # fmt: skip
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(1, 4, 10)).astype(np.float32),
             **{n: (rng.normal(size=(1, 1, 8)) * 0.5).astype(np.float32) for n in names[1:]}} for _ in range(4)]
    result = qdq.quantize_onnx(path, data, tmp_path / "int8.onnx", target=target, progress=False, method="max")
    model = onnx.load(str(result.path))
    recurrent = next(n for n in model.graph.node if n.op_type == kind)
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    assert all(producers.get(name) != "DequantizeLinear" for name in recurrent.input if name)
    assert result.int8_ops["Conv"] == 1
    assert steps_apart(run(path, data[0]), run(result.path, data[0], optimize=False)) <= 12.0
    if target == "onnxruntime":
        assert fusion_report(result.path).int8_kernels["com.microsoft:QLinearConv"] == 1


class TokenClassifier(nn.Module):
    """Token ids (int64) -> an embedding table (Gather) -> Linear -> ReLU -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc1, self.fc2 = nn.Embedding(50, 16), nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(ids))))


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_integer_ids_into_an_embedding_are_not_calibrated(tmp_path: Path, target: str) -> None:
    """MiniLM's family: the ids are not calibrated or quantized (integers), the embedding table is not quantized
    as an activation (a constant Gather reads), and the Linears after the Gather read it quantized."""
    torch.manual_seed(0)
    path = tmp_path / "tokens.onnx"
    torch.onnx.export(TokenClassifier().eval(), (torch.randint(0, 50, (2, 7)),), str(path), dynamo=False,
                      opset_version=17, input_names=["ids"], output_names=["y"],
                      dynamic_axes={"ids": {0: "batch", 1: "length"}})  # fmt: skip
    rng = np.random.default_rng(0)
    data = [{"ids": rng.integers(0, 50, (2, 7 + i))} for i in range(3)]
    result = qdq.quantize_onnx(path, data, tmp_path / "int8.onnx", target=target, progress=False, method="max")
    gather = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Gather")
    assert gather.output[0] in result.value_ranges  # the looked-up vectors, as the first Linear reads them
    assert "ids" not in result.value_ranges and gather.input[0] not in result.value_ranges
    model = onnx.load(str(result.path))
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in ("ids", gather.input[0]) for n in model.graph.node)
    assert result.int8_ops == {"MatMul": 2}
    assert steps_apart(run(path, data[0]), run(result.path, data[0], optimize=False)) <= 12.0
    if target == "onnxruntime":
        assert fusion_report(result.path).int8_kernels == {"com.microsoft:QGemm": 2}


def table_mlp(path: Path) -> Path:
    """Swin V2's family: an MLP applied to a constant table the model holds (its continuous position bias over
    relative coordinates), added to a computed value: table [16, 2] -> MatMul(w1) + b1 -> Relu -> MatMul(w2) = bias
    [16, 4]; y = x [batch, 16, 4] @ w3 + bias."""
    rng = np.random.default_rng(0)
    w = {"table": np.linspace(-1, 1, 32, dtype=np.float32).reshape(16, 2), "w1": rng.normal(size=(2, 8)),
         "b1": rng.normal(size=8), "w2": rng.normal(size=(8, 4)) / 3, "w3": rng.normal(size=(4, 4)) / 2}  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["table", "w1"], ["h0"], name="cpb_fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["bias"], name="cpb_fc2"),
        helper.make_node("MatMul", ["x", "w3"], ["p"], name="proj"),
        helper.make_node("Add", ["p", "bias"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in w.items()]
    graph = helper.make_graph(nodes, "table_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16, 4])], inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_a_weighted_op_on_a_constant_table_stays_float(tmp_path: Path, target: str) -> None:
    """The MatMul that multiplies the table by its weight reads no activation: no weight quantizer either (TensorRT
    refused the file: a quantized MatMul with a float input), and the runtime folds it. The rest is quantized."""
    from qdq.targets.tensorrt.check import check_tensorrt

    float_path = table_mlp(tmp_path / "table.onnx")
    options = {"float": "float16"} if target == "tensorrt" else None
    result = qdq.quantize_onnx(float_path, batches((4, 16, 4), name="x", count=4), tmp_path / "int8.onnx",
                               target=target, target_options=options, progress=False, method="max")  # fmt: skip
    model = onnx.load(str(result.path))
    reads = {n.name: list(n.input) for n in model.graph.node}
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert not any(producers.get(i) == "DequantizeLinear" for i in reads["cpb_fc1"])
    assert result.int8_ops == {"MatMul": 2}  # the second layer (its input computed) and the projection
    if target == "tensorrt":
        assert check_tensorrt(result.path).ok
    feed = batches((4, 16, 4), name="x", count=1, seed=5)[0]
    assert steps_apart(run(float_path, feed), run(result.path, feed, optimize=False)) <= 8.0


class TwoStage(nn.Module):
    """A two-stage detector's family (torchvision's Faster R-CNN): feature maps concatenated, one concatenation
    (read by a conv too) inside another before a max pool; regions of interest concatenated from image indices
    and boxes decoded against the input's size (read at run time), into a float ``RoiAlign``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(3, 4, 3, padding=1) for _ in range(3))
        self.mix, self.side = nn.Conv2d(12, 8, 1), nn.Conv2d(8, 8, 2, stride=2)
        self.deltas = nn.Linear(8, 4)
        self.head = nn.Linear(8 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.cat([self.a(x), self.b(x)], 1)
        features = self.mix(nn.functional.max_pool2d(torch.cat([inner, self.c(x)], 1), 2)) + self.side(inner)
        deltas = self.deltas(features.mean((2, 3)))
        boxes = deltas.sigmoid() * (torch.ones_like(deltas) * x.shape[-1])
        rois = torch.cat([torch.zeros_like(deltas[:, :1]), boxes], 1)
        pooled = roi_align(features, rois, output_size=2, spatial_scale=0.5)
        return self.head(pooled.flatten(1))


def _concat_reads(path: Path) -> list[list[str]]:
    """For each Concat of ``path``, in graph order, the op type behind each input (``DequantizeLinear`` or not)."""
    graph = onnx.load(str(path)).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    return [[producer.get(name, "input") for name in node.input] for node in graph.node if node.op_type == "Concat"]


def test_regions_of_interest_stay_float_and_nested_feature_concatenations_share_one_scale(tmp_path: Path) -> None:
    """TensorRT's concatenation rule gave every concatenation one input scale: the regions of interest too (pixel
    boxes beside image indices, at a step of 320 / 127, into a float RoiAlign), and the inner concatenation its own
    scale beside the outer one reading it: ``qdq check`` FAIL (fused scales) on Faster R-CNN. Now only feature maps
    are concatenated in int8, and an inner concatenation shares the outer one's quantizer."""
    from qdq.targets.tensorrt.check import check_tensorrt

    torch.manual_seed(0)
    source = export(TwoStage(), torch.rand(2, 3, 8, 8), tmp_path / "two_stage.onnx")
    out = tmp_path / "trt.onnx"
    qdq.quantize_onnx(source, batches((2, 3, 8, 8)), out, target="tensorrt", progress=False)
    assert check_tensorrt(out).ok
    inner, outer, rois = _concat_reads(out)
    assert "DequantizeLinear" not in inner and "DequantizeLinear" not in rois
    assert outer == ["DequantizeLinear", "DequantizeLinear"]

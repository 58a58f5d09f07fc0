"""Placement around MaxPool and Concat on ONNX Runtime: the two model shapes of issue 33, every calibration method.

Issue 33 asks that qdq's ``onnxruntime`` file be at least as fast as ORT ``quantize_static`` with *every*
calibration method, with every MaxPool and data Concat on an int8 kernel and no standalone Q/DQ left. Today the
quantizers before and after a MaxPool (or the inputs of a Concat) are calibrated independently: with ``max`` their
ranges agree (a max-pool or a concat does not change the maximum), with the histogram methods they do not, and ORT
then runs ``DequantizeLinear -> float MaxPool -> QuantizeLinear`` (the same around Concat). This benchmark measures
that, on two models (random init: latency and placement do not depend on the weights; BatchNorm statistics from
one pass over generated data):

* ``crnn``: the CRNN of ``crnn_int8.py`` (6 Conv-BN-ReLU, 4 MaxPools, two bidirectional LSTMs, a Linear head;
  input 1x32x128), timed at batch 8;
* ``unet``: a CRAFT-like VGG16-BN U-Net text detector (:class:`VggUNet`: torchvision ``vgg16_bn`` features as the
  backbone, split after relu2_2, relu3_2, relu4_2, relu5_2; CRAFT's fc6/fc7 (MaxPool 3x3 stride 1, dilated 3x3
  conv, 1x1 conv); four up-blocks that concatenate the upsampled deeper map with the skip feature (``--upsample``
  bilinear, as CRAFT, or nearest) then 1x1 and 3x3 Conv-BN-ReLU; a conv head to 2 maps at half resolution), input
  3x384x384, timed at batch 2. 5 MaxPools, 4 data Concats. ``--weights`` loads a torchvision ``vgg16_bn`` state
  dict into the backbone.

Variants: FP32 (TorchScript export, opset 17); ORT ``quantize_static`` U8S8 (QDQ, per-channel weights, MinMax,
after ``quant_pre_process``) on that FP32 file; qdq ``QuantConfig(target="onnxruntime")`` calibrated with
``qdq.calibrate(model, data, method=...)`` for max, entropy, mse, percentile and auto, exported with
``qdq.export.export_onnx(target="onnxruntime")`` with int8 weights (as ORT's file: like with like on every CPU).
Every file is timed as written (int8 weights stay int8 also on x86 CPUs without VNNI, where qdq.runtime would
otherwise re-encode them); its fidelity is computed exactly (re-encoded there). Calibration and evaluation data:
rendered text (DejaVu words on light grounds: lines for the CRNN, pages of scattered words for the U-Net), seeded,
disjoint.

Columns (from ORT's optimized graph, read from ``qdq.runtime.ort.fusion_report`` and the saved graph's types):
speed-up over FP32 (median of per-round ratios over interleaved rounds, ``qdq.runtime.compare_models``, 25-75 %);
latency relative to ORT ``quantize_static`` (< 1: faster), per round then median; MaxPools whose input is int8 /
all MaxPools; data Concats (not shape arithmetic) that run as ``QLinearConcat`` / all data Concats; standalone
QuantizeLinear/DequantizeLinear with no int8 kernel behind them (``FusionReport.idle``); fidelity against FP32 on
held-out data: the U-Net's text map (channel 0) thresholded at FP32's 90th percentile per image: IoU of the
masks, and the SQNR of the raw outputs; the CRNN's greedy CTC decode: % of sequences identical to FP32's, % of
frames with FP32's argmax, and the SQNR of the log-probabilities.

Usage: PYTHONPATH=src python benchmarks/placement_int8.py [--models crnn,unet] [--methods max,entropy,mse,
percentile,auto] [--rounds 5] [--iters 5] [--upsample bilinear|nearest] [--weights vgg16_bn.pth] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
import torchvision
from _onnx_in_models import WORDS, fonts, sqnr_db
from cpu_int8 import _ort_quantize_static
from crnn_int8 import crnn
from torch import nn

import qdq
from qdq.cpu import int8_dot_saturates
from qdq.export import export_onnx
from qdq.markdown import markdown_table
from qdq.runtime import compare_models, load_runtime
from qdq.runtime.ort import fusion_report, inference_session, session_options
from qdq.workflow.calibration import calibrate

METHODS = ("max", "entropy", "mse", "percentile", "auto")
AS_WRITTEN = {"uint8_weights": False}
"""Every file is timed as written: on an x86 CPU without VNNI (``qdq.cpu.int8_dot_saturates()``) qdq.runtime would
otherwise run int8 weights as uint8 (exact, slower U8U8 kernels), which is not what these files give a user on a
VNNI CPU; there the U8S8 kernels saturate, so fidelity is computed with the re-encoding (:func:`outputs_of`)."""
FP32, ORT_STATIC = "FP32", "ORT quantize_static U8S8 MinMax"


# -- the U-Net ---------------------------------------------------------------------------------------------------


def _conv_bn_relu(cin: int, cout: int, kernel: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, padding=kernel // 2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class VggUNet(nn.Module):
    """CRAFT's architecture on torchvision's ``vgg16_bn`` features: ``(N, 3, H, W)`` -> ``(N, 2, H/2, W/2)``
    (region and affinity maps; H and W multiples of 32)."""

    def __init__(self, upsample: str = "bilinear", backbone: nn.Module | None = None) -> None:
        super().__init__()
        features = (backbone or torchvision.models.vgg16_bn(weights=None)).features
        self.stages = nn.ModuleList([features[:13], features[13:20], features[20:30], features[30:40]])
        self.fc = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1),
                                nn.Conv2d(512, 1024, 3, padding=6, dilation=6), nn.Conv2d(1024, 1024, 1))  # fmt: skip
        widths = [(1024 + 512, 512, 256), (256 + 512, 256, 128), (128 + 256, 128, 64), (64 + 128, 64, 32)]
        self.up = nn.ModuleList(nn.Sequential(*_conv_bn_relu(i, m, 1), *_conv_bn_relu(m, o, 3)) for i, m, o in widths)
        self.head = nn.Sequential(
            *[layer for cin, cout in ((32, 32), (32, 32), (32, 16)) for layer in (nn.Conv2d(cin, cout, 3, padding=1),
                                                                             nn.ReLU(inplace=True))],
            nn.Conv2d(16, 16, 1), nn.ReLU(inplace=True), nn.Conv2d(16, 2, 1),
        )  # fmt: skip
        self.mode = upsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.stages:
            x = stage(x)
            skips.append(x)
        y = torch.cat([self.fc(x), skips[-1]], dim=1)
        for index, block in enumerate(self.up):
            y = block(y)
            if index < 3:
                skip = skips[2 - index]
                y = torch.cat([self._resize(y, skip), skip], dim=1)
        return self.head(y)

    def _resize(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.mode == "nearest":
            return F.interpolate(y, size=like.shape[2:], mode="nearest")
        return F.interpolate(y, size=like.shape[2:], mode="bilinear", align_corners=False)


def bn_from_data(model: nn.Module, batch: torch.Tensor) -> nn.Module:
    """``model`` in eval mode with every BatchNorm's statistics those of ``batch`` (one training-mode pass with
    momentum 1), so that a random-init network's activations keep a sensible scale."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = 1.0
        model.train()(batch)
    return model.eval()


def unet(upsample: str, weights: Path | None, batch: torch.Tensor) -> VggUNet:
    """The benchmark's U-Net: seeded random init, or a torchvision ``vgg16_bn`` state dict in the backbone."""
    torch.manual_seed(0)
    backbone = torchvision.models.vgg16_bn(weights=None)
    if weights is not None:
        backbone.load_state_dict(torch.load(weights, map_location="cpu"))
    model = VggUNet(upsample, backbone)
    return bn_from_data(model, batch) if weights is None else bn_from_data_decoder(model, batch)


def bn_from_data_decoder(model: VggUNet, batch: torch.Tensor) -> VggUNet:
    """Like :func:`bn_from_data`, but keep the pretrained backbone's own BatchNorm statistics."""
    saved = copy.deepcopy(model.stages.state_dict())
    bn_from_data(model, batch)
    model.stages.load_state_dict(saved)
    return model.eval()


# -- data -------------------------------------------------------------------------------------------------------


def _draw_words(size: tuple[int, int], count: int, rng: random.Random, font_px: tuple[int, int]) -> np.ndarray:
    """A grey ``size`` (width, height) image with ``count`` random words, dark on a light ground, in 0-1."""
    from PIL import Image, ImageDraw, ImageFont

    faces = fonts()
    image = Image.new("L", size, rng.randint(170, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(count):
        font = ImageFont.truetype(str(rng.choice(faces)), rng.randint(*font_px))
        text = rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randint(0, 9999))
        left, top, right, bottom = font.getbbox(text)
        x = rng.randint(0, max(0, size[0] - (right - left)))
        y = rng.randint(0, max(0, size[1] - (bottom - top)))
        draw.text((x - left, y - top), text, font=font, fill=rng.randint(0, 90))
    return np.asarray(image, np.float32) / 255


def text_lines(count: int, seed: int) -> torch.Tensor:
    """``(count, 1, 32, 128)`` rendered lines of one or two words, 0-1 (the CRNN's input)."""
    rng = random.Random(seed)
    return torch.from_numpy(np.stack([_draw_words((128, 32), 1, rng, (16, 26))[None] for _ in range(count)]))


def text_pages(count: int, seed: int, size: int) -> torch.Tensor:
    """``(count, 3, size, size)`` pages of 6-14 scattered words, normalized as CRAFT (ImageNet mean and std)."""
    rng = random.Random(seed)
    pages = np.stack([_draw_words((size, size), rng.randint(6, 14), rng, (14, 44)) for _ in range(count)])
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    rgb = (pages[:, None] - mean[None, :, None, None]) / std[None, :, None, None]
    return torch.from_numpy(rgb.astype(np.float32))


# -- the cases -------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model with its calibration batches, held-out batches, timing batch and fidelity measure."""

    name: str
    model: nn.Module
    calibration: list[torch.Tensor]
    evaluation: list[torch.Tensor]
    batch: int
    fidelity: Callable[[np.ndarray, np.ndarray], str]
    notes: list[str] = field(default_factory=list)


def text_map_fidelity(out: np.ndarray, ref: np.ndarray) -> str:
    """IoU of channel 0 above FP32's per-image 90th percentile, variant vs FP32; and the outputs' SQNR (dB)."""
    ious = []
    for mine, theirs in zip(out[:, 0], ref[:, 0]):
        threshold = np.percentile(theirs, 90)
        a, b = mine > threshold, theirs > threshold
        ious.append((a & b).sum() / max(1, (a | b).sum()))
    return f"IoU {np.mean(ious):.3f}, SQNR {sqnr_db(ref, out):.1f} dB"


def ctc_fidelity(out: np.ndarray, ref: np.ndarray) -> str:
    """Greedy CTC decodes (``(T, N, C)`` log-probabilities, blank 0) against FP32's: % of sequences equal, % of
    frames with the same argmax; and the SQNR (dB) of the log-probabilities. (A random-init CRNN's classes are
    nearly tied in many frames, so its decodes are fragile: read the frames and the SQNR with them.)"""

    def decode(best: np.ndarray) -> list[tuple[int, ...]]:
        return [tuple(int(c) for i, c in enumerate(row) if c != 0 and (i == 0 or c != row[i - 1])) for row in best]

    mine, theirs = out.argmax(-1).T, ref.argmax(-1).T  # (N, T)
    same = np.mean([a == b for a, b in zip(decode(mine), decode(theirs))])
    return f"decodes {100 * same:.0f} %, frames {100 * np.mean(mine == theirs):.1f} %, SQNR {sqnr_db(ref, out):.1f} dB"


def crnn_case(calib: int, evals: int) -> Case:
    """The CRNN of ``crnn_int8.py`` on rendered lines, calibration batches of 8."""
    data = text_lines(calib + evals, seed=3)
    calibration, evaluation = list(data[:calib].split(8)), list(data[calib:].split(8))
    return Case("crnn", crnn(), calibration, evaluation, 8, ctc_fidelity)


def unet_case(calib: int, evals: int, size: int, upsample: str, weights: Path | None) -> Case:
    """The VGG16-BN U-Net on rendered pages, batches of 2."""
    data = text_pages(calib + evals, seed=4, size=size)
    calibration, evaluation = list(data[:calib].split(2)), list(data[calib:].split(2))
    model = unet(upsample, weights, calibration[0])
    return Case("unet", model, calibration, evaluation, 2, text_map_fidelity, [f"upsampling: {upsample}"])


# -- making the files ---------------------------------------------------------------------------------------------


def export_fp32(model: nn.Module, example: torch.Tensor, path: Path) -> Path:
    """TorchScript export, opset 17, dynamic batch (as ``crnn_int8.py``)."""
    torch.onnx.export(model, (example,), str(path), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}}, opset_version=17, dynamo=False)  # fmt: skip
    return path


def qdq_file(case: Case, method: str, path: Path) -> Path:
    """qdq's onnxruntime-target file of ``case.model`` calibrated with ``method``, weights stored as int8 (the
    U8S8 kernels ORT's own file uses; qdq's default, "auto", stores uint8 on a CPU without VNNI)."""
    model = qdq.quantize_model(copy.deepcopy(case.model), qdq.QuantConfig(target="onnxruntime"))
    calibrate(model, case.calibration, method=method, progress=False)
    return export_onnx(model, case.calibration[0][:1], path, target="onnxruntime", dynamo=False,
                       target_options={"weights": "int8"})  # fmt: skip


def build(case: Case, methods: list[str], folder: Path) -> dict[str, Path]:
    """Every variant's file: label -> path."""
    fp32 = export_fp32(case.model, case.calibration[0][:1], folder / f"{case.name}_fp32.onnx")
    files = {FP32: fp32, ORT_STATIC: _ort_quantize_static(fp32, folder / f"{case.name}_ort.onnx", case.calibration)}
    for method in methods:
        files[f"qdq {method}"] = qdq_file(case, method, folder / f"{case.name}_qdq_{method}.onnx")
        print(f"  {case.name}: qdq {method} exported", flush=True)
    return files


# -- reading ORT's optimized graph -------------------------------------------------------------------------------


def optimized_graph(path: Path, threads: int) -> onnx.ModelProto:
    """The graph ONNX Runtime runs for ``path`` (all optimizations, the CPU's layout), with tensor types."""
    with tempfile.TemporaryDirectory(prefix="qdq-opt-") as tmp:
        saved = str(Path(tmp) / "optimized.onnx")
        session = inference_session(path, session_options(threads=threads, optimized_model_path=saved), **AS_WRITTEN)
        del session
        return onnx.load(saved, load_external_data=False)


_FLOAT, _INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
INT8 = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
#: ops of ORT's optimized graph whose output is int8/uint8 (the type of their output zero point)
_INT8_OUT = {"QuantizeLinear", "QLinearConv", "QLinearConcat", "QLinearAdd", "QLinearMul", "QLinearSigmoid",
             "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearLeakyRelu", "QLinearMatMul", "QLinearSoftmax",
             "NhwcMaxPool", "DynamicQuantizeLinear"}  # fmt: skip
_FLOAT_OUT = {"DequantizeLinear", "Conv", "FusedConv", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              "LSTM", "ReorderInput", "ReorderOutput", "Softmax", "LogSoftmax", "Sigmoid", "FusedMatMul",
              "FusedGemm"}  # fmt: skip


def _out_type(node: onnx.NodeProto, types: dict[str, int]) -> int | None:
    """The element type of ``node``'s first output, from its op and its inputs' types."""
    if node.op_type in _INT8_OUT:
        zero_point = node.input[2] if node.op_type == "QuantizeLinear" and len(node.input) > 2 else None
        return types.get(zero_point, onnx.TensorProto.UINT8) if zero_point else onnx.TensorProto.UINT8
    if node.op_type in _FLOAT_OUT:
        return _FLOAT
    if node.op_type == "Shape":
        return _INT64
    if node.op_type == "Cast":
        return next(a.i for a in node.attribute if a.name == "to")
    if node.op_type == "QGemm":
        return onnx.TensorProto.UINT8 if len(node.input) > 7 and node.input[7] else _FLOAT
    known = [types[i] for i in node.input if i in types]
    return known[0] if known else None


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of each tensor of ORT's saved optimized graph (whose ``value_info`` is mostly empty),
    propagated in node order (the saved graph is topologically sorted). Zero points of int8 kernels are
    not distinguished: int8 and uint8 both read as int8 data here."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    for node in model.graph.node:
        kind = _out_type(node, types)
        if kind is not None:
            types.update({out: kind for out in node.output[:1] if out})
    return types


def placement_counts(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """``{"maxpool": (on int8, all), "concat": (QLinearConcat, all data Concats)}`` in an optimized graph.

    A MaxPool (any domain: ORT runs int8 ones as ``com.microsoft:NhwcMaxPool``) is on int8 when its input is
    int8 or uint8 (:func:`tensor_types`). A Concat is a data Concat unless its output is an integer (shape
    arithmetic).
    """
    types = tensor_types(model)
    pools = [n for n in model.graph.node if n.op_type in ("MaxPool", "NhwcMaxPool")]
    int8_pools = sum(types.get(n.input[0]) in INT8 for n in pools)
    concats = [n for n in model.graph.node if n.op_type in ("Concat", "QLinearConcat")]
    data = [n for n in concats if types.get(n.output[0]) not in (_INT64, onnx.TensorProto.INT32)]
    return {"maxpool": (int8_pools, len(pools)), "concat": (sum(n.op_type == "QLinearConcat" for n in data), len(data))}


# -- measuring --------------------------------------------------------------------------------------------------------


def outputs_of(path: Path, batches: list[torch.Tensor], threads: int) -> np.ndarray:
    """The model's output on every batch, concatenated on the batch axis (axis 1 for the CRNN's ``(T, N, C)``).
    Computed exactly: on a CPU whose int8 dot products saturate, qdq.runtime runs int8 weights as uint8 (what a
    VNNI CPU computes from the same file); timing and kernel counts read the files as written."""
    with load_runtime(path, "onnxruntime", threads=threads) as runtime:
        outs = [runtime.run(b.numpy())[0] for b in batches]
    return np.concatenate(outs, axis=1 if outs[0].ndim == 3 else 0)


def measure(case: Case, files: dict[str, Path], args: argparse.Namespace) -> list[list[object]]:
    """Time every file interleaved, read its optimized graph, score it; the table rows."""
    comparison = compare_models(files, batch=case.batch, threads=args.threads, rounds=args.rounds,
                                iters=args.iters, warmup=args.warmup, **AS_WRITTEN)  # fmt: skip
    reference = outputs_of(files[FP32], case.evaluation, args.threads)
    peer = comparison.block_ms[ORT_STATIC]
    rows = []
    for label, path in files.items():
        counts = placement_counts(optimized_graph(path, args.threads))
        report = fusion_report(path, threads=args.threads, **AS_WRITTEN)
        vs_peer = np.median([m / p for m, p in zip(comparison.block_ms[label], peer)])
        fidelity = case.fidelity(outputs_of(path, case.evaluation, args.threads), reference)
        rows.append([
            case.name, label, str(comparison.speedup(label)), f"{vs_peer:.2f}",
            "{} / {}".format(*counts["maxpool"]), "{} / {}".format(*counts["concat"]), len(report.idle),
            f"{report.n_int8} / {report.n_float}", fidelity,
        ])  # fmt: skip
    return rows


HEADERS = [
    "model", "variant", "speed-up vs FP32 (25-75 %)", "latency / ORT static", "MaxPools on int8",
    "data Concats as QLinearConcat", "idle Q/DQ", "int8 / float kernels", "fidelity vs FP32 (held out)",
]  # fmt: skip


def legend(args: argparse.Namespace) -> str:
    """What the columns mean and how the run was made."""
    return "\n".join([
        f"Command: `python benchmarks/placement_int8.py {' '.join(sys.argv[1:])}`; onnxruntime, "
        f"{args.threads} threads; CPU load average at the end {os.getloadavg()[0]:.1f}; int8 dot products saturate "
        f"on this CPU: {int8_dot_saturates()} (timed as written: int8 weights stay int8; fidelity computed "
        "exactly, int8 weights as uint8 where the CPU saturates).",
        f"- speed-up vs FP32: FP32 latency / variant latency, median of the per-round ratios over {args.rounds} "
        f"interleaved rounds ({args.warmup} untimed + {args.iters} timed runs per variant per round, "
        "`qdq.runtime.compare_models`, random inputs), 25th-75th percentile in brackets.",
        "- latency / ORT static: the variant's latency over ORT quantize_static's, per round, median (< 1: faster).",
        "- MaxPools on int8: MaxPool nodes of ORT's optimized graph whose input is int8/uint8 / all MaxPools. data "
        "Concats as QLinearConcat: Concats of feature maps (not shape arithmetic) that ORT runs as QLinearConcat / "
        "all of them. idle Q/DQ: QuantizeLinear/DequantizeLinear with no int8 kernel behind them "
        "(`FusionReport.idle`). int8 / float kernels: Conv/Gemm/MatMul on int8 kernels / on float kernels.",
        "- fidelity: unet: IoU of the text map (channel 0) above FP32's 90th percentile (per image) with FP32's, "
        "and the SQNR of the outputs against FP32's; crnn: % of greedy CTC decodes equal to FP32's, % of frames "
        "with FP32's argmax, and the SQNR of the log-probabilities. Random init: the maps and the decodes have no "
        "meaning of their own, only their distance to FP32's.",
    ])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="crnn,unet")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=384, help="U-Net input side (a multiple of 32)")
    parser.add_argument("--upsample", choices=("bilinear", "nearest"), default="bilinear")
    parser.add_argument("--weights", type=Path, help="a torchvision vgg16_bn state dict for the U-Net's backbone")
    parser.add_argument("--calib", type=int, default=8, help="calibration samples per model")
    parser.add_argument("--evals", type=int, default=8, help="held-out samples per model")
    parser.add_argument("--quick", action="store_true", help="sanity run: U-Net at 192 px, 2 rounds of 2 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.iters, args.warmup, args.calib, args.evals = 192, 2, 2, 1, 4, 4
    return args


def make_case(name: str, args: argparse.Namespace) -> Case:
    if name == "crnn":
        return crnn_case(max(8, args.calib), max(8, args.evals))
    return unet_case(args.calib, args.evals, args.size, args.upsample, args.weights)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="placement-") as tmp:
        for name in args.models.split(","):
            case = make_case(name, args)
            print(f"{name}: building", flush=True)
            files = build(case, methods, Path(tmp))
            print(f"{name}: measuring", flush=True)
            rows += measure(case, files, args)
            notes += [f"{name}: {note}" for note in case.notes]
    print("\n" + legend(args) + "\n\n" + markdown_table(HEADERS, rows))
    print("\n" + "\n".join(f"- {note}" for note in notes))


if __name__ == "__main__":
    main()

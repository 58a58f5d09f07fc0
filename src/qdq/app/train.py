"""Training and evaluation of image classifiers (the FP32 baselines of the application; QAT is :func:`qdq.qat`).

Determinism: these functions never seed anything. With ``torch.manual_seed(s)`` called by the caller before
building the model, a loader whose order depends only on its own seed (:func:`qdq.app.data.make_loaders`)
and ``num_workers=0``, a run on the CPU gives the same weights every time on the same machine and the same
torch build (the thread count can change float summation order, so keep ``torch.set_num_threads`` fixed).

Recipe (:func:`train_classifier`): SGD with Nesterov momentum 0.9 (or AdamW, ``optimizer="adamw"``), weight
decay on conv/linear weights only (not on biases or BatchNorm parameters), a linear warm-up over the first
``warmup_fraction`` of the steps, then cosine annealing per step from ``lr`` down to ``lr * final_lr_fraction``;
cross-entropy loss. SGD is the default because the seed's QAT recipe (SGD at 1 % of the training learning
rate) assumes it. What the recipes give on the digits CNNs: benchmarks/RESULTS.md, code_figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.utils.modes import eval_mode
from qdq.workflow.progress import Progress, progress_bar, step_name

__all__ = ["OPTIMIZERS", "evaluate", "make_optimizer", "make_scheduler", "train_classifier", "train_one_epoch"]

Batch = tuple[torch.Tensor, torch.Tensor]


OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 5e-4, kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD (Nesterov, momentum 0.9) or AdamW (betas 0.9, 0.999) over the trainable parameters.

    ``weight_decay`` applies to tensors with ≥ 2 dims only (conv and linear weights); biases, BatchNorm
    scales/shifts and scalar learned ranges (QAT ``amax``) are not decayed. For AdamW it is the decoupled
    coefficient (the step shrinks weights by ``lr * weight_decay``); for SGD it is the L2 coefficient.
    """
    if kind not in OPTIMIZERS:
        raise QdqConfigError(f"unknown optimizer {kind!r}; expected one of {', '.join(OPTIMIZERS)}")
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(groups, lr=lr)


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, *, warmup_fraction: float = 0.0, final_lr_fraction: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warm-up over ``warmup_fraction * total_steps`` steps, then cosine decay.

    The learning-rate multiplier goes from ~0 to 1 during warm-up, then from 1 at the first post-warm-up
    step to ``final_lr_fraction`` after the last step. Call ``scheduler.step()`` after each optimizer step.
    """
    if total_steps < 1:
        raise QdqConfigError(f"total_steps must be >= 1, got {total_steps!r}")
    warmup = round(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(1, total_steps - warmup), 1.0)
        return final_lr_fraction + (1.0 - final_lr_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_one_epoch(
    model: nn.Module, loader: Iterable[Batch], optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, *, device: str | torch.device = "cpu",
    progress: Progress = False, desc: str = "train", loss_fn: Callable[..., torch.Tensor] | None = None,
) -> float:  # fmt: skip
    """One pass over ``loader`` in train mode; steps ``scheduler`` after every batch. Returns the mean loss.

    The mean is over samples (each batch's mean loss weighted by its size). ``loss_fn(logits, labels)``
    defaults to cross-entropy. Raises :class:`QdqConfigError` when the loader yields no batch.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    model.train()
    total, count = 0.0, 0
    bar = progress_bar(loader, progress, desc)
    for images, labels in bar:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        total += float(loss.detach()) * labels.numel()
        count += labels.numel()
        if bar is not loader:  # a progress bar
            bar.set_postfix(loss=f"{total / count:.4f}")  # type: ignore[attr-defined]  # a tqdm bar
    if count == 0:
        raise QdqConfigError("the training loader yielded no batch")
    return total / count


def train_classifier(
    model: nn.Module, train_loader: Iterable[Batch], epochs: int, lr: float, *, weight_decay: float = 5e-4,
    device: str | torch.device = "cpu", progress: Progress = True, optimizer: str = "sgd",
    warmup_fraction: float = 0.1, final_lr_fraction: float = 0.0, eval_loader: Iterable[Batch] | None = None,
) -> list[float]:  # fmt: skip
    """Train ``model`` in place with the module's recipe (SGD or AdamW, linear warm-up, per-step cosine).

    Args:
        model: the classifier; moved to ``device``. Left in eval mode when training ends.
        train_loader: yields ``(images, labels)`` batches; must have ``len()``.
        epochs: number of passes over ``train_loader``.
        lr: peak learning rate (0.1 with SGD, 5e-3 with AdamW suit the digits CNNs at batch 64).
        weight_decay: decay of conv/linear weights (see :func:`make_optimizer`).
        device: ``"cpu"``, ``"cuda"``...
        progress: show a tqdm bar per epoch (on stderr); a string names it (``"<progress> · epoch 1/3"``).
        optimizer: ``"sgd"`` or ``"adamw"``.
        warmup_fraction: fraction of all steps spent warming up linearly (0 for none).
        final_lr_fraction: learning rate after the last step, as a fraction of ``lr``.
        eval_loader: if given, top-1 accuracy is computed and shown (in the bar) after each epoch.

    Returns:
        The mean training loss of each epoch.
    """
    if epochs < 1 or lr <= 0:
        raise QdqConfigError(f"epochs must be >= 1 and lr > 0, got epochs={epochs!r}, lr={lr!r}")
    model.to(device)
    opt = make_optimizer(model, lr, weight_decay, optimizer)
    total = epochs * len(train_loader)  # type: ignore[arg-type]  # the app's loaders are sized
    scheduler = make_scheduler(opt, total, warmup_fraction=warmup_fraction, final_lr_fraction=final_lr_fraction)
    losses = []
    for epoch in range(epochs):
        desc = f"epoch {epoch + 1}/{epochs}"
        losses.append(train_one_epoch(model, train_loader, opt, scheduler, device=device, progress=progress, desc=desc))
        if eval_loader is not None and progress is not False:
            _print_epoch(step_name(progress, desc), losses[-1], evaluate(model, eval_loader, device=device))
    model.eval()
    return losses


def _print_epoch(desc: str, loss: float, accuracy: float) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"{desc}: loss {loss:.4f}, test top-1 {accuracy:.2f} %")


def evaluate(
    model: nn.Module | Callable[[torch.Tensor], Any], loader: Iterable[Batch], device: str | torch.device = "cpu",
    *, max_batches: int | None = None,
) -> float:  # fmt: skip
    """Top-1 accuracy of ``model`` on ``loader``, in percent (0-100), under ``torch.no_grad``.

    ``model`` may be an ``nn.Module`` (put in eval mode, its previous mode restored afterwards) or any
    callable mapping a batch ``[N, ...]`` to logits ``[N, classes]`` as a tensor or numpy array (e.g. an
    ONNX runtime session wrapper; the batch is given on ``device``). Ties go to the lowest class index.
    ``max_batches`` limits the number of batches (None: all).

    Raises:
        QdqConfigError: the loader yields no sample.
    """
    correct = count = 0
    with eval_mode(model) if isinstance(model, nn.Module) else contextlib.nullcontext(), torch.no_grad():
        for i, (images, labels) in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            logits = _as_tensor(model(images.to(device)))
            correct += int((logits.argmax(dim=1).cpu() == labels.cpu()).sum())
            count += labels.numel()
    if count == 0:
        raise QdqConfigError("the evaluation loader yielded no sample")
    return 100.0 * correct / count


def _as_tensor(output: Any) -> torch.Tensor:
    """Logits from a model output: a tensor, a numpy array, or the first element of a tuple/list of them."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, np.ndarray):
        return torch.from_numpy(output)
    return output

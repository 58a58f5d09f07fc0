"""Quantization-aware fine-tuning with the seed's schedule, checkpoints, and exact resume.

Seed recipe (NVIDIA's user guide): fine-tune for about 10 % of the original schedule, starting at 1 % of
the original learning rate, cosine-annealed down to 1 % of that, with the calibrated ranges frozen.
``qat(model, data, eval_fn, epochs, lr)`` takes ``lr`` = the ORIGINAL training learning rate and applies
that schedule; pass ``lr_scale=1.0`` to use ``lr`` as is. The optimizer is the one the float model was trained
with (``optimizer="sgd"``, the seed's, or ``"adamw"``): 1 % of an AdamW learning rate is a fine-tuning step for
AdamW, while SGD at that rate barely moves the weights.

A checkpoint (model, optimizer, scheduler, epoch, RNG states) is written atomically after each epoch;
``resume=True`` restarts after the last complete epoch and reproduces the uninterrupted run exactly on the
same machine (the data order comes from the restored RNG state).

Under ``torch.distributed`` with a DistributedDataParallel model (see :mod:`qdq.workflow.distributed`):
the quantizer state is broadcast from rank 0 before training and checked to be identical on every rank
after each epoch; the reported loss is the mean over ranks; only rank 0 writes the checkpoint (with every
rank's RNG state) while the others wait at a barrier, so ``resume=True`` restarts all ranks alike.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.atomic import atomic_open
from qdq.errors import QdqConfigError
from qdq.quantizer import TensorQuantizer
from qdq.utils.batches import split_labels
from qdq.workflow.distributed import (
    all_reduce_sum,
    assert_in_sync,
    assert_same_across_ranks,
    broadcast_quantizer_state,
    collective,
    main_process_only,
    rank,
    unwrap,
    world_size,
)
from qdq.workflow.progress import Progress, progress_bar

__all__ = ["QAT_OPTIMIZERS", "QATResult", "qat", "save_atomic"]

EvalFn = Callable[[nn.Module], float]
_CHECKPOINT = "qat_checkpoint.pt"
#: the optimizers :func:`qat` fine-tunes with (the one the float model was trained with)
QAT_OPTIMIZERS = ("sgd", "adamw")


@dataclass
class QATResult:
    """Per-epoch loss and score, and the final score."""

    epochs: list[dict[str, float]] = field(default_factory=list)
    final_score: float | None = None
    resumed_from_epoch: int = 0


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    with atomic_open(path, "wb") as handle:
        torch.save(obj, handle)
    return Path(path)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trainable_parameters(model: nn.Module, learn_ranges: bool) -> list[nn.Parameter]:
    """Model parameters; the learned clip ranges of quantizers only with ``learn_ranges``."""
    range_params = set()
    for module in model.modules():
        if isinstance(module, TensorQuantizer) and module.learn_amax:
            range_params |= {id(p) for p in module.clip.parameters()}
            if learn_ranges:
                module.enable_clip()
            else:
                module.disable_clip()
    return [p for p in model.parameters() if p.requires_grad and (learn_ranges or id(p) not in range_params)]


def _cosine(total_steps: int, floor: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        progress = min(step / max(total_steps, 1), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _loss_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    device: torch.device,
) -> float:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device.type, enabled=scaler is not None):
        loss = _loss(model, batch, loss_fn, device)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _loss(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor], device: torch.device) -> torch.Tensor:
    """``loss_fn(logits, labels)`` of a labelled batch, or the loss a model returns for a dict batch that holds
    its labels (Hugging Face's ``labels=`` convention)."""
    inputs, labels = split_labels(batch, model, labelled=True)
    outputs = inputs.to(device)(model)
    if labels is not None:
        return loss_fn(_logits(outputs), labels.to(device) if isinstance(labels, torch.Tensor) else labels)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if loss is None:
        raise QdqConfigError(
            "QAT needs labels: batches of (inputs, labels), or dict batches that include the labels under the "
            "model's own key (a Hugging Face model given labels= returns its loss)."
        )
    return loss


def _logits(outputs: Any) -> Any:
    """The prediction a loss compares with the labels: the output itself, a mapping's ``logits`` (Hugging Face),
    else the first of several outputs."""
    if isinstance(outputs, Mapping):
        return outputs["logits"] if "logits" in outputs else next(iter(outputs.values()))
    if isinstance(outputs, tuple | list):
        return outputs[0]
    return outputs


def qat(
    model: nn.Module,
    train_data: Iterable[Any],
    eval_fn: EvalFn | None,
    epochs: int,
    lr: float,
    *,
    lr_scale: float = 0.01,
    final_lr_fraction: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    learn_ranges: bool = False,
    amp: bool | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    progress: Progress = True,
    loss_fn: nn.Module | None = None,
    optimizer: str = "sgd",
) -> QATResult:
    """Fine-tune a calibrated quantized ``model`` on labelled batches.

    A batch is ``(inputs, targets)`` (``inputs`` a tensor, a tuple of positional arguments or a dict of keyword
    arguments), a tuple whose last element is the targets (``(ids, mask, labels)``), or a dict of keyword
    arguments that includes the labels under the model's own key; the loss is then the one the model returns
    (Hugging Face models given ``labels=``). See :mod:`qdq.utils.batches`.

    Args:
        lr: the learning rate the float model was trained with; QAT starts at ``lr * lr_scale`` and
            anneals (cosine, per step) to ``final_lr_fraction`` of that.
        learn_ranges: also train the clip ranges of quantizers built with ``learn_amax``; stored amax
            buffers are never trained.
        amp: mixed precision (default: on for CUDA models, off on CPU).
        checkpoint_dir: where ``qat_checkpoint.pt`` is written after each epoch (atomically).
        resume: continue from the checkpoint in ``checkpoint_dir``, if any.
        loss_fn: ``loss_fn(logits, targets)`` (default cross-entropy); the logits are the model's output, its
            ``logits`` entry when it returns a mapping, or its first output.
        optimizer: ``"sgd"`` (``momentum``, L2 ``weight_decay``) or ``"adamw"`` (betas 0.9/0.999, decoupled
            ``weight_decay``): the optimizer the float model was trained with.
    """
    if epochs < 1 or lr <= 0:
        raise QdqConfigError(f"qat needs epochs >= 1 and lr > 0, got epochs={epochs}, lr={lr}.")
    if resume and checkpoint_dir is None:
        raise QdqConfigError("resume=True needs checkpoint_dir (where the previous run saved its checkpoint).")
    if optimizer not in QAT_OPTIMIZERS:
        raise QdqConfigError(f"qat optimizer must be one of {', '.join(QAT_OPTIMIZERS)}, got {optimizer!r}.")
    device = next(model.parameters()).device
    use_amp = (device.type == "cuda") if amp is None else amp
    params = _ddp_trainable_parameters(model, learn_ranges)
    if optimizer == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr * lr_scale, weight_decay=weight_decay)
    else:
        optim = torch.optim.SGD(params, lr=lr * lr_scale, momentum=momentum, weight_decay=weight_decay)
    steps_per_epoch = len(train_data) if hasattr(train_data, "__len__") else 1  # type: ignore[arg-type]  # checked
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, _cosine(epochs * steps_per_epoch, final_lr_fraction))
    scaler = torch.amp.GradScaler(device.type) if use_amp and device.type == "cuda" else None
    result, start = QATResult(), 0
    checkpoint = Path(checkpoint_dir) / _CHECKPOINT if checkpoint_dir is not None else None
    if resume and checkpoint is not None and _found_checkpoint(checkpoint):
        start = _restore(checkpoint, model, optim, scheduler, result)
    broadcast_quantizer_state(model)
    for epoch in range(start, epochs):
        _set_sampler_epoch(train_data, epoch)
        loss = _train_epoch(model, train_data, loss_fn or nn.CrossEntropyLoss(), optim, scheduler, scaler,
                            device, progress, f"QAT {epoch + 1}/{epochs}")  # fmt: skip
        loss = all_reduce_sum([loss])[0] / world_size()
        record = {"epoch": epoch + 1, "loss": loss, "lr": optim.param_groups[0]["lr"]}
        if eval_fn is not None:
            record["score"] = float(eval_fn(model))
        result.epochs.append(record)
        assert_in_sync(model)
        if checkpoint is not None:
            _save(checkpoint, model, optim, scheduler, epoch + 1, result)
    result.final_score = result.epochs[-1].get("score") if result.epochs else None
    return result


def _set_sampler_epoch(data: Iterable[Any], epoch: int) -> None:
    """Samplers with ``set_epoch`` (DistributedSampler, qdq's SeededSampler) replay epoch ``epoch``'s order."""
    sampler: Any = getattr(data, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def _train_epoch(
    model: nn.Module,
    data: Iterable[Any],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    device: torch.device,
    progress: Progress,
    desc: str,
) -> float:
    model.train()
    batches = progress_bar(data, progress, desc)
    total, count = 0.0, 0
    for batch in batches:
        total += _loss_step(model, batch, loss_fn, optimizer, scaler, device)
        scheduler.step()
        count += 1
    if count == 0:
        raise QdqConfigError("the QAT training data is empty: it yields no batch.")
    return total / count


def _ddp_trainable_parameters(model: nn.Module, learn_ranges: bool) -> list[nn.Parameter]:
    """:func:`_trainable_parameters`, keeping ``requires_grad`` as DistributedDataParallel registered it.

    DDP all-reduces the gradients of the parameters that required grad when it wrapped the model and waits
    for each of them: a range that is not learned keeps computing its (unused) gradient, and a range that
    is learned but was not registered would silently diverge between ranks, so it is an error.
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return _trainable_parameters(model, learn_ranges)
    before = [(p, p.requires_grad) for p in model.parameters()]
    params = _trainable_parameters(model, learn_ranges)
    registered = {id(p) for p, requires_grad in before if requires_grad}
    late = [n for n, p in model.module.named_parameters() if p.requires_grad and id(p) not in registered]
    for param, requires_grad in before:  # DDP waits for a gradient of every parameter it registered
        param.requires_grad_(requires_grad)
    if late:
        raise QdqConfigError(
            f"learn_ranges=True trains {late[:5]}, but they did not require grad when DistributedDataParallel "
            "wrapped the model, so their gradients would not be averaged across ranks. Call enable_clip() on "
            "those quantizers before wrapping the model in DistributedDataParallel."
        )
    return params


def _found_checkpoint(path: Path) -> bool:
    """Whether ``path`` exists, the same answer on every rank (else resuming would desynchronise them)."""
    found = path.exists()
    assert_same_across_ranks(found, f"whether {path} exists (checkpoint_dir must be on storage every rank sees)")
    return found


def _save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    result: QATResult,
) -> None:
    rng = _rng_states()  # a collective under torch.distributed: every rank takes part
    with main_process_only() as main:
        if main:
            state = {
                "epoch": epoch,
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng[0],
                "history": result.epochs,
            }
            if len(rng) > 1:
                state["rng_per_rank"] = rng
            save_atomic(state, path)


def _rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (only this process's when not distributed)."""
    if world_size() == 1:
        return [_rng_state()]
    states: list[Any] = [None] * world_size()
    with collective("gathering the RNG states for the checkpoint"):
        torch.distributed.all_gather_object(states, _rng_state())
    return states


def _restore(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    result: QATResult,
) -> int:
    state = torch.load(path, map_location="cpu", weights_only=False)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    per_rank = state.get("rng_per_rank")
    _set_rng_state(per_rank[rank()] if per_rank and len(per_rank) == world_size() else state["rng"])
    result.epochs = list(state["history"])
    result.resumed_from_epoch = int(state["epoch"])
    return result.resumed_from_epoch

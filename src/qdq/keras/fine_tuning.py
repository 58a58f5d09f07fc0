"""Quantization-aware fine-tuning of a Keras model with the seed's schedule (``model.fit``).

The recipe of :func:`qdq.qat`: about 10 % of the original schedule, starting at 1 % of the original learning
rate (``lr * lr_scale``), cosine-annealed per step to ``final_lr_fraction`` of that, SGD with momentum, the
calibrated ranges frozen (they are non-trainable variables). The model is compiled with that optimizer and
the loss; pass ``lr_scale=1.0`` to use ``lr`` as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qdq.errors import QdqConfigError
from qdq.workflow.fine_tuning import QATResult

__all__ = ["qat"]


def qat(
    model: Any,
    x: Any,
    y: Any = None,
    *,
    epochs: int,
    lr: float,
    eval_fn: Callable[[Any], float] | None = None,
    batch_size: int = 32,
    lr_scale: float = 0.01,
    final_lr_fraction: float = 0.01,
    momentum: float = 0.9,
    loss: Any = None,
    seed: int | None = 0,
    verbose: int = 0,
) -> QATResult:
    """Fine-tune a calibrated quantized Keras ``model`` on ``x`` / ``y`` (arrays, or a ``tf.data.Dataset`` of
    ``(inputs, labels)`` batches as ``x``).

    Args:
        epochs: fine-tuning epochs (>= 1).
        lr: the learning rate the float model was trained with (see the module doc).
        eval_fn: ``eval_fn(model) -> score`` after each epoch (recorded), or None.
        loss: the Keras loss (default: sparse categorical cross-entropy on logits).
        seed: Keras's random seed before training (shuffling), None to leave it.

    Returns:
        A :class:`~qdq.workflow.fine_tuning.QATResult`: ``{"epoch", "loss", "lr", "score"}`` per epoch.
    """
    from qdq.keras._backend import keras
    from qdq.keras.calibration import forget_traced_functions

    k = keras()
    if epochs < 1 or lr <= 0:
        raise QdqConfigError(f"qat needs epochs >= 1 and lr > 0, got epochs={epochs}, lr={lr}.")
    steps = _steps_per_epoch(x, batch_size)
    schedule = k.optimizers.schedules.CosineDecay(lr * lr_scale, epochs * steps, alpha=final_lr_fraction)
    optimizer = k.optimizers.SGD(learning_rate=schedule, momentum=momentum)
    model.compile(optimizer, loss or k.losses.SparseCategoricalCrossentropy(from_logits=True))
    if seed is not None:
        k.utils.set_random_seed(seed)
    result = QATResult()
    for epoch in range(epochs):
        history = model.fit(x, y, batch_size=None if y is None else batch_size, epochs=epoch + 1,
                            initial_epoch=epoch, verbose=verbose)  # fmt: skip
        record = {"epoch": epoch + 1, "loss": float(history.history["loss"][-1]),
                  "lr": float(schedule(min((epoch + 1) * steps, epochs * steps)))}  # fmt: skip
        if eval_fn is not None:
            forget_traced_functions(model)
            record["score"] = float(eval_fn(model))
        result.epochs.append(record)
    result.final_score = result.epochs[-1].get("score")
    return result


def _steps_per_epoch(x: Any, batch_size: int) -> int:
    length = getattr(x, "__len__", None)
    if length is None:
        raise QdqConfigError("qat needs data of known length: arrays, or a batched tf.data.Dataset.")
    n = len(x)
    return n if not hasattr(x, "shape") else max(1, math.ceil(n / batch_size))

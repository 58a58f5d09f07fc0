"""Fidelity check: does the deployed INT8 engine compute what the PyTorch fake-quant model computes?

``verify(model, "model.onnx", data, runtime="onnxruntime")`` runs the same batches through the PyTorch
model (eval mode, quantizers as calibrated) and through the runtime, and reports:

* **top-1 agreement**: percent of samples whose arg-max class is the same in both;
* **max error in steps**: the largest absolute output difference divided by one int8 step of the
  output's range, ``step = max|y_torch| / 127`` over the data (so 1.0 means "one quantization level of
  an int8 output");
* **SQNR** per output, in dB: ``10 log10(sum y_torch^2 / sum (y_torch - y_runtime)^2)`` (inf when equal).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.errors import QdqConfigError

__all__ = ["VerifyResult", "verify"]


@dataclass
class VerifyResult:
    """Agreement between the PyTorch model and one runtime over ``samples`` inputs."""

    runtime: str
    samples: int
    top1_agreement: float
    max_abs_error: float
    max_error_steps: float
    output_step: float
    sqnr_db: list[float]

    def ok(self, min_agreement: float = 99.5) -> bool:
        """True when top-1 agreement reaches ``min_agreement`` percent."""
        return self.top1_agreement >= min_agreement

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        sqnr = ", ".join("inf" if math.isinf(s) else f"{s:.1f}" for s in self.sqnr_db)
        return (
            f"{self.runtime}: top-1 agreement {self.top1_agreement:.2f}% over {self.samples} samples, "
            f"max error {self.max_error_steps:.2f} steps ({self.max_abs_error:.3g}), SQNR {sqnr} dB"
        )


def _inputs(batch: Any) -> np.ndarray | torch.Tensor:
    if isinstance(batch, tuple | list):
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return batch
    if hasattr(batch, "numpy") or isinstance(batch, np.ndarray):  # numpy, or a TensorFlow tensor
        return np.asarray(batch, dtype=np.float32)
    raise QdqConfigError(f"verify needs tensor batches or (inputs, labels) pairs, got {type(batch).__name__}.")


def _as_list(outputs: Any) -> list[np.ndarray]:
    if not isinstance(outputs, list | tuple):
        outputs = [outputs]
    return [
        o.detach().float().cpu().numpy() if isinstance(o, torch.Tensor) else np.asarray(o, np.float32) for o in outputs
    ]


def _reference(model: Any) -> Callable[[Any], list[np.ndarray]]:
    """The model as a function of one batch: PyTorch (eval mode, no grad) or any other framework's callable."""
    if isinstance(model, nn.Module):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return lambda x: _as_list(model(torch.as_tensor(x).to(device)))
    if callable(model):  # e.g. a Keras model: called in inference mode on the numpy batch
        call = getattr(model, "predict_on_batch", model)
        return lambda x: _as_list(call(x.cpu().numpy() if isinstance(x, torch.Tensor) else x))
    raise QdqConfigError(f"verify needs a model (torch.nn.Module or a Keras model), got {type(model).__name__}.")


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-30) / noise)


def verify(
    model: nn.Module | Any,
    onnx_path: str | Path,
    data: Iterable[Any],
    runtime: str = "onnxruntime",
    *,
    num_batches: int | None = None,
    threads: int | None = None,
    **runtime_options: Any,
) -> VerifyResult:
    """Compare ``model`` (PyTorch or Keras, fake-quant) with ``onnx_path`` running on ``runtime``.

    Args:
        model: the quantized model the ONNX file was exported from: a ``torch.nn.Module`` (run in eval
            mode), or a Keras model from :func:`qdq.keras.quantize_model` (run in inference mode).
        data: batches (tensors or ``(inputs, labels)`` pairs); labels are not used.
        runtime: ``"onnxruntime"``, ``"openvino"`` or ``"tensorrt"``.
        runtime_options: passed to :func:`qdq.runtime.load_runtime` (e.g. ``precision="f32"``).
    """
    from qdq.runtime import load_runtime

    reference = _reference(model)
    batches = list(itertools.islice(data, num_batches) if num_batches else data)
    if not batches:
        raise QdqConfigError("verify got no data: pass at least one batch.")
    is_torch = isinstance(model, nn.Module)
    was_training = model.training if is_torch else False
    if is_torch:
        model.eval()
    torch_outs: list[list[np.ndarray]] = []
    engine_outs: list[list[np.ndarray]] = []
    try:
        with load_runtime(onnx_path, runtime, threads=threads, **runtime_options) as engine, torch.no_grad():
            for batch in batches:
                x = _inputs(batch)
                torch_outs.append(reference(x))
                host = x.cpu().numpy() if isinstance(x, torch.Tensor) else x
                engine_outs.append([np.asarray(o, dtype=np.float32) for o in engine.run(host)])
    finally:
        if is_torch:
            model.train(was_training)
    return _compare(runtime, torch_outs, engine_outs)


def _compare(
    runtime: str, torch_outs: Sequence[list[np.ndarray]], engine_outs: Sequence[list[np.ndarray]]
) -> VerifyResult:
    n_outputs = len(torch_outs[0])
    if any(len(e) != n_outputs for e in engine_outs):
        raise QdqConfigError(f"the ONNX model has a different number of outputs than the PyTorch model ({n_outputs}).")
    ref = [np.concatenate([b[i] for b in torch_outs]) for i in range(n_outputs)]
    got = [np.concatenate([b[i] for b in engine_outs]) for i in range(n_outputs)]
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            raise QdqConfigError(f"output shapes differ: PyTorch {r.shape} vs runtime {g.shape}.")
    diffs = [np.abs(r.astype(np.float64) - g) for r, g in zip(ref, got)]
    max_abs = float(max(d.max() for d in diffs))
    step = float(max(np.abs(r).max() for r in ref)) / 127.0
    sqnr = [_sqnr(float(np.sum(r.astype(np.float64) ** 2)), float(np.sum(d**2))) for r, d in zip(ref, diffs)]
    first_ref, first_got = ref[0], got[0]
    if first_ref.ndim >= 2:
        agreement = 100.0 * float(np.mean(first_ref.argmax(axis=1) == first_got.argmax(axis=1)))
    else:
        agreement = 100.0 * float(np.mean(np.sign(first_ref) == np.sign(first_got)))
    return VerifyResult(
        runtime=runtime,
        samples=int(first_ref.shape[0]),
        top1_agreement=agreement,
        max_abs_error=max_abs,
        max_error_steps=max_abs / step if step > 0 else (0.0 if max_abs == 0 else math.inf),
        output_step=step,
        sqnr_db=sqnr,
    )

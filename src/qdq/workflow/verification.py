"""Fidelity check: does the deployed INT8 engine compute what its reference computes?

``verify(reference, "model.onnx", data, runtime="onnxruntime")`` runs the same batches through the reference and
through the engine. The reference is the PyTorch or Keras fake-quant model the file was exported from (is the
engine exact?), or the FP32 ONNX file an INT8 file was quantized from (what did quantizing cost?). It reports:

* **top-1 agreement**: percent of positions whose arg-max along ``class_axis`` (default 1: the class of an
  ``[N, C]`` classifier, the class of each pixel of an ``[N, C, H, W]`` map) is the same in both;
* **max error in steps**: the largest absolute output difference divided by one int8 step of the output's range,
  ``step = max|y_reference| / 127`` over the data (so 1.0 means "one quantization level of an int8 output");
* **SQNR** per output, in dB: ``10 log10(sum y_ref^2 / sum (y_ref - y_engine)^2)`` (inf when equal);
* the user's **metric** when given: ``metric(reference_outputs, engine_outputs)`` on every output over all the
  data (each a list of arrays, samples along axis 0), higher is better (a detector's F1 against the reference).

The verdict (:meth:`VerifyResult.verdict`) is PASS when the agreement reaches ``min_agreement`` (99.5 %), the max
error stays within ``max_error_steps`` (8 output steps; not judged against an FP32 reference, where the error is
quantization's own) and the metric reaches ``min_metric`` when one is given, FAIL otherwise; the result names the
thresholds it applied. When an engine fails, :func:`qdq.workflow.divergence.locate_divergence` finds where it
departs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qdq.errors import QdqConfigError
from qdq.utils.batches import ModelInputs, flatten_outputs, model_inputs
from qdq.utils.modes import eval_mode
from qdq.workflow.divergence import Divergence, QuantizerAgreement, locate_divergence

__all__ = [
    "MAX_ERROR_STEPS",
    "MIN_AGREEMENT",
    "Divergence",
    "Metric",
    "QuantizerAgreement",
    "VerifyResult",
    "locate_divergence",
    "onnx_feed",
    "sqnr_db",
    "verify",
]

#: default PASS threshold: percent of samples whose top-1 class is the same in the reference and the engine
MIN_AGREEMENT = 99.5
#: default PASS threshold against a fake-quant reference: largest output difference, in int8 steps of its range
MAX_ERROR_STEPS = 8.0

Metric = Callable[[list[np.ndarray], list[np.ndarray]], float]
"""``metric(reference_outputs, engine_outputs) -> float``: one array per model output, samples along axis 0;
higher is better."""


@dataclass
class VerifyResult:
    """Agreement between a reference and one runtime over ``samples`` inputs, and the thresholds of its verdict
    (``min_agreement`` percent, ``max_allowed_steps`` output steps, ``min_metric`` when a metric was given);
    ``how``: how the runtime computed the file where it departs from its defaults (:attr:`qdq.runtime.Runtime.how`:
    a float16 file on ONNX Runtime runs without graph optimizations, as TensorRT computes it)."""

    runtime: str
    samples: int
    top1_agreement: float
    max_abs_error: float
    max_error_steps: float
    output_step: float
    sqnr_db: list[float]
    min_agreement: float = MIN_AGREEMENT
    max_allowed_steps: float = MAX_ERROR_STEPS
    reference: str = "PyTorch"
    metric_name: str | None = None
    metric: float | None = None
    min_metric: float | None = None
    how: str | None = None

    def ok(self, min_agreement: float | None = None, max_error_steps: float | None = None) -> bool:
        """True when the agreement reaches ``min_agreement`` percent, the max error is within ``max_error_steps``
        (each default: the result's own threshold) and the metric reaches ``min_metric`` (when set)."""
        agreement = self.min_agreement if min_agreement is None else min_agreement
        steps = self.max_allowed_steps if max_error_steps is None else max_error_steps
        metric_ok = self.min_metric is None or (self.metric is not None and self.metric >= self.min_metric)
        return self.top1_agreement >= agreement and self.max_error_steps <= steps and metric_ok

    @property
    def verdict(self) -> str:
        """``"PASS"`` or ``"FAIL"`` by the result's thresholds."""
        return "PASS" if self.ok() else "FAIL"

    def verdict_line(self) -> str:
        """The verdict with each threshold and how the measurement compares to it."""
        agree = ">=" if self.top1_agreement >= self.min_agreement else "<"
        parts = [f"top-1 agreement {self.top1_agreement:.2f} % {agree} {self.min_agreement:.2f} %"]
        if math.isfinite(self.max_allowed_steps):
            error = "<=" if self.max_error_steps <= self.max_allowed_steps else ">"
            parts.append(f"max error {self.max_error_steps:.2f} {error} {self.max_allowed_steps:.2f} output steps")
        if self.min_metric is not None and self.metric is not None:
            sign = ">=" if self.metric >= self.min_metric else "<"
            parts.append(f"{self.metric_name} {self.metric:.4g} {sign} {self.min_metric:.4g}")
        return f"{self.verdict}: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}

    def __str__(self) -> str:
        sqnr = ", ".join("inf" if math.isinf(s) else f"{s:.1f}" for s in self.sqnr_db)
        metric = f", {self.metric_name} {self.metric:.4g}" if self.metric is not None else ""
        return (
            f"{self.runtime} against {self.reference}: top-1 agreement {self.top1_agreement:.2f}% over "
            f"{self.samples} samples, max error {self.max_error_steps:.2f} steps ({self.max_abs_error:.3g}), "
            f"SQNR {sqnr} dB{metric}" + (f"\n{self.how}" if self.how else "")
        )


def _as_list(outputs: Any) -> list[np.ndarray]:
    return [
        o.detach().float().cpu().numpy() if isinstance(o, torch.Tensor) else np.asarray(o, np.float32)
        for o in flatten_outputs(outputs)
    ]


_Step = Callable[[Any, Any], tuple[list[np.ndarray], list[np.ndarray]]]


def _torch_step(model: nn.Module) -> _Step:
    """One batch through the PyTorch model and the engine, fed by the batch convention (qdq.utils.batches)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def step(batch: Any, engine: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        inputs = model_inputs(batch, model)
        reference = _as_list(inputs.to(device)(model))
        return reference, engine.run(onnx_feed(inputs, engine.input_names))

    return step


def onnx_feed(inputs: ModelInputs, engine_names: list[str]) -> dict[str, np.ndarray]:
    """An ONNX engine's feed (graph input name -> array): the batch's tensors under the names export gave them (a
    one-input file whatever its input's name).

    Raises:
        QdqConfigError: the batch's inputs are not the graph's.
    """
    named = {name: t.detach().cpu().numpy() for name, t in inputs.tensors()}
    if set(named) == set(engine_names):
        return named
    if len(named) == len(engine_names) == 1:
        return {engine_names[0]: next(iter(named.values()))}
    raise QdqConfigError(
        f"the batch gives inputs {list(named)} but the ONNX model's inputs are {engine_names}; export the model "
        "with an example batch of the same form (a dict's keys name the ONNX inputs)."
    )


def _arrays(batch: Any) -> Any:
    """A batch for an ONNX reference: a dict of arrays named after the graph inputs, or one array (the labels of
    an ``(inputs, labels)`` pair dropped), as numpy."""
    if isinstance(batch, tuple | list):
        batch = batch[0]
    if isinstance(batch, dict):
        return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in batch.items()}
    return batch.cpu().numpy() if isinstance(batch, torch.Tensor) else np.asarray(batch)


def _onnx_step(reference: Any) -> _Step:
    """One batch through the reference ONNX file's runtime and the engine, fed alike."""

    def step(batch: Any, engine: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        feed = _arrays(batch)
        return _as_list(reference.run(feed)), engine.run(feed)

    return step


def _framework_step(model: Any) -> _Step:
    """Another framework's callable (a Keras model, called in inference mode) on one-input batches."""
    call = getattr(model, "predict_on_batch", model)

    def step(batch: Any, engine: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        x = batch[0] if isinstance(batch, tuple | list) else batch
        if isinstance(x, torch.Tensor):
            x = x.cpu().numpy()
        if not hasattr(x, "numpy") and not isinstance(x, np.ndarray):
            raise QdqConfigError(f"verify needs array batches or (inputs, labels) pairs, got {type(x).__name__}.")
        x = np.asarray(x, dtype=np.float32)
        return _as_list(call(x)), engine.run(x)

    return step


def is_onnx_file(model: Any) -> bool:
    """Whether ``model`` names an ONNX file (a ``str`` or ``Path`` ending in ``.onnx``)."""
    return isinstance(model, str | Path) and str(model).endswith(".onnx")


def _step_for(model: Any, stack: ExitStack, threads: int | None) -> _Step:
    from qdq.runtime import load_runtime

    if isinstance(model, nn.Module):
        return _torch_step(model)
    if is_onnx_file(model):  # the FP32 original, run in float on ONNX Runtime
        return _onnx_step(stack.enter_context(load_runtime(model, "onnxruntime", threads=threads)))
    if callable(model):  # e.g. a Keras model
        return _framework_step(model)
    raise QdqConfigError(
        f"verify needs a reference: a torch.nn.Module, a Keras model or an FP32 .onnx file, got {type(model).__name__}."
    )


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: energies (sums of squares) in, dB out; inf without noise."""
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-30) / noise)


def verify(
    model: nn.Module | str | Path | Any,
    onnx_path: str | Path,
    data: Iterable[Any],
    runtime: str = "onnxruntime",
    *,
    num_batches: int | None = None,
    threads: int | None = None,
    min_agreement: float = MIN_AGREEMENT,
    max_error_steps: float | None = None,
    metric: Metric | None = None,
    min_metric: float | None = None,
    class_axis: int = 1,
    **runtime_options: Any,
) -> VerifyResult:
    """Compare ``onnx_path`` running on ``runtime`` with its reference ``model``.

    Args:
        model: the reference: the quantized model the ONNX file was exported from (a ``torch.nn.Module``, run in
            eval mode, or a Keras model from :func:`qdq.keras.quantize_model`, run in inference mode), or the path
            of the FP32 ``.onnx`` file an INT8 file was quantized from (run in float on ONNX Runtime).
        data: batches: for a PyTorch model a tensor, a tuple of positional arguments, a dict of keyword
            arguments or an ``(inputs, labels)`` pair (:mod:`qdq.utils.batches`; labels are not used), fed
            to the engine under the names :func:`qdq.export.export_onnx` gave them; for a Keras model
            arrays or ``(inputs, labels)`` pairs; for an ONNX reference dicts of arrays named after the graph
            inputs, or arrays for a one-input model.
        runtime: ``"onnxruntime"``, ``"openvino"`` or ``"tensorrt"``.
        min_agreement: the verdict's threshold on top-1 agreement, in percent (PASS needs at least this).
        max_error_steps: the verdict's threshold on the max error, in output steps (PASS needs at most this);
            default :data:`MAX_ERROR_STEPS` against a fake-quant model, not judged against an FP32 ONNX file.
        metric: ``metric(reference_outputs, engine_outputs) -> float`` over all the data (:data:`Metric`).
        min_metric: the verdict's threshold on ``metric`` (PASS needs at least this); None: reported only.
        class_axis: the axis of the first output whose arg-max the agreement compares.
        runtime_options: passed to :func:`qdq.runtime.load_runtime` (e.g. ``precision="f32"``).
    """
    from qdq.runtime import load_runtime

    batches = list(itertools.islice(data, num_batches) if num_batches else data)
    if not batches:
        raise QdqConfigError("verify got no data: pass at least one batch.")
    if min_metric is not None and metric is None:
        raise QdqConfigError("verify got min_metric but no metric: pass metric=callable(reference, engine).")
    torch_model = model if isinstance(model, nn.Module) else None
    reference_outs: list[list[np.ndarray]] = []
    engine_outs: list[list[np.ndarray]] = []
    with ExitStack() as stack, torch.no_grad():
        if torch_model is not None:
            stack.enter_context(eval_mode(torch_model))
        step = _step_for(model, stack, threads)
        engine = stack.enter_context(load_runtime(onnx_path, runtime, threads=threads, **runtime_options))
        how = engine.how
        for batch in batches:
            reference, engine_out = step(batch, engine)
            reference_outs.append(reference)
            engine_outs.append([np.asarray(o, dtype=np.float32) for o in engine_out])
    label = "PyTorch" if torch_model is not None else "Keras"
    if is_onnx_file(model):
        label = f"FP32 {Path(str(model)).name}"
    result = _compare(runtime, reference_outs, engine_outs, class_axis, label)
    if max_error_steps is None:
        max_error_steps = math.inf if is_onnx_file(model) else MAX_ERROR_STEPS
    result.min_agreement, result.max_allowed_steps = float(min_agreement), float(max_error_steps)
    result.how = how
    if metric is not None:
        ref = [np.concatenate([b[i] for b in reference_outs]) for i in range(len(reference_outs[0]))]
        got = [np.concatenate([b[i] for b in engine_outs]) for i in range(len(engine_outs[0]))]
        result.metric_name = getattr(metric, "__name__", "metric")
        result.metric, result.min_metric = float(metric(ref, got)), min_metric
    return result


def _compare(
    runtime: str,
    reference_outs: Sequence[list[np.ndarray]],
    engine_outs: Sequence[list[np.ndarray]],
    class_axis: int,
    label: str,
) -> VerifyResult:
    n_outputs = len(reference_outs[0])
    if any(len(e) != n_outputs for e in engine_outs):
        raise QdqConfigError(f"the ONNX model has a different number of outputs than the {label} model ({n_outputs}).")
    ref = [np.concatenate([b[i] for b in reference_outs]) for i in range(n_outputs)]
    got = [np.concatenate([b[i] for b in engine_outs]) for i in range(n_outputs)]
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            raise QdqConfigError(f"output shapes differ: {label} {r.shape} vs runtime {g.shape}.")
    diffs = [np.abs(r.astype(np.float64) - g) for r, g in zip(ref, got)]
    max_abs = float(max(d.max() for d in diffs))
    step = float(max(np.abs(r).max() for r in ref)) / 127.0
    sqnr = [sqnr_db(float(np.sum(r.astype(np.float64) ** 2)), float(np.sum(d**2))) for r, d in zip(ref, diffs)]
    first_ref, first_got = ref[0], got[0]
    if first_ref.ndim >= 2:
        same = first_ref.argmax(axis=class_axis) == first_got.argmax(axis=class_axis)
        agreement = 100.0 * float(np.mean(same))
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
        reference=label,
    )

"""The INT8 engines of a job, one per runtime: what they compute, how faithfully, in what precision, how fast.

For each runtime :func:`measure_engines` records

* the engine's **accuracy** on the test data;
* its **fidelity** to the fake-quant model (:func:`qdq.verify`: PASS / FAIL with the thresholds applied),
  and, when it fails on a PyTorch model, **where** it departs (:func:`qdq.workflow.verification.locate_divergence`)
  with the known cause when the runtime's backend knows one (:meth:`qdq.runtime.Backend.divergence_cause`);
* its **int8 coverage**: how many weighted layers run as int8 kernels and how many fall back to float,
  as the runtime's backend reports it (:meth:`qdq.runtime.Backend.int8_coverage`: ONNX Runtime's optimized
  graph, OpenVINO's runtime precisions, TensorRT's strongly typed graph), with the reason for the fallback;
* its **latency** against the FP32 model on the same runtime, both timed in interleaved rounds
  (:func:`qdq.runtime.compare_models`): median speed-up and its interquartile range per batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.runtime import compare_models, get_backend, load_runtime
from qdq.workflow.progress import Progress, counter

if TYPE_CHECKING:
    from qdq.app.pipeline import PipelineConfig

__all__ = ["coverage", "measure_engines"]


def measure_engines(
    cfg: PipelineConfig,
    model: Any,
    int8: Path,
    fp32: Path,
    batches: list[Any],
    evaluate: Callable[[Callable[[np.ndarray], np.ndarray]], float],
    progress: Progress = False,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The INT8 engine on each of ``cfg.runtimes`` (see the module doc).

    Args:
        model: the fake-quant model ``int8`` was exported from (PyTorch or Keras).
        batches: test batches for :func:`qdq.verify` (tensors or ``(inputs, labels)``).
        evaluate: ``evaluate(predict) -> top-1 %`` with ``predict`` mapping an input batch to logits.
        progress: bars named after the run (:mod:`qdq.workflow.progress`).

    Returns:
        ``({runtime: record}, [latency rows])``: the record holds ``accuracy``, verify's numbers with
        ``verdict`` and thresholds, ``divergence`` (text or None), ``int8_layers`` / ``float_layers`` /
        ``fallback``; each latency row a variant (FP32, INT8) at a batch size with its median time and the
        INT8 speed-up with its spread.
    """
    engines, latency = {}, []
    for runtime in cfg.runtimes:
        engines[runtime] = _engine_record(cfg, model, int8, batches, evaluate, runtime, progress)
        latency += _latency_rows(cfg, int8, fp32, runtime, progress)
    return engines, latency


def _engine_record(
    cfg: PipelineConfig, model: Any, int8: Path, batches: list[Any],
    evaluate: Callable[[Callable[[np.ndarray], np.ndarray]], float], runtime: str, progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    from qdq.workflow.verification import verify

    with counter(progress, f"{runtime}: accuracy, fidelity, int8 coverage", 3) as bar:
        with load_runtime(int8, runtime, threads=cfg.threads) as engine:
            accuracy = evaluate(lambda x: engine.run(x)[0])
        bar.update()
        fidelity = verify(model, int8, batches, runtime, threads=cfg.threads)
        bar.update()
        layers = coverage(runtime, int8, cfg.threads)
        bar.update()
    record: dict[str, Any] = {"accuracy": accuracy, **fidelity.to_dict(), "divergence": None, **layers}
    if not fidelity.ok() and _is_torch(model):
        record["divergence"] = _divergence(model, int8, batches[0], runtime, cfg.threads, progress)
    return record


def _is_torch(model: Any) -> bool:
    from torch import nn

    return isinstance(model, nn.Module)


def _divergence(model: Any, int8: Path, batch: Any, runtime: str, threads: int, progress: Progress) -> str:
    import onnx

    from qdq.workflow.verification import locate_divergence

    with counter(progress, f"{runtime}: locating where the engine departs", 1) as bar:
        found = locate_divergence(model, int8, batch, runtime, threads=threads)
        bar.update()
    text = str(found)
    if found.first is not None:
        cause = get_backend(runtime).divergence_cause(_input_op(onnx.load(str(int8)), found.first.name))
        if cause:
            text += f". Cause: {cause}."
    return text


def _input_op(proto: Any, quantizer: str) -> str:
    """The op type feeding the QuantizeLinear of ``quantizer`` (looking through a Clip), or ``""``."""
    producers = {out: node for node in proto.graph.node for out in node.output}
    q = next((n for n in proto.graph.node if n.name == f"{quantizer}/QuantizeLinear"), None)
    source = producers.get(q.input[0]) if q is not None else None
    if source is not None and source.op_type == "Clip":  # a sub-8-bit clamp before the int8 Q
        source = producers.get(source.input[0])
    return "" if source is None else source.op_type


def coverage(runtime: str, int8: Path, threads: int | None) -> dict[str, Any]:
    """What the runtime made of the INT8 model, as its backend reports it (:meth:`qdq.runtime.Backend.int8_coverage`):
    ``int8_layers`` / ``float_layers``, the weighted layers run as int8 kernels and in float, ``fallback``, why
    layers run in float (the reason most of them share), and ``float_between``, a count of the float work left
    between them, described by ``float_between_what`` (all None for a runtime that reports no coverage)."""
    found = get_backend(runtime).int8_coverage(int8, threads=threads)
    if found is None:
        return dict.fromkeys(("int8_layers", "float_layers", "float_between", "float_between_what", "fallback"))
    return found.to_dict()


def _latency_rows(
    cfg: PipelineConfig, int8: Path, fp32: Path, runtime: str, progress: Progress
) -> list[dict[str, Any]]:
    rows = []
    for batch in cfg.bench_batches:
        with counter(progress, f"{runtime}: timing FP32 vs INT8, batch {batch}", 2 * cfg.bench_rounds) as bar:
            result = compare_models({"FP32": fp32, "INT8": int8}, runtime, batch=batch, threads=cfg.threads,
                                    rounds=cfg.bench_rounds, iters=cfg.bench_iters,
                                    progress=bar.update)  # fmt: skip
        speedup = result.speedup("INT8")
        common = {"runtime": runtime, "batch": batch, "threads": cfg.threads, "rounds": result.rounds,
                  "iters": result.iters}  # fmt: skip
        rows.append({**common, "variant": "FP32", "median_ms": result.median_ms("FP32"), "speedup": 1.0})
        rows.append({**common, "variant": "INT8", "median_ms": result.median_ms("INT8"), "speedup": speedup.median,
                     "speedup_low": speedup.low, "speedup_high": speedup.high})  # fmt: skip
    return rows

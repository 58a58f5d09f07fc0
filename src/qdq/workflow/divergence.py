"""Where an engine departs from its reference, one activation quantizer at a time.

The INT8 file is cut after each activation quantizer's DequantizeLinear (in graph order), the cut graph run on
the engine, and its output compared with the reference's value of that quantizer, in steps of that quantizer
(its scale). The reference is the PyTorch fake-quant model the file was exported from, or, for any Q/DQ file
(one from :func:`qdq.quantize_onnx`), the Q/DQ graph itself computed in float by ONNX Runtime with every graph
optimization off: what the file means, against which an engine's int8 kernels are judged.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from qdq.errors import QdqConfigError
from qdq.graphs.onnx import feed_inputs
from qdq.utils.batches import model_inputs
from qdq.utils.modes import eval_mode

__all__ = ["Divergence", "QuantizerAgreement", "locate_divergence"]


@dataclass
class QuantizerAgreement:
    """One activation quantizer's output in the reference and in the engine (the graph cut after its
    DequantizeLinear), compared in steps of that quantizer: ``differing`` is the fraction of elements
    more than half a step apart (a different integer code), ``max_steps`` the largest difference."""

    name: str
    differing: float
    max_steps: float


@dataclass
class Divergence:
    """Where an engine departs from its reference (``reference``: ``"PyTorch"`` or ``"its Q/DQ graph"``): the
    quantizers compared, in graph order, up to the first one whose codes differ on more than ``tolerance`` of its
    elements (``first``, None if none did)."""

    runtime: str
    tolerance: float
    compared: list[QuantizerAgreement] = field(default_factory=list)
    reference: str = "PyTorch"

    @property
    def first(self) -> QuantizerAgreement | None:
        last = self.compared[-1] if self.compared else None
        return last if last is not None and last.differing > self.tolerance else None

    def __str__(self) -> str:
        first = self.first
        if first is None:
            return (f"{self.runtime}: every one of the {len(self.compared)} activation quantizers compared agrees "
                    f"with {self.reference}; the difference arises after the last one")  # fmt: skip
        before = self.compared[-2].name if len(self.compared) > 1 else None
        where = f"; the {len(self.compared) - 1} quantizers before it agree (the last: {before})" if before else ""
        return (
            f"{self.runtime} departs from {self.reference} at {first.name}: {100 * first.differing:.1f} % of its "
            f"codes differ, by up to {first.max_steps:.0f} step(s){where}"
        )


# name of a quantizer -> (its output for the batch, its step)
_References = dict[str, tuple[np.ndarray, float]]


def locate_divergence(
    model: nn.Module | None,
    onnx_path: str | Path,
    batch: Any,
    runtime: str = "onnxruntime",
    *,
    tolerance: float = 0.05,
    threads: int | None = None,
    **runtime_options: Any,
) -> Divergence:
    """Find the first activation quantizer where ``runtime`` computes other codes than the reference.

    ``model`` is the PyTorch model the file was exported from: each of its activation quantizers whose Q/DQ pair
    is in the graph under its name (``<name>/DequantizeLinear``, as :func:`qdq.export_onnx` writes it) is compared
    with PyTorch's output, ``batch`` a tensor or an ``(inputs, labels)`` pair. ``model=None`` compares every
    activation DequantizeLinear of the file with the file's own Q/DQ graph computed in float, ``batch`` a dict of
    arrays named after the graph inputs or an array for a one-input file.

    The scan stops at the first quantizer whose codes differ on more than ``tolerance`` (a fraction) of its
    elements: an int8 kernel that rounds its bias or requantizes in fixed point moves a few codes by one step, a
    departure moves many more (OpenVINO's fused residual Add; both measured: benchmarks/RESULTS.md, code_figures).
    Each cut graph is compiled separately, so this costs one engine build per quantizer.
    """
    proto = onnx.load(str(onnx_path))
    if model is None:
        feed, references, label = _graph_references(proto, batch, threads)
    elif isinstance(model, nn.Module):
        feed = _single_input(batch, model)
        references, label = _torch_references(model, feed), "PyTorch"
    else:
        raise QdqConfigError(
            "locate_divergence needs the PyTorch model the ONNX file was exported from, or None to compare the "
            "engine with the file's own Q/DQ graph."
        )
    return _scan(proto, feed, references, Divergence(runtime, tolerance, reference=label), threads, runtime_options)


def _scan(
    proto: onnx.ModelProto,
    feed: Any,
    references: _References,
    result: Divergence,
    threads: int | None,
    runtime_options: Mapping[str, Any],
) -> Divergence:
    import onnx.shape_inference
    import onnx.utils

    from qdq.runtime import load_runtime

    inputs = [i.name for i in feed_inputs(proto)]
    extractor = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(proto))  # needs every tensor's type
    with tempfile.TemporaryDirectory(prefix="qdq-locate-") as tmp:
        for node in proto.graph.node:
            name = node.name.removesuffix("/DequantizeLinear")
            if node.op_type != "DequantizeLinear" or name not in references:
                continue
            cut = extractor.extract_model(inputs, [node.output[0]])
            cut.metadata_props.extend(proto.metadata_props)
            path = Path(tmp) / "cut.onnx"
            onnx.save(cut, str(path))
            with load_runtime(path, result.runtime, threads=threads, **runtime_options) as engine:
                got = np.asarray(engine.run(feed)[0], dtype=np.float64)
            expected, step = references[name]
            diff = np.abs(expected - got) / step
            result.compared.append(QuantizerAgreement(name, float(np.mean(diff > 0.5)), float(diff.max())))
            if result.compared[-1].differing > result.tolerance:
                break
    return result


def _single_input(batch: Any, model: nn.Module) -> np.ndarray:
    """The one input array of ``batch`` (labels dropped): the graph cuts are fed by position."""
    if isinstance(batch, np.ndarray) or (isinstance(batch, tuple | list) and isinstance(batch[0], np.ndarray)):
        batch = torch.as_tensor(batch if isinstance(batch, np.ndarray) else batch[0])
    tensors = [t for _, t in model_inputs(batch, model).tensors()]
    if len(tensors) != 1:
        raise QdqConfigError(f"locate_divergence feeds one-input models; this batch gives {len(tensors)} tensors.")
    return tensors[0].detach().cpu().numpy()


def _torch_references(model: nn.Module, x: np.ndarray) -> _References:
    """Each activation quantizer's output for ``x`` (float64) and step, for the quantizers called exactly once."""
    from qdq.workflow.calibration import named_quantizers

    quantizers = dict(named_quantizers(model, weights=False))
    seen: dict[str, list[np.ndarray]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            seen.setdefault(name, []).append(output.detach().double().cpu().numpy())

        return hook

    handles = [q.register_forward_hook(keep(n)) for n, q in quantizers.items()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with eval_mode(model), torch.no_grad():
            model(torch.as_tensor(x).to(device))
    finally:
        for handle in handles:
            handle.remove()
    return {n: (outs[0], float(quantizers[n].step().detach().max())) for n, outs in seen.items() if len(outs) == 1}


def _graph_references(proto: onnx.ModelProto, batch: Any, threads: int | None) -> tuple[Any, _References, str]:
    """The feed, and each activation DequantizeLinear's output (by node name, float64) and step, from the Q/DQ
    graph computed in float (ONNX Runtime, every graph optimization off)."""
    from qdq.graphs.onnx_session import ort_session, outputs_of, probe_model, session_options

    constants = {t.name: t for t in proto.graph.initializer}
    dequantized = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in constants]
    if any(not n.name for n in dequantized):
        raise QdqConfigError("locate_divergence needs every DequantizeLinear of the file named (qdq's files are).")
    probe = probe_model(proto, [n.output[0] for n in dequantized])
    session = ort_session(probe, session_options(threads=threads, optimization_level="disable"))
    names = [i.name for i in session.get_inputs()]
    feed = batch if isinstance(batch, dict) else {names[0]: np.asarray(batch)}
    values = outputs_of(session, feed)
    references = {
        n.name.removesuffix("/DequantizeLinear"): (
            values[n.output[0]].astype(np.float64),
            float(np.max(numpy_helper.to_array(constants[n.input[1]]))),
        )
        for n in dequantized
        if n.input[1] in constants
    }
    return feed, references, "its Q/DQ graph"

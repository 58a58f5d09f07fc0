"""Shared helpers of the export tests: calibration by hand, ORT sessions, comparisons in steps."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qdq.quantizer import TensorQuantizer
from qdq.utils.reduce_amax import amax_over


def calibrate_max(model: nn.Module, *inputs: torch.Tensor) -> None:
    """Set every enabled quantizer's amax to the max |x| it sees on ``inputs`` (the max calibrator's result)."""
    seen: dict[TensorQuantizer, torch.Tensor] = {}

    def hook(module: TensorQuantizer, args: tuple) -> None:
        x = args[0].detach().float()
        if module.pre_quant_scale is not None:
            x = x * module.pre_quant_scale
        amax = amax_over(x, module.axis)
        seen[module] = amax if module not in seen else torch.maximum(seen[module], amax)

    quantizers = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    handles = [q.register_forward_pre_hook(hook) for q in quantizers]
    with torch.no_grad():
        model.eval()
        for x in inputs:
            model(x)
    for h in handles:
        h.remove()
    for q, amax in seen.items():
        if not q.learn_amax:
            q.amax = amax


def ort_session(path: Path | str, optimize: bool = True, optimized_path: Path | None = None):
    """One-thread ORT session, int8 weights run as uint8 where this CPU's int8 kernels saturate (qdq.runtime)."""
    from qdq.runtime.ort import inference_session, session_options

    options = session_options(
        threads=1,
        optimization_level="all" if optimize else "disable",
        optimized_model_path=None if optimized_path is None else str(optimized_path),
    )
    return inference_session(path, options)


def run_ort(path: Path | str, x: torch.Tensor | dict[str, torch.Tensor], optimize: bool = True) -> np.ndarray:
    return ort_session(path, optimize).run(None, feed(x))[0]


def steps_apart(reference: np.ndarray, other: np.ndarray) -> float:
    """Max difference in units of an int8 step of the reference output (max |ref| / 127)."""
    reference = reference.astype(np.float64)
    unit = float(np.abs(reference).max()) / 127
    return float(np.abs(reference - other.astype(np.float64)).max() / unit)


def inexact_quantizers(torch_out: dict[str, np.ndarray], onnx_out: dict[str, np.ndarray]) -> dict[str, float]:
    """Quantizers whose ONNX value differs from PyTorch's (ONNX cast to PyTorch's dtype), with the max error."""
    bad = {}
    for name, ref in torch_out.items():
        got = onnx_out[name].astype(ref.dtype)
        if not np.array_equal(ref, got):
            bad[name] = float(np.abs(ref.astype(np.float64) - got).max())
    return bad


def op_counts(path: Path | str) -> Counter:
    import onnx

    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def feed(x: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """ORT feed of one input ``x`` (graph input ``input``) or of keyword inputs (named after the keywords)."""
    if isinstance(x, dict):
        return {k: v.numpy() for k, v in x.items()}
    return {"input": x.numpy()}


def call(model: nn.Module, x: torch.Tensor | dict[str, torch.Tensor]):
    return model(**x) if isinstance(x, dict) else model(x)


def quantizer_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, np.ndarray]:
    """PyTorch output of every enabled quantizer on ``x``, by module name (first call of each)."""
    outputs: dict[str, np.ndarray] = {}
    names = {m: n for n, m in model.named_modules() if isinstance(m, TensorQuantizer)}

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        outputs.setdefault(names[module], out.detach().numpy())

    handles = [m.register_forward_hook(hook) for m in names if m.is_enabled]
    with torch.no_grad():
        call(model, x)
    for h in handles:
        h.remove()
    return outputs


def _onnx_site_values(
    path: Path | str, x: torch.Tensor | dict[str, torch.Tensor], optimize: bool
) -> tuple[list, dict[str, np.ndarray]]:
    """The Q/DQ sites of the file and ONNX Runtime's value of each site's input and output tensor."""
    import onnx
    import onnxruntime as ort

    from qdq.export import qdq_sites

    model = onnx.load(str(path))
    sites = qdq_sites(model)
    existing = {o.name for o in model.graph.output}
    constants = {t.name for t in model.graph.initializer}
    for name in [t for site in sites for t in (site.input, site.output)]:
        if name not in existing and name not in constants:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            existing.add(name)
    options = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return sites, dict(zip(names, session.run(None, feed(x))))


def onnx_quantizer_outputs(path: Path | str, x: torch.Tensor, optimize: bool = False) -> dict[str, np.ndarray]:
    """ONNX Runtime value of every Q/DQ pair's output, by quantizer name (every merged name listed)."""
    sites, values = _onnx_site_values(path, x, optimize)
    result: dict[str, np.ndarray] = {}
    for site in sites:
        for name in site.quantizers:
            result.setdefault(name, values[site.output])
    return result


def teacher_forced_mismatches(
    model: nn.Module, path: Path | str, x: torch.Tensor | dict[str, torch.Tensor]
) -> dict[str, int]:
    """Each activation Q/DQ pair of the file run by ONNX Runtime (reference kernels) against the PyTorch
    quantizer applied to the *same* input (the one ORT computed): elements that differ, by quantizer name.

    Float ops between quantizers (convolutions) may round differently in ORT and PyTorch, and one value
    that lands on the other side of a rounding boundary moves everything after it; this compares the
    quantizers themselves, whatever happened before them. PyTorch's value is compared in the file's type: a
    float16 DequantizeLinear (TensorRT 11 files) outputs ``q * step`` rounded to float16."""
    sites, values = _onnx_site_values(path, x, optimize=False)
    modules = dict(model.named_modules())
    bad: dict[str, int] = {}
    for site in sites:
        if site.input not in values:  # a weight stored as integers
            continue
        for name in site.quantizers:
            with torch.no_grad():
                expected = modules[name](torch.from_numpy(values[site.input] * site.input_scale)).numpy()
            got = values[site.output]
            wrong = int(np.count_nonzero(expected.astype(got.dtype) != got))
            if wrong:
                bad[name] = wrong
    return bad


def float_segment_errors(
    model: nn.Module, path: Path | str, x: torch.Tensor | dict[str, torch.Tensor]
) -> dict[str, float]:
    """Teacher forcing between every pair of quantizers: each PyTorch quantizer's output is replaced by ONNX
    Runtime's value of the same Q/DQ pair (reference kernels), and each quantizer's PyTorch *input* is compared
    with ORT's: what remains is the float ops between quantizers (matmuls, LayerNorm, Softmax, GELU) run on
    the same quantized values. Max error relative to max |ORT input|, by quantizer name (first call of each).

    Float rounding gives ~1e-6; anything larger is a computation that differs (a wrong rewrite, a missing op).
    """
    sites, values = _onnx_site_values(path, x, optimize=False)
    site_of = {name: site for site in sites for name in site.quantizers if site.input in values}
    names = {m: n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and n in site_of}
    seen: dict[str, np.ndarray] = {}

    def record(module: nn.Module, args: tuple) -> None:
        seen.setdefault(names[module], args[0].detach().numpy().copy())

    def force(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(values[site_of[names[module]].output])

    handles = [m.register_forward_pre_hook(record) for m in names] + [m.register_forward_hook(force) for m in names]
    with torch.no_grad():
        call(model, x)
    for h in handles:
        h.remove()
    errors = {}
    for name, torch_input in seen.items():
        ort_input = values[site_of[name].input] * site_of[name].input_scale  # a folded power-of-two Mul: exact
        errors[name] = float(np.abs(torch_input - ort_input).max() / max(float(np.abs(ort_input).max()), 1e-30))
    return errors

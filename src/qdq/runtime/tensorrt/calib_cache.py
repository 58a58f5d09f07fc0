"""TensorRT calibration caches (implicit quantization, TensorRT <= 10) written from qdq's calibrated ranges.

The TensorRT backend's caches live with it (moved from ``qdq.export.calib_cache``); :mod:`qdq.export` and
:mod:`qdq.runtime` name the four public functions for existing code (``qdq.export.write_calibration_cache``...).

For TensorRT 10 and older only: TensorRT deprecated implicit quantization in 10.1 and TensorRT 11 removed it
(no ``BuilderFlag.INT8``, no ``int8_calibrator``, no calibration cache reader). On TensorRT 11, INT8 exists only
as the Q/DQ nodes of the graph :func:`qdq.export.export_onnx` writes (FP16 elsewhere:
:func:`qdq.targets.tensorrt.float_types.convert_float_precision`), so a cache has no consumer there.

Format (text): a header line ``TRT-<version code>-<algorithm>`` (e.g. ``TRT-8601-EntropyCalibration2``),
then one line per tensor ``<tensor name>: <8 hex digits>`` where the hex digits are the big-endian IEEE-754
float32 of the tensor's **scale** ``amax / 127`` (signed int8; TensorRT's implicit mode is symmetric).

The tensor names are those of an ONNX graph: for each activation quantizer, the float tensor its
``QuantizeLinear`` reads in the graph :func:`qdq.export.export_onnx` wrote. The scales come from the same
walk: an 8-bit signed quantizer's ``DequantizeLinear`` scale is TensorRT's scale, bit for bit (a quantizer
with another grid, unsigned or below 8 bits, is rescaled to ``amax / 127``). Given a mapping
quantizer name -> tensor name instead of a graph, the scales are the quantizers' steps over 127
(:func:`qdq.ops.quant_step` of their effective range). To build an implicit-mode
engine, give TensorRT the same graph without its Q/DQ nodes (:func:`strip_qdq`) and this cache: the tensor
names are the same. Weight quantizers are not written (TensorRT computes weight scales itself).

Comparing explicit (Q/DQ graph) and implicit (float graph + this cache) engines built from the same
calibration answers "is my explicit INT8 engine slower than implicit INT8" with one calibration.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qdq.atomic import write_text_atomic
from qdq.errors import QdqConfigError, QdqExportError, QdqTypeError
from qdq.graphs.ir_graph import remove, source, tidy
from qdq.graphs.onnx import atomic_save, on_ir
from qdq.graphs.onnx_tags import QdqSite, qdq_sites
from qdq.ops import quant_step
from qdq.quantizer import TensorQuantizer

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

__all__ = ["calibration_scales", "read_calibration_cache", "strip_qdq", "write_calibration_cache"]

_SIGNED_MAX = 127  # TensorRT's implicit int8 grid: scale = amax / 127


def _trt_scale(amax: torch.Tensor | float) -> float:
    """TensorRT's scale of a range: ``amax / 127`` in float32."""
    return float(quant_step(torch.as_tensor(amax, dtype=torch.float32), _SIGNED_MAX))


def _activation_quantizers(model: nn.Module) -> dict[str, TensorQuantizer]:
    """Enabled per-tensor quantizers with a stored (or learned) range, by module name."""
    found: dict[str, TensorQuantizer] = {}
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) and module.is_enabled:
            amax = module.effective_amax()
            if amax is not None and amax.numel() == 1:
                found[name] = module
    return found


def _graph_sites(names: str | Path | onnx.ModelProto) -> dict[str, QdqSite]:
    """Quantizer name -> the Q/DQ site of the activation it quantizes in a graph exported by qdq."""
    import onnx

    model = names if isinstance(names, onnx.ModelProto) else onnx.load(str(names), load_external_data=False)
    table: dict[str, QdqSite] = {}
    for site in qdq_sites(model):
        if site.quantize is None or _constant(site.quantize.inputs[0]) or site.step.ndim != 0:
            continue  # a weight, or a per-channel quantizer
        for quantizer in site.quantizers:
            table.setdefault(quantizer, site)
    if not table:
        raise QdqExportError("the ONNX graph has no activation Q/DQ nodes tagged by qdq; export it with export_onnx.")
    return table


def _constant(value: ir.Value | None) -> bool:
    """Is ``value`` an initializer or a ``Constant`` node's tensor (its data not read)?"""
    producer = value.producer() if value is not None else None
    if producer is not None:
        return producer.op_type == "Constant" and "value" in producer.attributes
    return value is not None and value.const_value is not None


_Found = dict[str, tuple[str, float]]  # quantizer name -> (tensor name, TensorRT scale)


def _scales_from_graph(model: nn.Module, sites: dict[str, QdqSite]) -> _Found:
    """Quantizer name -> (tensor, TensorRT scale), read from the graph's DequantizeLinear scales."""
    quantizers = _activation_quantizers(model)
    found: _Found = {}
    for name, site in sites.items():
        q = quantizers.get(name)
        if q is None:
            continue
        if q.maxbound == _SIGNED_MAX:  # the graph's step is TensorRT's scale
            found[name] = (site.input, float(site.step))
        else:  # another grid (unsigned, fewer bits): back to the range, then over 127
            found[name] = (site.input, _trt_scale(torch.tensor(site.step, dtype=torch.float32) * q.maxbound))
    return found


def _scales_from_ranges(source: nn.Module | Mapping[str, Any], tensors: Mapping[str, str]) -> _Found:
    """Quantizer name -> (tensor, TensorRT scale), from the quantizers' ranges or a mapping name -> amax."""
    if isinstance(source, nn.Module):
        # _activation_quantizers keeps the quantizers with a range: effective_amax() is never None here
        ranges = {name: q.effective_amax() for name, q in _activation_quantizers(source).items()}
    elif isinstance(source, Mapping):
        ranges = {str(k): torch.as_tensor(v, dtype=torch.float32).max() for k, v in source.items()}
    else:
        raise QdqTypeError(f"expected a model or a mapping quantizer name -> amax, got {type(source).__name__}.")
    return {str(name): (str(tensor), _trt_scale(ranges[name]))  # type: ignore[arg-type]  # not None: see above
            for name, tensor in tensors.items() if name in ranges}  # fmt: skip


def calibration_scales(
    model_or_amax_map: nn.Module | Mapping[str, Any], onnx_path_or_names: str | Path | Any
) -> dict[str, float]:
    """ONNX tensor name -> TensorRT scale ``amax / 127`` for every calibrated per-tensor activation quantizer.

    Args:
        model_or_amax_map: the calibrated model the graph was exported from, or a mapping quantizer name ->
            amax.
        onnx_path_or_names: the graph (a path or ``onnx.ModelProto``) ``export_onnx`` wrote, or a mapping
            quantizer name -> tensor name. With a model and a graph, the scales are read from the graph.

    Several quantizers of one tensor (e.g. a conv input and a residual input) give one entry with the
    largest range, with a warning when their ranges differ.
    """
    names = onnx_path_or_names
    if isinstance(model_or_amax_map, nn.Module) and not isinstance(names, Mapping):
        found = _scales_from_graph(model_or_amax_map, _graph_sites(names))
    else:
        tensors = names if isinstance(names, Mapping) else {q: s.input for q, s in _graph_sites(names).items()}
        found = _scales_from_ranges(model_or_amax_map, tensors)
    scales: dict[str, float] = {}
    for tensor, scale in found.values():
        if tensor in scales and scales[tensor] != scale:
            warnings.warn(f"tensor {tensor!r} has several ranges; the cache keeps the largest.", stacklevel=2)
        scales[tensor] = max(scale, scales.get(tensor, 0.0))
    if not scales:
        raise QdqConfigError("no calibrated per-tensor activation quantizer matches a tensor of the ONNX graph.")
    return scales


def write_calibration_cache(
    model_or_amax_map: nn.Module | Mapping[str, Any],
    onnx_path_or_names: str | Path | Any,
    path: str | Path,
    *,
    trt_version: int | str = 8601,
    algorithm: str = "EntropyCalibration2",
) -> Path:
    """Write a TensorRT text calibration cache (implicit INT8 mode: TensorRT <= 10; TensorRT 11 reads none).

    Args:
        model_or_amax_map: a calibrated qdq model, or a mapping quantizer name -> amax.
        onnx_path_or_names: the ONNX file (or ``onnx.ModelProto``) written by :func:`export_onnx` for that
            model, or a mapping quantizer name -> ONNX tensor name.
        path: the cache file to write (atomically).
        trt_version: TensorRT's version code in the header (8601 for 8.6.1); set it to the version that
            reads the cache.
        algorithm: calibrator name in the header; TensorRT ignores a cache made for another algorithm.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    scales = calibration_scales(model_or_amax_map, onnx_path_or_names)
    lines = [f"TRT-{trt_version}-{algorithm}"]
    lines += [f"{name}: {struct.pack('>f', scale).hex()}" for name, scale in scales.items()]
    path = Path(path)
    _write_text(path, "\n".join(lines) + "\n")
    return path


def _write_text(path: Path, text: str) -> None:
    write_text_atomic(path, text)


def read_calibration_cache(path: str | Path) -> tuple[str, dict[str, float]]:
    """Parse a text calibration cache: ``(header, {tensor name: scale})``."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or not lines[0].startswith("TRT-"):
        raise QdqConfigError(f"{path} is not a TensorRT calibration cache (no 'TRT-...' header).")
    scales: dict[str, float] = {}
    for line in lines[1:]:
        name, _, hexdigits = line.rpartition(":")
        scales[name.strip()] = struct.unpack("!f", bytes.fromhex(hexdigits.strip()))[0]
    return lines[0], scales


def strip_qdq(source: str | Path | onnx.ModelProto, path: str | Path | None = None) -> onnx.ModelProto:
    """The float graph of a Q/DQ graph: every ``Q -> DQ`` pair removed, tensor names kept.

    Weights that were stored as int8 initializers (``target="onnxruntime"``) stay dequantized through their
    DQ. The result is what TensorRT's implicit mode takes together with :func:`write_calibration_cache`.
    Written to ``path`` when given.
    """
    import onnx

    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
    else:
        model = onnx.load(str(source))
    on_ir(model, _strip)
    if path is not None:
        atomic_save(model, Path(path))
    return model


def _strip(model: ir.Model) -> None:
    """Remove every ``Q -> DQ`` pair: its readers read the Q's input; a graph output keeps its name (an Identity)."""
    import onnx_ir as ir

    graph, doomed = model.graph, []
    for dq in list(graph):
        q = source(dq.inputs[0]) if dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or (x := q.inputs[0]) is None:
            continue
        out = dq.outputs[0]
        if out.is_graph_output():  # the output keeps its name: written by an Identity
            kept = ir.Value(name=out.name, type=out.type, shape=out.shape, doc_string=out.doc_string)
            kept.metadata_props.update(out.metadata_props)
            graph.outputs[graph.outputs.index(out)] = kept
            graph.append(ir.node("Identity", [x], outputs=[kept], name=""))  # unnamed, as before
        out.replace_all_uses_with(x)
        doomed += [q, dq]
    remove(graph, doomed)
    tidy(model)

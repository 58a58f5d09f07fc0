"""TensorRT calibration caches (implicit quantization, TensorRT <= 10) written from qdq's calibrated ranges.

Format (text): a header line ``TRT-<version code>-<algorithm>`` (e.g. ``TRT-8601-EntropyCalibration2``),
then one line per tensor ``<tensor name>: <8 hex digits>`` where the hex digits are the big-endian IEEE-754
float32 of the tensor's **scale** ``amax / 127`` (signed int8; TensorRT's implicit mode is symmetric).

The tensor names are those of an ONNX graph: for each activation quantizer, the float tensor its
``QuantizeLinear`` reads in the graph :func:`qdq.export.export_onnx` wrote. To build an implicit-mode
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
from qdq.export.graph import atomic_save, initializer_map, qdq_sites, tidy
from qdq.quantizer import TensorQuantizer

if TYPE_CHECKING:
    import onnx

__all__ = ["calibration_scales", "read_calibration_cache", "strip_qdq", "write_calibration_cache"]

_SIGNED_MAX = 127


def _quantizer_amax(q: TensorQuantizer) -> torch.Tensor | None:
    if q._learn_amax:
        return torch.maximum(-q.clip.clip_value_min, q.clip.clip_value_max).detach().float()
    if q.amax is None:
        return None
    amax = q.amax.detach().float()
    return amax * q.scale_amax if q.scale_amax is not None else amax


def _amax_map(source: nn.Module | Mapping[str, Any]) -> dict[str, float]:
    """Quantizer name -> per-tensor amax, from a model (its calibrated quantizers) or a mapping."""
    if isinstance(source, nn.Module):
        found: dict[str, float] = {}
        for name, module in source.named_modules():
            if isinstance(module, TensorQuantizer) and module.is_enabled:
                amax = _quantizer_amax(module)
                if amax is not None and amax.numel() == 1:
                    found[name] = float(amax)
        return found
    if isinstance(source, Mapping):
        return {str(k): float(torch.as_tensor(v).float().max()) for k, v in source.items()}
    raise QdqTypeError(f"expected a model or a mapping quantizer name -> amax, got {type(source).__name__}.")


def _tensor_names(names: str | Path | onnx.ModelProto | Mapping[str, str]) -> dict[str, str]:
    """Quantizer name -> ONNX tensor name of the activation it quantizes."""
    if isinstance(names, Mapping):
        return {str(k): str(v) for k, v in names.items()}
    import onnx

    model = names if isinstance(names, onnx.ModelProto) else onnx.load(str(names), load_external_data=False)
    constants = initializer_map(model)
    table: dict[str, str] = {}
    for site in qdq_sites(model):
        if site.quantize is None or site.input in constants:
            continue  # a weight
        for quantizer in site.quantizers:
            table.setdefault(quantizer, site.input)
    if not table:
        raise QdqExportError("the ONNX graph has no activation Q/DQ nodes tagged by qdq; export it with export_onnx.")
    return table


def calibration_scales(
    model_or_amax_map: nn.Module | Mapping[str, Any], onnx_path_or_names: str | Path | Any
) -> dict[str, float]:
    """ONNX tensor name -> TensorRT scale ``amax / 127`` for every calibrated activation quantizer.

    Several quantizers of one tensor (e.g. a conv input and a residual input) give one entry with the
    largest range, with a warning when their ranges differ.
    """
    amax = _amax_map(model_or_amax_map)
    tensors = _tensor_names(onnx_path_or_names)
    scales: dict[str, float] = {}
    for quantizer, tensor in tensors.items():
        if quantizer not in amax:
            continue
        scale = float(torch.tensor(amax[quantizer], dtype=torch.float32) / _SIGNED_MAX)
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
    """Write a TensorRT text calibration cache.

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

    model = onnx.ModelProto()
    model.CopyFrom(source if isinstance(source, onnx.ModelProto) else onnx.load(str(source)))
    producers = {out: node for node in model.graph.node for out in node.output}
    doomed, rename = set(), {}
    for dq in model.graph.node:
        q = producers.get(dq.input[0]) if dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            rename[dq.output[0]] = q.input[0]
            doomed |= {id(q), id(dq)}
    kept = [n for n in model.graph.node if id(n) not in doomed]
    graph_outputs = {o.name for o in model.graph.output}
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    for old, new in rename.items():
        if old in graph_outputs:  # keep the output's name: an Identity
            kept.append(onnx.helper.make_node("Identity", [new], [old]))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    tidy(model)
    if path is not None:
        atomic_save(model, Path(path))
    return model

"""The ``"tensorrt"`` target's ONNX rewrite: the exported Q/DQ graph checked for TensorRT, and, for TensorRT 11,
its float part written in FP16/BF16.

The graph is exported as the model quantizes (Q/DQ at its quantizers, signed int8, zero point 0). Before the
file is written, :func:`rewrite_for_tensorrt`:

1. refuses a graph TensorRT cannot build as qdq exported it: unsigned (uint8) quantizers, which TensorRT does
   not have, and a model that computes in float16/bfloat16 itself (``model.half()``), whose export puts a Cast
   between each DequantizeLinear and its op — each error names the quantizers or nodes and what to do;
2. gives a residual Add that TensorRT would run in float (its skip input not quantized: a front end that saw the
   add only as part of a layer of the model's own) the quantizer its skip tensor already has for its other readers
   (rule ``residual-add``; logged);
3. warns, once, about Conv/Gemm/MatMul nodes with one input quantized and the other float (a disabled input
   quantizer next to an enabled weight quantizer): TensorRT runs them in float, and ``qdq check`` reports them;
4. with ``float="float16"`` (or ``"bfloat16"``), converts the float part (:mod:`.float_types`): INT8 where the
   model quantizes, FP16 everywhere else, nodes kept in FP32 where the calibration data shows values the low
   type cannot hold. What was done is logged once, recorded in the file (``qdq.float``,
   ``qdq.float.fp32_nodes``, ``qdq.float.report``; :func:`~.float_types.read_float_record`), and what needs
   the user's attention is warned once (ranges not measured; steps the conversion had to round).

Options (``export_onnx(..., target_options={...})``, or recorded on the model by
``QuantConfig(target="tensorrt", target_options={...})``): ``float``, ``calibration_data``, ``keep_io_types``,
``data_max``. Adding a check or a pass: a function of the graph called from :func:`rewrite_for_tensorrt` at its
place in the order.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from qdq.errors import QdqExportError
from qdq.graphs.onnx import on_ir
from qdq.graphs.onnx_tags import quantizer_names
from qdq.graphs.onnx_types import parse_float_type
from qdq.targets.tensorrt.engine_rules.facts import LAYOUT, GraphFacts
from qdq.targets.tensorrt.engine_rules.fusion import casts_after_dqs, partly_quantized_ops, residual_repairs
from qdq.targets.tensorrt.engine_rules.qdq_nodes import uint8_nodes
from qdq.targets.tensorrt.float_ranges import Batch
from qdq.targets.tensorrt.float_types import FloatConversion, convert_in_place

__all__ = ["DEFAULT_FLOAT", "rewrite_for_tensorrt", "step_type"]

_log = logging.getLogger(__name__)
#: the float type of a tensorrt export that does not choose one: float32, bit-exact with the PyTorch model and
#: run by every runtime (TensorRT 10 with --fp16, ONNX Runtime, OpenVINO)
DEFAULT_FLOAT = "float32"
_SHOWN = 5


def rewrite_for_tensorrt(
    model: Any,
    *,
    float: str = DEFAULT_FLOAT,  # the option's public name: target_options={"float": "float16"}
    calibration_data: Iterable[Batch] | None = None,
    keep_io_types: bool = True,
    data_max: float = 512.0,
) -> dict[str, int]:
    """Check ``model`` (an exported Q/DQ graph, edited in place) for TensorRT and write its float part in ``float``.

    Args:
        model: the ``onnx.ModelProto`` of the export.
        float: the type everything not quantized computes in: ``"float32"`` (default), ``"float16"`` /
            ``"fp16"`` or ``"bfloat16"`` / ``"bf16"`` (TensorRT 11 builds FP16/BF16 only where the file says so).
        calibration_data: input batches to measure value ranges on (arrays or CPU tensors, tuples of them for
            several inputs, or dicts input name -> array; a few batches suffice): nodes whose values exceed
            ``data_max`` or are all subnormal in the low type stay FP32. Without it only the op-type rules apply
            (warned).
        keep_io_types: keep the graph's inputs and outputs float32 (Casts at the edges); False makes them
            the low type too.
        data_max: the largest absolute value a node's inputs and outputs may reach to compute in the low type
            (512, ModelOpt AutoCast's default).

    Returns:
        Counts: ``low_precision_nodes``, ``fp32_nodes``, ``casts``, ``int8_weights``,
        ``residual_inputs_quantized`` (logged) and ``partly_quantized_ops`` (warned).

    Raises:
        QdqExportError: unsigned quantizers, or a model computing in float16/bfloat16 (see the module doc).
        QdqConfigError: an unknown float type, or calibration data that does not match the graph's inputs.
    """
    kind = parse_float_type(float)
    facts = GraphFacts.of(model, ())
    _refuse_unsigned(facts)
    _refuse_low_precision_model(facts)
    residuals = _quantize_residuals(model, facts)
    if residuals:
        facts = GraphFacts.of(model, ())
    partial = _warn_partly_quantized(facts)
    counts = {"partly_quantized_ops": partial, "residual_inputs_quantized": residuals}
    if kind == "float32":
        return counts
    conversion = convert_in_place(model, kind, calibration_data=calibration_data, keep_io_types=keep_io_types,
                                  data_max=data_max)  # fmt: skip
    _report(conversion)
    return {**counts, "low_precision_nodes": conversion.converted, "fp32_nodes": len(conversion.fp32_nodes),
            "casts": conversion.casts, "int8_weights": conversion.folded_weights}  # fmt: skip


def step_type(options: Mapping[str, Any]) -> str:
    """The float type the steps of a tensorrt export with these options are numbers of (its ``float``): the
    type of every DequantizeLinear scale that feeds the float part."""
    return parse_float_type(options.get("float", DEFAULT_FLOAT))


def _owners(nodes: Iterable[Any]) -> list[str]:
    names: dict[str, None] = {}
    for node in nodes:
        for name in quantizer_names(node) or [node.name or node.outputs[0].name]:
            names[name] = None
    return list(names)


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _refuse_unsigned(f: GraphFacts) -> None:
    owners = _owners(uint8_nodes(f))
    if owners:
        raise QdqExportError(
            f"TensorRT quantizes to signed int8 only, and {len(owners)} quantizer(s) of this model are unsigned "
            f"(uint8): {_listed(owners)}. Quantize them signed (QuantDescriptor(unsigned=False), the default), "
            "or export for target 'onnxruntime', which runs uint8."
        )


def _refuse_low_precision_model(f: GraphFacts) -> None:
    found = casts_after_dqs(f)
    if found:
        ops = _listed([f.name(node) for node, *_ in found])
        raise QdqExportError(
            "this model computes in a low-precision type (model.half() or .to(torch.bfloat16)): its export puts a "
            f"Cast between each DequantizeLinear and its op ({ops}), which TensorRT cannot fuse. Export the "
            "float32 model (model.float(), example input in float32) with target_options={'float': 'float16'} "
            "(or 'bfloat16'): the file then computes in that type everywhere outside its int8 ops."
        )


def _quantize_residuals(model: Any, facts: GraphFacts) -> int:
    """Each residual Add with no dequantized input reads the DQ its skip tensor already has
    (:func:`~.engine_rules.fusion.residual_repairs`), ``model`` edited in place; how many were."""
    if not residual_repairs(facts):
        return 0
    from onnx_ir.passes.common import TopologicalSortPass

    def edit(ir_model: Any) -> list[str]:
        found = residual_repairs(GraphFacts(ir_model.graph, facts.types, facts.opset, frozenset(), {}))
        for add, index, dequantized in found:
            add.replace_input_with(index, dequantized)
        TopologicalSortPass()(ir_model)  # the DQ may stand after the Add in the node list
        return [facts.name(add) for add, *_ in found]

    adds = on_ir(model, edit)[0]
    _log.info("%d residual Add(s) now read the quantizer their skip input has for its other readers, as TensorRT "
              "fuses them (rule residual-add): %s", len(adds), _listed(adds))  # fmt: skip
    return len(adds)


def _warn_partly_quantized(f: GraphFacts) -> int:
    found = partly_quantized_ops(f)
    if not found:
        return 0
    described = []
    for node, float_input in found:
        other = f.quantized_source(node.inputs[1 - float_input], LAYOUT | {"Cast", "CastLike"})[0]
        owners = quantizer_names(other) if other is not None else []
        described.append(f"{f.name(node)} ({', '.join(owners) or 'quantized'}; input {float_input} float)")
    warnings.warn(
        f"{len(found)} Conv/Gemm/MatMul node(s) have one input quantized and the other float: "
        f"{_listed(described)}. TensorRT runs them in float, and `qdq check` and qdq's TensorRT backend report "
        "them (rule weighted-op-inputs). Keep such a layer float on purpose with qdq.keep_float(model, [layer]) "
        "(its weights too), or enable and calibrate its other quantizer.",
        stacklevel=4,
    )
    return len(found)


def _report(conversion: FloatConversion) -> None:
    """The conversion logged once (a warning when nodes stay FP32: TensorRT runs them so); what needs the
    user's action warned once."""
    _log.log(logging.WARNING if conversion.fp32_nodes else logging.INFO, "%s", conversion)
    notes = []
    if not conversion.measured:
        notes.append(
            "value ranges were not measured, so no node was kept in FP32 for overflowing float16: pass "
            "target_options={'calibration_data': batches} (a few input batches)"
        )
    if conversion.largest_step_change > 0:
        notes.append(
            f"{len(conversion.scale_changes)} quantizers' steps were rounded to {conversion.float_type} (largest "
            f"relative change {conversion.largest_step_change:.1e}), so the PyTorch model quantizes on a slightly "
            f"different grid than the file: quantize with qdq.QuantConfig(target='tensorrt', "
            f"target_options={{'float': '{conversion.float_type}'}}) for steps that are {conversion.float_type} "
            "numbers from the start"
        )
    if notes:
        warnings.warn(f"{conversion.float_type} export: " + "; ".join(notes) + ".", stacklevel=4)

"""An FP32 ONNX file as the ONNX front end takes it: loaded, checked, and prepared for placement.

:func:`load_float_model` reads a path (external data included, so files over 2 GB load) or takes a
``ModelProto``, and refuses, with one clear error, what cannot be quantized again: a file that already holds Q/DQ
or QOperator nodes. :func:`prepare` then makes the graph the view reads, with onnx_ir and onnxscript where they
ship the edit:

* onnx_ir's passes: initializers listed among the graph inputs (IR version 3) are constants, not inputs (IR version
  4); ``Constant`` weights (Paddle2ONNX's) become initializers, those of subgraphs the main graph's: a weight is a
  constant input of its op wherever the op is;
* a ``BatchNormalization`` after a ``Conv`` is folded into it, as every runtime folds it, and so is a constant scale
  and shift (else float ops between the conv's int8 output and its reader); a written-out hard-swish becomes one
  ``HardSwish`` (opset 14), two ORT ops instead of four, its input read once: onnxscript rewriter rules
  (:mod:`qdq.onnx_in.folds`).

What no library does stays here: node names and unique tensor names (:func:`~qdq.graphs.onnx.name_nodes`,
:func:`~qdq.graphs.onnx.unique_value_names`: ``keep_float`` and the reports use them; onnx_ir's ``NameFixPass``
names by a scheme of its own); the opset raised to 13 when lower (per-channel ``DequantizeLinear`` needs an
``axis``) by ONNX's version converter, onnx_ir having none; each op that only moves data and reads constants alone,
in the main graph or an ``If`` branch, folded into its result (silero-vad slices its LSTM weights at run time;
onnxscript's constant folder also rewrites shapes, identities and reshapes whatever it is told, and folds no op of
several outputs such as ``Split``); an ``Identity`` of an initializer (TorchScript's shared constants) bypassed
(:func:`~qdq.graphs.ir_graph.tidy`); shapes inferred where ONNX can (dynamic axes stay symbolic), and a graph output
declared with a rank the graph does not compute written with the computed shape (``output_shapes``: strict shape
inference, which ``onnx.checker`` runs on every file qdq writes, refuses such a declaration).

The branches of ``If`` nodes are part of the graph (:mod:`qdq.onnx_in.subgraphs`). ``Loop`` / ``Scan`` bodies and
operators of custom domains are left as they are: the view sees them as ops no rule knows, so they stay float,
and the report lists them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from qdq.errors import QdqConfigError
from qdq.graphs.ir_graph import tidy
from qdq.graphs.onnx import (
    all_nodes,
    clear_output_shapes,
    name_nodes,
    on_ir,
    restore_output_shapes,
    unique_value_names,
)
from qdq.onnx_in.subgraphs import branch_graphs, if_branches

__all__ = ["QUANTIZED_OPS", "load_float_model", "prepare"]

#: ops that mean a graph is quantized already (Q/DQ, or ONNX Runtime's QOperator form)
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                           "QLinearMatMul", "ConvInteger", "MatMulInteger", "QGemm", "QLinearAdd", "QLinearMul",
                           "QLinearConcat", "QLinearSigmoid", "QAttention", "DynamicQuantizeMatMul"})  # fmt: skip
_MIN_OPSET = 13
_HARD_SWISH_OPSET = 14


def load_float_model(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """The model at ``model`` (with its external data) or ``model`` itself (a copy), checked to be float, without
    the metadata qdq's export wrote into it (``qdq.*``: the target and weight encoding of that export, which the
    quantized file must not inherit: a ``qdq.weights`` record of an FP32 export would tell the runtimes its int8
    weights were stored as uint8).

    Raises:
        QdqConfigError: no such file, not an ONNX file, or a graph that already holds quantized nodes.
    """
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        path = Path(model)
        if not path.is_file():
            raise QdqConfigError(f"no ONNX file at {path}: give the path of the FP32 model to quantize.")
        try:
            proto = onnx.load(str(path), load_external_data=True)
        except Exception as err:  # protobuf's DecodeError and friends
            raise QdqConfigError(f"{path} is not an ONNX model ({type(err).__name__}: {err}).") from err
    found = Counter(n.op_type for n in all_nodes(proto.graph) if n.op_type in QUANTIZED_OPS)
    if found:
        listed = ", ".join(f"{count} {op}" for op, count in found.most_common())
        raise QdqConfigError(
            f"this ONNX model is quantized already: it holds {listed}. quantize_onnx takes the FP32 model: "
            "give the file before quantization (quantizing twice would stack a second grid on the first)."
        )
    kept = [prop for prop in proto.metadata_props if not prop.key.startswith("qdq.")]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    return proto


def prepare(model: onnx.ModelProto) -> dict[str, int]:
    """Prepare ``model`` in place for placement (module doc); counts of what was changed."""
    from onnx_ir.passes.common import (
        LiftConstantsToInitializersPass,
        LiftSubgraphInitializersToMainGraphPass,
        RemoveInitializersFromInputsPass,  # fmt: skip
    )

    from qdq.onnx_in import folds

    opset, graph = _opset(model), model.graph
    counts = {"initializer_inputs": len(graph.input), "named_nodes": name_nodes(model), "renamed_tensors": 0,
              "constant_weights": _constant_nodes(graph)}  # fmt: skip
    initializers = len(graph.initializer)
    counts["renamed_tensors"] = on_ir(model, unique_value_names, RemoveInitializersFromInputsPass(),
                                      LiftConstantsToInitializersPass(size_limit=0),
                                      LiftSubgraphInitializersToMainGraphPass())[0]  # fmt: skip
    model.ir_version = max(model.ir_version, 4)  # the first without initializers among the inputs
    counts["initializer_inputs"] -= len(model.graph.input)
    counts["constant_weights"] -= _constant_nodes(model.graph)
    counts["branch_constants"] = len(model.graph.initializer) - initializers - counts["constant_weights"]
    counts["opset"] = _raise_opset(model)
    now = [folds.HARD_SWISHES] if (_opset(model) or 0) >= _HARD_SWISH_OPSET else []  # else: _fuse_hard_swishes
    rules = (rules.apply_to_model for rules in (folds.BATCHNORMS, *folds.SCALE_SHIFTS, *now))
    # tidy: TorchScript's shared constants behind an Identity bypassed
    counts["constants_folded"], _, *found = on_ir(model, _fold_constant_moves, tidy, *rules)
    counts["batchnorms_folded"], counts["scale_shifts_folded"] = found[0], 2 * found[1] + found[2]
    counts["hard_swishes"] = found[3] if now else _fuse_hard_swishes(model)
    if _opset(model) != opset:
        counts["opset"] = _opset(model) or 0
    declared = clear_output_shapes(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        pairs = zip([model.graph, *(g for _, g in if_branches(model.graph))],
                    [inferred.graph, *(g for _, g in if_branches(inferred.graph))], strict=True)  # fmt: skip
        for mine, theirs in pairs:
            del mine.value_info[:]
            mine.value_info.extend(theirs.value_info)
    except Exception:  # shape inference is a convenience: a model it cannot read still quantizes
        counts["shapes_unknown"], inferred = 1, None
    counts["output_shapes"] = restore_output_shapes(model, declared, inferred)
    return counts


def _constant_nodes(graph: onnx.GraphProto) -> int:
    return sum(node.op_type == "Constant" for node in graph.node)


#: ops that only move, select or retype data: one whose inputs are all constants is folded into its result
_MOVES = frozenset({"Slice", "Concat", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast",
                    "Gather", "Split"})  # fmt: skip


def _fold_constant_moves(model: ir.Model) -> int:
    """Each op that only moves data (:data:`_MOVES`) and reads constants alone, in the main graph or an ``If``
    branch, becomes its result, an initializer of the main graph under the same name (silero-vad slices and
    concatenates its LSTM weights at run time): a weight computed so is a constant, not an activation to calibrate.
    Never a result larger than its inputs. Returns how many ops were folded."""
    main, folded, found = model.graph, 0, True
    while found:
        found = False
        for graph in reversed([main, *branch_graphs(main)]):  # inner graphs first
            for node in [n for n in graph if _foldable(n)]:
                values = {str(v.name): v.const_value.numpy() for v in node.inputs if v is not None and v.const_value}
                results = _evaluate(node, values, model.opset_imports)
                if results is None or sum(r.size for r in results) > sum(v.size for v in values.values()):
                    continue
                for output, result in zip(node.outputs, results, strict=True):
                    constant = ir.Value(name=output.name, const_value=ir.tensor(np.asarray(result), name=output.name))
                    output.replace_all_uses_with(constant, replace_graph_outputs=True)
                    main.register_initializer(constant)
                graph.remove(node, safe=True)
                folded, found = folded + 1, True
    return folded


def _foldable(node: ir.Node) -> bool:
    present = [value for value in node.inputs if value is not None]
    return node.op_type in _MOVES and node.domain in ("", "ai.onnx") and bool(present) and all(
        value.is_initializer() and value.const_value is not None for value in present)  # fmt: skip


def _evaluate(node: ir.Node, values: dict[str, np.ndarray], opsets: Mapping[str, int]) -> list[np.ndarray] | None:
    """``node``'s outputs on ``values`` (ONNX's reference evaluator), or None when it cannot compute them."""
    from onnx.reference import ReferenceEvaluator

    inputs = [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype),
                                                 value.shape) for name, value in values.items()]  # fmt: skip
    outputs = [onnx.ValueInfoProto(name=value.name) for value in node.outputs]
    graph = onnx.helper.make_graph([ir.serde.serialize_node(node)], "fold", inputs, outputs)
    imports = [onnx.helper.make_opsetid(domain, version) for domain, version in opsets.items()]
    try:
        return list(ReferenceEvaluator(onnx.helper.make_model(graph, opset_imports=imports)).run(None, values))
    except Exception:  # an op the evaluator cannot run stays in the graph
        return None


def _opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain opset (None when it imports none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _raise_opset(model: onnx.ModelProto, minimum: int = _MIN_OPSET) -> int:
    """Raise the default-domain opset to ``minimum`` when lower (per-channel Q/DQ need 13); the new opset, else 0."""
    current = _opset(model)
    if current is None or current >= minimum:
        return 0
    converted = onnx.version_converter.convert_version(model, minimum)
    converted.ir_version = max(converted.ir_version, onnx.helper.find_min_ir_version_for(list(converted.opset_import)))
    model.CopyFrom(converted)
    return minimum


def _fuse_hard_swishes(model: onnx.ModelProto) -> int:
    """Every written-out hard-swish of a model of an opset below 14 becomes one ``HardSwish`` node (an opset-14 op),
    the model converted first when it has one to fuse (a model ONNX's converter cannot take keeps them); how many."""
    import onnx_ir

    from qdq.onnx_in import folds

    if _opset(model) is None or not folds.HARD_SWISHES.apply_to_model(onnx_ir.serde.deserialize_model(model)):
        return 0
    try:
        _raise_opset(model, _HARD_SWISH_OPSET)
    except Exception:  # the converter's errors are its own
        return 0
    return int(on_ir(model, folds.HARD_SWISHES.apply_to_model)[0])

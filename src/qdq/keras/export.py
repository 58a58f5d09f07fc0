"""Export of a quantized Keras model to a Q/DQ ONNX graph, for the same targets as the PyTorch path.

``export_onnx(qmodel, example, "model.onnx", target="tensorrt")`` (the PyTorch path's arguments):

1. folds BatchNormalization into the quantized convs (:mod:`qdq.keras.fold`);
2. converts with tf2onnx (``from_keras``, the target's opset, else 13) without its ``q_dq_optimizer`` and
   ``const_dequantize_optimizer``, so every QuantizeLinear is directly followed by its DequantizeLinear
   (what TensorRT's explicit quantization needs; NVIDIA's toolkit does the same);
3. puts the layout ops tf2onnx writes on the Q/DQ paths out of the way, exactly: a weight's
   ``Q -> DQ -> Reshape/Transpose -> Conv`` becomes one per-channel ``Q -> DQ -> Conv`` on the reshaped
   kernel, and an activation's ``Q -> DQ -> Transpose`` (or ``Reshape``, which tf2onnx writes for a
   transpose of 1x1 feature maps) becomes ``Transpose -> Q -> DQ`` (per-tensor Q/DQ commutes with both);
4. drops Reshapes that leave their input's shape unchanged (tf2onnx writes them for transposes of 1x1
   feature maps; between a Conv and its Q/DQ they would keep ONNX Runtime from fusing the Conv);
5. finishes like every qdq export (:func:`qdq.export.onnx_export.finish_onnx`): ``input``/``output``
   names, the target's rewrite (``"onnxruntime"``: int8 kernels of ONNX Runtime's CPU provider),
   ``onnx.checker``, an atomic write.

The ONNX model takes the Keras layout (NHWC images).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qdq.errors import QdqExportError
from qdq.graphs.ir_graph import add_const, attr, const_input, fresh_name, inferred_dims, remove, single_reader, source
from qdq.graphs.onnx import on_ir
from qdq.keras._backend import keras, tf, tf2onnx
from qdq.keras.graph import check_graph_model
from qdq.targets import Target, export_target
from qdq.targets.marks import placed_target
from qdq.targets.onnxruntime.passes.float_convs import float_convs_said

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["export_float_onnx", "export_onnx"]

_DROPPED_OPTIMIZERS = ("q_dq_optimizer", "const_dequantize_optimizer")
_DEFAULT_OPSET = 13  # tf2onnx's opset when the target names none
_LAYOUT_OPS = frozenset({"Reshape", "Transpose"})


def export_onnx(
    model: Any,
    example_input: Any = None,
    path: str | Path | None = None,
    target: str | Target | None = None,
    opset: int | None = None,
    *,
    fold_bn: bool = True,
    target_options: Mapping[str, Any] | None = None,
) -> Path:
    """Write the quantized Keras ``model`` as a Q/DQ ONNX file for ``target``: the PyTorch path's
    :func:`qdq.export.export_onnx`, argument for argument.

    Args:
        model: a model from :func:`qdq.keras.quantize_model`, calibrated (:func:`qdq.keras.calibrate`).
        example_input: a batch (one array, or a list of arrays for several inputs), checked against the
            model's inputs before converting; None: the model's own input signature alone. The batch axis
            stays symbolic either way.
        path: the ``.onnx`` file (replaced atomically).
        target: a registered target (:mod:`qdq.targets`). None (default): the target the model was quantized
            for (``quantize_model(target=...)``), else ``"tensorrt"``.
        opset: ONNX opset, >= 13 (per-channel scales); None: the target's default, else 13.
        fold_bn: fold BatchNormalization into the quantized convs first (recommended).
        target_options: options of the target's ONNX rewrite, as in :func:`qdq.export.export_onnx`
            (``"onnxruntime"``: ``{"weights": "auto" | "int8" | "uint8"}``).

    ``export_onnx(model, path, ...)`` (the path second, qdq 0.1's order) still works and warns.

    Raises:
        QdqExportError: an uncalibrated quantized input, an opset below 13, a target other than the one the
            model was quantized for, an example that does not fit the model's inputs, or a failed conversion.
    """
    from qdq.export.onnx_export import finish_onnx
    from qdq.keras.fold import fold_batchnorms

    example_input, path = _legacy_order(example_input, path)
    check_graph_model(model, "export_onnx")
    chosen = export_target(model, target)
    opset = (chosen.export.opset or _DEFAULT_OPSET) if opset is None else opset
    if opset < 13:
        raise QdqExportError(f"per-channel Q/DQ needs ONNX opset >= 13, got opset={opset}.")
    _check_example(model, example_input)
    _check_calibrated(model)
    exported = fold_batchnorms(model) if fold_bn else model
    proto = _convert(exported, opset)
    on_ir(proto, _weights_through_layout, _drop_identity_reshapes, _layout_before_q)
    placed = placed_target(model) == chosen.name
    with float_convs_said(_placed_float_convs) if placed else contextlib.nullcontext():
        return finish_onnx(proto, path, chosen, opset=opset, target_options=target_options)


def _placed_float_convs(convs: list[str]) -> str:
    """Why Convs stay float on ONNX Runtime in a model quantized for it (the rewrite's own advice is to do that)."""
    return (
        f"{len(convs)} Conv(s) will run in float on ONNX Runtime (e.g. {convs[0]}): their output has no quantizer. "
        "The model was quantized for this target, so its placement left them float: what reads their output is "
        "an op the rules do not quantize (a squeeze-excite gate's `x + 3.0`, for one), or a layer was bypassed."
    )


def export_float_onnx(model: Any, path: str | Path, target: str | Target) -> Path:
    """The float Keras ``model`` (no quantize wrapper) as the FP32 ONNX file of the quantized files made for
    ``target``: the PyTorch path's :func:`qdq.export.export_float_onnx` (the same target, the same silence about
    Convs running in float)."""
    from qdq.export.onnx_export import float_graph_export

    with float_graph_export():
        return export_onnx(model, None, path, target=target)


def _legacy_order(example_input: Any, path: Any) -> tuple[Any, Path]:
    """``(example, path)``, accepting the path in the example's place when no path is given."""
    if path is None and isinstance(example_input, str | os.PathLike):
        warnings.warn(
            "qdq.keras.export_onnx(model, path) is the old argument order; write "
            "export_onnx(model, example_input_or_None, path), as qdq.export.export_onnx takes them.",
            DeprecationWarning,
            stacklevel=3,
        )
        return None, Path(example_input)
    if path is None:
        raise QdqExportError("export_onnx needs the .onnx file to write: export_onnx(model, example, path).")
    return example_input, Path(path)


def _check_example(model: Any, example: Any) -> None:
    """One clear error when ``example`` does not fit the model's inputs (their count and non-batch shapes)."""
    if example is None:
        return
    arrays = list(example) if isinstance(example, list | tuple) else [example]
    if len(arrays) != len(model.inputs):
        raise QdqExportError(f"the example has {len(arrays)} input(s); model {model.name!r} takes {len(model.inputs)}.")
    for array, tensor in zip(arrays, model.inputs):
        shape, wanted = tuple(np.shape(array))[1:], tuple(tensor.shape)[1:]
        if len(shape) != len(wanted) or any(w is not None and w != d for w, d in zip(wanted, shape)):
            raise QdqExportError(
                f"an example input of shape {np.shape(array)} does not fit model {model.name!r}'s input "
                f"{tensor.name!r} of shape {tuple(tensor.shape)} (the first axis is the batch)."
            )


def _check_calibrated(model: Any) -> None:
    from qdq.keras.wrappers import wrappers_of

    missing = [w.name for w in wrappers_of(model) if w.input_amax and not w.calibrated]
    if missing:
        raise QdqExportError(
            f"{len(missing)} quantized layer(s) have no calibrated input range (first: {missing[0]!r}); an "
            "export needs static ranges. Run qdq.keras.calibrate(model, data) first."
        )


def _scalar_adds_optimizer(converter: Any) -> type:
    """A tf2onnx optimizer, run before its own, that gives the 0-d constant of an ``Add`` to a tensor (``x + 3.0``:
    MobileNetV3's ``hard_sigmoid``) the shape ``[1]``, the same sum. tf2onnx's transpose optimizer reads the shape of
    such a constant after a Conv with ``max(shape)``, fails on ``()``, and then leaves every NHWC Transpose of the
    graph in place, between each Conv and its quantizer: nothing fuses."""
    from tf2onnx.optimizer.optimizer_base import GraphOptimizerBase

    class ScalarAdds(GraphOptimizerBase):
        def _optimize(self, graph: Any) -> Any:
            for node in graph.get_nodes():
                shape = graph.get_shape(node.input[0]) if node.type == "Add" else None
                if not shape or not node.inputs[1].is_const():
                    continue
                value = node.inputs[1].get_tensor_value(as_list=False)
                if value.ndim == 0:
                    constant = graph.make_const(converter.utils.make_name("scalar"), value.reshape(1))
                    graph.replace_input(node, node.input[1], constant.output[0], 1)
            return graph

    return ScalarAdds


@contextlib.contextmanager
def _grouped_convs_traced_plain() -> Any:
    """While tf2onnx traces the model, Keras writes a grouped convolution (``Conv2D(groups=g)``, ConvNeXt's
    depthwise convs) as the plain TensorFlow op, which tf2onnx converts to one ``Conv`` with ``group``.

    Keras's TensorFlow backend wraps that op in ``tf.function(jit_compile=True)`` because TensorFlow's CPU kernel
    lacks grouped convolutions; tf2onnx cannot inline an XLA-compiled function and leaves a
    ``StatefulPartitionedCall`` no ONNX runtime knows. The traced graph is converted, never run, so the plain op
    is exact. Keras's function is restored on exit; a Keras without it is left alone."""
    try:
        import keras.src.backend.tensorflow.nn as keras_tf_nn  # the backend module ``keras.ops.conv`` dispatches to
    except ImportError:  # a Keras that moved it: its own conv, as it writes it
        keras_tf_nn = None
    keras_conv = getattr(keras_tf_nn, "conv", None)
    if keras_conv is None:
        yield
        return

    def conv(inputs: Any, kernel: Any, strides: Any = 1, padding: str = "valid", data_format: Any = None,
             dilation_rate: Any = 1) -> Any:  # fmt: skip
        channels_last = (data_format or keras().config.image_data_format()) == "channels_last"
        if len(inputs.shape) != 4 or not channels_last or inputs.shape[-1] == kernel.shape[-2]:
            return keras_conv(inputs, kernel, strides, padding, data_format, dilation_rate)
        return tf().nn.convolution(inputs, kernel, strides, padding.upper(), data_format="NHWC",
                                   dilations=dilation_rate)  # fmt: skip

    keras_tf_nn.conv = conv
    try:
        yield
    finally:
        keras_tf_nn.conv = keras_conv


def _erfc(ctx: Any, node: Any, name: str, args: Any) -> None:
    """tf2onnx's handler of TensorFlow's ``Erfc``, which tf2onnx lacks (Keras's exact GELU writes
    ``0.5 * x * erfc(-x / sqrt(2))``): ``1 - Erf(x)``, the form PyTorch's GELU exports with."""
    from tf2onnx import utils

    node.type = "Erf"
    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.output[0]))
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.ones([1], dtype))
    ctx.insert_new_node_on_output("Sub", node.output[0], inputs=[one.output[0], node.output[0]],
                                  name=utils.make_name(f"{name}_one_minus"))  # fmt: skip


def _convert(model: Any, opset: int) -> Any:
    converter = tf2onnx()
    t = tf()
    optimizers = {k: v for k, v in converter.optimizer._optimizers.items() if k not in _DROPPED_OPTIMIZERS}
    optimizers = {"qdq_scalar_adds": _scalar_adds_optimizer(converter), **optimizers}
    signature = [
        t.TensorSpec((None, *tensor.shape[1:]), tensor.dtype, name=f"input_{i}")
        for i, tensor in enumerate(model.inputs)
    ]
    try:
        with _grouped_convs_traced_plain():
            proto, _ = converter.convert.from_keras(
                model,
                input_signature=signature,
                opset=opset,
                optimizers=optimizers,
                custom_op_handlers={"Erfc": (_erfc, [])},
            )
    except Exception as err:  # tf2onnx raises many types; one clear error with the cause attached
        raise QdqExportError(f"tf2onnx could not convert model {model.name!r}: {type(err).__name__}: {err}") from err
    return proto


def _channel_axis(shape: tuple[int, ...], axis: int, ops: list[tuple[str, Any]]) -> int | None:
    """Where channel ``axis`` of a tensor of ``shape`` ends up after ``ops``; None if it is split or merged."""
    index = np.broadcast_to(np.arange(shape[axis]).reshape([-1 if d == axis else 1 for d in range(len(shape))]), shape)
    for op, arg in ops:
        index = index.reshape(arg) if op == "Reshape" else index.transpose(arg)
    for k in range(index.ndim):
        moved = np.moveaxis(index, k, 0).reshape(index.shape[k], -1)
        if index.shape[k] == shape[axis] and (moved == np.arange(shape[axis])[:, None]).all():
            return k
    return None


def _layout_chain(dq: ir.Node) -> tuple[list[ir.Node], list[tuple[str, Any]]] | None:
    """The Reshape/Transpose nodes after ``dq`` (single readers, constant shapes) and their numpy ops."""
    nodes, ops, value = [], [], dq.outputs[0]
    while True:
        reader = single_reader(value)
        if reader is None or reader.op_type not in _LAYOUT_OPS:
            break
        if reader.op_type == "Reshape":
            shape = const_input(reader, 1)
            if shape is None:
                return None
            ops.append(("Reshape", [int(s) for s in shape]))
        else:
            ops.append(("Transpose", list(attr(reader, "perm"))))
        nodes.append(reader)
        value = reader.outputs[0]
    return (nodes, ops) if nodes else None


def _weights_through_layout(model: ir.Model) -> int:
    """Constant weight ``Q -> DQ -> Reshape/Transpose...`` -> one ``Q -> DQ`` of the re-laid-out kernel."""
    import onnx_ir as ir

    graph, done = model.graph, 0
    for q in [n for n in graph if n.op_type == "QuantizeLinear"]:
        weight, dq = const_input(q, 0), single_reader(q.outputs[0])
        found = (
            _layout_chain(dq) if weight is not None and dq is not None and dq.op_type == "DequantizeLinear" else None
        )
        if weight is None or dq is None or found is None:
            continue
        nodes, ops = found
        scale = const_input(q, 1)
        axis = attr(q, "axis", 1) if scale is not None and scale.ndim == 1 else None
        new_axis = None if axis is None else _channel_axis(weight.shape, axis % weight.ndim, ops)
        if axis is not None and new_axis is None:
            continue
        laid_out = weight
        for op, arg in ops:
            laid_out = laid_out.reshape(arg) if op == "Reshape" else laid_out.transpose(arg)
        q.replace_input_with(0, add_const(graph, "weight", np.ascontiguousarray(laid_out)))
        for node in (q, dq):
            _set_axis(node, new_axis)
        dq.outputs[0].shape = ir.Shape(laid_out.shape)
        nodes[-1].outputs[0].replace_all_uses_with(dq.outputs[0])
        remove(graph, nodes)
        done += 1
    return done


def _set_axis(node: ir.Node, axis: int | None) -> None:
    import onnx_ir as ir

    if axis is None:
        node.attributes.pop("axis", None)
    else:
        node.attributes["axis"] = ir.AttrInt64("axis", axis)


def _keeps_shape(shape: list[int | None], target: np.ndarray) -> bool:
    """Does ``Reshape(x, target)`` return ``x`` as it is, for ``x`` of ``shape`` (None: unknown size)?"""
    if len(shape) != target.size or int(np.sum(target == -1)) > 1:
        return False
    return all(t in (0, -1) or (d is not None and d == t) for d, t in zip(shape, target.tolist()))


def _drop_identity_reshapes(model: ir.Model) -> int:
    """Remove each Reshape whose constant target is its input's own shape (rewire its readers)."""
    reshapes = [n for n in model.graph if n.op_type == "Reshape" and not n.outputs[0].is_graph_output()]
    shapes = inferred_dims(model) if reshapes else {}
    done = []
    for node in reshapes:
        x, target = node.inputs[0], const_input(node, 1)
        shape = shapes.get(x.name or "") if x is not None else None
        if x is None or target is None or shape is None or attr(node, "allowzero", 0):
            continue
        if _keeps_shape(shape, target):
            node.outputs[0].replace_all_uses_with(x)
            done.append(node)
    remove(model.graph, done)
    return len(done)


def _layout_before_q(model: ir.Model) -> int:
    """Per-tensor ``Q -> DQ -> Transpose/Reshape`` and ``Q -> Transpose -> DQ`` (tf2onnx's transpose optimizer
    pushes a Transpose through the Q alone) -> ``Transpose/Reshape -> Q -> DQ`` (exact: the same values, moved), so
    that a Conv reads its DQ directly."""
    graph, moved = model.graph, 0
    for dq in [n for n in graph if n.op_type == "DequantizeLinear"]:
        scale = const_input(dq, 1)
        pair = (_layout_after_dq(dq) or _layout_inside(dq)) if scale is not None and scale.ndim == 0 else None
        if pair is None:
            continue
        q, layout = pair
        x, laid_out = q.inputs[0], layout.outputs[0]
        shape = laid_out.shape  # every value of the chain has the layout's shape once it is moved
        if layout.inputs[0] is dq.outputs[0]:  # Q -> DQ -> layout: the DQ writes the layout's output (its name)
            name = laid_out.name
            laid_out.replace_all_uses_with(dq.outputs[0], replace_graph_outputs=True)
            laid_out.name, dq.outputs[0].name = fresh_name(graph, "laid_out"), name
        else:  # Q -> layout -> DQ
            dq.replace_input_with(0, q.outputs[0])
            laid_out.name = fresh_name(graph, "laid_out")
        layout.replace_input_with(0, x)
        q.replace_input_with(0, laid_out)
        laid_out.type = x.type if x is not None else None  # a float tensor now
        for value in (q.outputs[0], dq.outputs[0], laid_out):
            value.shape = shape
        graph.remove(layout)
        graph.insert_before(q, layout)
        moved += 1
    return moved


def _layout_after_dq(dq: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """``(Q, layout)`` of ``Q -> DQ -> layout``, the Q's output read by the DQ alone; else None."""
    q, layout = source(dq.inputs[0]), single_reader(dq.outputs[0])
    if q is None or q.op_type != "QuantizeLinear" or layout is None or layout.op_type not in _LAYOUT_OPS:
        return None
    if single_reader(q.outputs[0]) is not dq or const_input(q, 0) is not None:
        return None
    return q, layout


def _layout_inside(dq: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """``(Q, Transpose)`` of ``Q -> Transpose -> DQ``, each output read by the next op alone; else None. (A Reshape
    there is a transpose of 1x1 maps, which :func:`_drop_identity_reshapes` removes.)"""
    layout = source(dq.inputs[0])
    if layout is None or layout.op_type != "Transpose" or single_reader(layout.outputs[0]) is not dq:
        return None
    q = source(layout.inputs[0])
    if q is None or q.op_type != "QuantizeLinear" or single_reader(q.outputs[0]) is not layout:
        return None
    if const_input(q, 0) is not None or q.inputs[1] is not dq.inputs[1]:
        return None
    return q, layout

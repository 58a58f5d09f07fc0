"""The Keras front end's view: a Functional/Sequential model's layer graph as a :class:`~qdq.graphs.view.GraphView`.

Each layer becomes an op named in the ONNX vocabulary (``Conv2D``: ``"Conv"``, ``Dense``: ``"Gemm"``, ``Add``,
``Concatenate``: ``"Concat"``, ``MaxPooling2D``: ``"MaxPool"``...), whose output value is named after the layer; a
weighted layer with its own activation is two ops, the second reading a value inside the layer (not a boundary:
quantizing it splits the activation into its own layer). A ``swish`` activation is one ``Silu`` op whose sigmoid
is an inner value. The quantizers the toolkit's plan already puts on layer inputs (:class:`LayerPlan`, from the
mode, the spec and the cases) and kernels are the view's existing quantizers; inputs tied to one range (a
Concatenate's, :attr:`LayerPlan.ties`) are one quantizer.

This module reads Keras layers by their attributes and imports neither Keras nor TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qdq.graphs import ops
from qdq.graphs.view import GraphView, Op, Site

__all__ = ["LayerPlan", "activation_name", "activation_type", "build_view", "consumers", "producers",
           "quantized_by_default"]

_LAYER_TYPES = {
    "Conv1D": "Conv", "Conv2D": "Conv", "Conv3D": "Conv", "DepthwiseConv1D": "Conv", "DepthwiseConv2D": "Conv",
    "SeparableConv1D": "Conv", "SeparableConv2D": "Conv", "Conv1DTranspose": "ConvTranspose",
    "Conv2DTranspose": "ConvTranspose", "Conv3DTranspose": "ConvTranspose", "Dense": "Gemm",
    "BatchNormalization": "BatchNormalization", "LayerNormalization": "LayerNormalization",
    "GroupNormalization": "GroupNormalization", "Add": "Add", "Multiply": "Mul", "Concatenate": "Concat",
    "MaxPooling1D": "MaxPool", "MaxPooling2D": "MaxPool", "MaxPooling3D": "MaxPool",
    "AveragePooling1D": "AveragePool", "AveragePooling2D": "AveragePool", "AveragePooling3D": "AveragePool",
    "GlobalAveragePooling1D": "GlobalAveragePool", "GlobalAveragePooling2D": "GlobalAveragePool",
    "GlobalMaxPooling1D": "GlobalMaxPool", "GlobalMaxPooling2D": "GlobalMaxPool", "Flatten": "Flatten",
    "Reshape": "Reshape", "Permute": "Transpose", "ZeroPadding1D": "Pad", "ZeroPadding2D": "Pad",
    "ZeroPadding3D": "Pad", "Cropping1D": "Slice", "Cropping2D": "Slice", "Cropping3D": "Slice",
    "UpSampling1D": "Resize", "UpSampling2D": "Resize", "UpSampling3D": "Resize", "Dropout": "Identity",
    "SpatialDropout1D": "Identity", "SpatialDropout2D": "Identity", "SpatialDropout3D": "Identity",
    "Identity": "Identity", "LSTM": "LSTM", "GRU": "GRU", "SimpleRNN": "RNN",
}  # fmt: skip
# what tf2onnx writes for each activation (ReLU6: Clip(0, 6); swish: x * Sigmoid(x))
_ACTIVATION_TYPES = {
    "relu": "Relu", "relu6": "Clip", "sigmoid": "Sigmoid", "silu": "Silu", "swish": "Silu", "gelu": "Gelu",
    "softmax": "Softmax", "tanh": "Tanh", "hard_sigmoid": "HardSigmoid", "hard_silu": "HardSwish",
    "hard_swish": "HardSwish", "elu": "Elu", "selu": "Selu", "leaky_relu": "LeakyRelu", "mish": "Mish",
    "softplus": "Softplus", "linear": "Identity",
}  # fmt: skip


# --------------------------------------------------------------------------------------- the layer graph
def _first_node(layer: Any) -> Any | None:
    nodes = getattr(layer, "_inbound_nodes", [])
    return nodes[0] if nodes else None


def producers(layer: Any) -> list[Any]:
    """The layers whose outputs feed ``layer``, one per input position (first call of ``layer``)."""
    node = _first_node(layer)
    if node is None:
        return []
    return [tensor._keras_history.operation for tensor in node.input_tensors]


def consumers(model: Any, layer: Any) -> list[Any]:
    """The layers of ``model`` that take an output of ``layer`` (each once, in model order)."""
    members = {id(candidate) for candidate in model.layers}
    found: dict[int, Any] = {}
    for node in getattr(layer, "_outbound_nodes", []):
        operation = node.operation
        if id(operation) in members:
            found.setdefault(id(operation), operation)
    return list(found.values())


def activation_name(layer: Any) -> str:
    """The name of the activation a layer applies (its own ``activation``; ReLU layers by their settings)."""
    kind = type(layer).__name__
    if kind == "ReLU":
        plain = not getattr(layer, "negative_slope", 0) and not getattr(layer, "threshold", 0)
        max_value = getattr(layer, "max_value", None)
        if plain and max_value is None:
            return "relu"
        return "relu6" if plain and max_value is not None and float(max_value) == 6.0 else "other"
    if kind == "Softmax":
        return "softmax"
    if kind == "LeakyReLU":
        return "leaky_relu"
    function = getattr(layer, "activation", None)
    return getattr(function, "__name__", "linear") if function is not None else "linear"


def activation_type(name: str) -> str:
    """The ONNX op an activation of that name exports to (``"relu6"``: ``"Clip"``; ``"swish"``: ``"Silu"``)."""
    return _activation_op(name)[0]


def _activation_op(name: str) -> tuple[str, dict[str, Any]]:
    found = _ACTIVATION_TYPES.get(name)
    if found is None:
        return f"keras:{name}", {}
    return found, ({"min": 0.0, "max": 6.0} if name == "relu6" else {})


def _layer_op(layer: Any) -> tuple[str, dict[str, Any]]:
    kind = type(layer).__name__
    if kind in ("Activation", "ReLU", "Softmax", "LeakyReLU"):
        return _activation_op(activation_name(layer))
    found = _LAYER_TYPES.get(kind)
    if found is None:
        return f"keras:{kind}", {}
    if found == "Resize":
        return found, {"mode": str(getattr(layer, "interpolation", "nearest"))}
    if found == "Pad":
        return found, {"mode": "constant", "value": 0.0}
    return found, {}


def quantized_by_default(layer: Any) -> bool:
    """Whether "full" quantization wraps ``layer`` before any target's rule: its op is one of
    :data:`qdq.graphs.ops.QUANTIZED_BY_DEFAULT`, or its class is one this vocabulary does not know (a wrapper the
    user registered for it)."""
    op_type, _ = _layer_op(layer)
    return op_type.startswith("keras:") or op_type in ops.QUANTIZED_BY_DEFAULT


# ------------------------------------------------------------------------------------------- the plans
@dataclass(frozen=True)
class LayerPlan:
    """What one layer's wrapper quantizes.

    Attributes:
        quantize_inputs: whether inputs are quantized at all.
        input_indices: the positions quantized (None: every input).
        quantize_weight: the kernel (weighted layers).
        unsigned: positions quantized unsigned (uint8 over ``[0, amax]``).
        ties: position -> the name of the range it shares with other inputs (of this or other layers): those
            inputs are calibrated together and get one range (one scale in the file).
    """

    quantize_inputs: bool
    input_indices: tuple[int, ...] | None
    quantize_weight: bool
    unsigned: frozenset[int] = frozenset()
    ties: Mapping[int, str] = field(default_factory=dict)

    def positions(self, n_inputs: int) -> tuple[int, ...]:
        if not self.quantize_inputs:
            return ()
        return tuple(range(n_inputs)) if self.input_indices is None else self.input_indices


# ------------------------------------------------------------------------------------------- the view
def build_view(model: Any, plans: Mapping[str, LayerPlan], target: Any,
               inner: Callable[[Any], Any] | None = None) -> GraphView:  # fmt: skip
    """The view of ``model``'s layer graph, with the quantizers of ``plans`` (by layer name) as existing ones.

    Each op's ``ref`` is its layer, or ``(layer, "activation")`` for a weighted layer's own activation. ``inner``
    gives the layer whose kind an op takes (a quantized model's wrapper: the layer it wraps); values and refs stay
    the model's own layers."""
    view = GraphView("keras", target)
    outputs = {tensor._keras_history.operation.name for tensor in model.outputs}
    handles: dict[Any, object] = {}
    for layer in model.layers:
        if type(layer).__name__ == "InputLayer":
            view.value(layer.name).graph_output = layer.name in outputs
            continue
        op = _add_layer(view, layer, inner(layer) if inner is not None else layer)
        view.value(layer.name).graph_output = layer.name in outputs
        plan = plans.get(layer.name)
        if plan is not None:
            _existing(view, op, plan, handles)
    return view


def _add_layer(view: GraphView, layer: Any, kind: Any) -> Op:
    """The layer's op (and its own activation's op after it), of the kind of layer ``kind``; returns the first."""
    inputs = [view.value(parent.name) for parent in producers(layer)]
    op_type, attrs = _layer_op(kind)
    activation = activation_name(kind) if op_type in ops.WEIGHTED else "linear"
    output = view.value(layer.name) if activation == "linear" else view.value(f"{layer.name}:linear", boundary=False)
    weights = [view.value(f"{layer.name}.kernel", constant=True)] if op_type in ops.WEIGHTED else []
    op = view.add_op(layer.name, op_type, inputs + weights, [output], attrs=attrs,
                     weights=range(len(inputs), len(inputs) + len(weights)),
                     ref=layer)  # fmt: skip
    if activation != "linear":
        act_type, act_attrs = _activation_op(activation)
        name = f"{layer.name}:activation"
        view.add_op(name, act_type, [output], [view.value(layer.name)], attrs=act_attrs,
                    ref=(layer, "activation"))  # fmt: skip
    return op


def _existing(view: GraphView, op: Op, plan: LayerPlan, handles: dict[Any, object]) -> None:
    """The plan's quantized inputs and kernel as existing quantizers: one per tensor and grid (calibration gives a
    tensor two wrappers read the same way one range), or per tie."""
    n_inputs = len(op.inputs) - len(op.weights)
    for position in plan.positions(n_inputs):
        value, unsigned = op.inputs[position], position in plan.unsigned
        key = ("tie", plan.ties[position]) if position in plan.ties else (value.name, unsigned)
        handle = handles.setdefault(key, object())
        view.existing(Site(value, op, position), handle, unsigned=unsigned)
    if plan.quantize_weight and op.weights:
        position = min(op.weights)
        view.existing(Site(op.inputs[position], op, position), object(), per_channel=True)

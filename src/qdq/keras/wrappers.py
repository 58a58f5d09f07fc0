"""Quantize wrappers: a Keras layer with Q/DQ on its inputs (per tensor) and its kernel (per channel).

A wrapper holds the original layer (its weights unchanged) and computes the same op with quantized
operands. Inputs get a non-trainable ``input_amax_<i>`` variable, set by :func:`qdq.keras.calibrate`;
until then (``calibrated=False``) an input is quantized with its own batch max (dynamic range). Weights
are quantized per output channel with ``max|w|`` of the current kernel in every call, so QAT always
quantizes the weights it trains and export freezes exactly those ranges.

One wrapper class per Keras class, found in :data:`WRAPPERS` by the class name (or a base class's).
Add support for another layer with ``@register_wrapper("MyLayer")`` on a :class:`QuantizeWrapper`
subclass; weighted layers override :meth:`QuantizeWrapper.kernel_axis` and :meth:`QuantizeWrapper.compute`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from qdq.errors import QdqConfigError
from qdq.keras import quantizer
from qdq.keras._backend import keras as _keras
from qdq.keras._backend import tf as _tf
from qdq.registry import Registry
from qdq.targets.marks import MARK_PARTS, mark_placed

keras: Any = _keras()  # typed Any: read at run time, a base class below
tf: Any = _tf()

__all__ = ["WRAPPERS", "QuantizeWrapper", "register_wrapper", "wrapper_for", "wrappers_of"]

#: Keras class name -> its QuantizeWrapper subclass
WRAPPERS: Registry[str, type] = Registry("quantized Keras layer")


_Class = TypeVar("_Class", bound=type)


def register_wrapper(class_name: str, *, override: bool = False) -> Callable[[_Class], _Class]:
    """Class decorator: the wrapper of Keras layers of class ``class_name``."""

    def add(cls: _Class) -> _Class:
        WRAPPERS.register(class_name, cls, override=override)
        return cls

    return add


def wrapper_for(layer: Any) -> type | None:
    """The wrapper class of ``layer`` (by its class name, then its base classes'), or None."""
    for cls in type(layer).__mro__:
        found = WRAPPERS.find(cls.__name__)
        if found is not None:
            return found
    return None


def wrappers_of(model: Any) -> list[QuantizeWrapper]:
    """The quantize wrappers of a model, in layer order."""
    return [layer for layer in model.layers if isinstance(layer, QuantizeWrapper)]


def _layers(model: Any) -> list[Any] | None:
    """A Keras model's layers (its quantize wrappers carry the target's mark), or None for anything else."""
    return list(model.layers) if isinstance(model, keras.Model) else None


MARK_PARTS.register("keras", _layers, override=True)


@keras.saving.register_keras_serializable(package="qdq")
class QuantizeWrapper(keras.layers.Wrapper):
    """Q/DQ around one Keras layer.

    Args:
        layer: the layer to quantize (kept, with its weights).
        quantize_inputs: Q/DQ on the inputs.
        input_indices: positions of the inputs to quantize (multi-input layers); None: all.
        quantize_weight: Q/DQ on the kernel (weighted layers).
        num_bits: bits of the integer grid (8: int8, or uint8 for unsigned inputs).
        calibrated: the input ranges are stored (else each batch uses its own max).
        unsigned_indices: input positions quantized unsigned (``[0, amax]``, step ``amax / (2**num_bits - 1)``):
            inputs that are non-negative by construction, for ONNX Runtime (:mod:`qdq.keras.placement`).
        target: the target whose placement put this wrapper (None: the toolkit's placement, any target).
        weight_bits: bits of the kernel's signed grid (default ``num_bits``; W4A8: 4 here, 8 there).
        range_ties: input position -> the name of a range it shares with inputs of this or other wrappers (a
            tensor before and after a MaxPool, ONNX Runtime's int8 data movers): :func:`qdq.keras.calibrate`
            calibrates tied inputs together and gives them one range.
        kept_float: the layer runs, and exports, float, its quantizers kept as they are (``auto`` left it float:
            the model's stem, :mod:`qdq.workflow.stem`); saved with the model.
    """

    weighted = False
    #: the quantized inputs share one range (calibrated on all of them), so they share one step: TensorRT
    #: concatenates int8 data with one scale (the PyTorch ``QuantConcat`` has one quantizer for the same reason)
    shared_input_range = False

    def __init__(
        self,
        layer: Any,
        quantize_inputs: bool = True,
        input_indices: Sequence[int] | None = None,
        quantize_weight: bool = True,
        num_bits: int = 8,
        calibrated: bool = False,
        unsigned_indices: Sequence[int] = (),
        target: str | None = None,
        weight_bits: int | None = None,
        range_ties: Any = None,
        kept_float: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name", f"quant_{layer.name}")
        super().__init__(layer, **kwargs)
        self.quantize_inputs = bool(quantize_inputs)
        self.input_indices = None if input_indices is None else tuple(int(i) for i in input_indices)
        self.quantize_weight = bool(quantize_weight) and self.weighted
        self.num_bits = int(num_bits)
        self.calibrated = bool(calibrated)
        self.unsigned_indices = tuple(int(i) for i in unsigned_indices)
        self.target = target
        if target is not None:
            mark_placed(self, target)  # what qdq.targets.placed_target reads on the model's layers
        self.weight_bits = int(weight_bits) if weight_bits is not None else self.num_bits
        ties = range_ties.items() if isinstance(range_ties, dict) else (range_ties or ())  # a dict, or saved pairs
        self.range_ties = {int(position): str(name) for position, name in ties}
        self.kept_float = bool(kept_float)
        #: identity on the inputs and float weights (set while calibrating: statistics of the float model)
        self.bypass = False
        self.input_amax: list[Any] = []
        parameters = inspect.signature(layer.call).parameters
        self._takes_training, self._takes_mask = "training" in parameters, "mask" in parameters

    # -- structure ---------------------------------------------------------------------------------
    def quantized_positions(self, n_inputs: int) -> tuple[int, ...]:
        """The input positions with Q/DQ, for a call with ``n_inputs`` inputs."""
        if not self.quantize_inputs:
            return ()
        positions = range(n_inputs) if self.input_indices is None else self.input_indices
        bad = [i for i in positions if i >= n_inputs]
        if bad:
            raise QdqConfigError(
                f"layer {self.layer.name!r} has {n_inputs} input(s); quantization_index {list(bad)} is out of range."
            )
        return tuple(positions)

    def build(self, input_shape: Any) -> None:
        if not self.layer.built:
            self.layer.build(input_shape)
        shapes = input_shape if _is_multi(input_shape) else [input_shape]
        self.input_amax = [
            self.add_weight(name=f"input_amax_{i}", shape=(), initializer="zeros", trainable=False)
            for i in self.quantized_positions(len(shapes))
        ]
        self.built = True

    # -- forward -----------------------------------------------------------------------------------
    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        multi = isinstance(inputs, list | tuple)
        xs = list(inputs) if multi else [inputs]
        if not (self.bypass or self.kept_float):
            for amax, position in zip(self.input_amax, self.quantized_positions(len(xs))):
                xs[position] = self.quantize_input(xs[position], amax, position in self.unsigned_indices)
        args = xs if multi else xs[0]
        if self.weighted:
            kernel = self.kernel
            if self.quantize_weight and not (self.bypass or self.kept_float):
                kernel = quantizer.fake_quant(kernel, self.weight_amax(), self.weight_bits, self.kernel_axis())
            return self.compute(args, kernel)
        options = {"training": training} if self._takes_training else {}
        if self._takes_mask and mask is not None:
            options["mask"] = mask
        return self.layer(args, **options)

    def quantize_input(self, x: Any, amax: Any, unsigned: bool = False) -> Any:
        """Q/DQ of one input with its stored range (or, uncalibrated, the batch's own max). A sparse input is made
        dense first: Keras marks ``x * 0.5`` of a dense tensor sparse when it infers shapes (MobileNetV3's
        ``hard_sigmoid``), and a quantized value is dense."""
        x = quantizer.dense(x)
        amax = amax if self.calibrated else quantizer.dynamic_amax(x, unsigned)
        return quantizer.fake_quant(x, amax, self.num_bits, unsigned=unsigned)

    @property
    def kernel(self) -> Any:
        """The float kernel variable of the wrapped layer."""
        return self.layer.kernel

    def kernel_axis(self) -> int:
        """Axis of the kernel that holds the output channels (per-channel ranges)."""
        raise NotImplementedError

    def weight_amax(self) -> Any:
        """Per-channel range of the current kernel (``max|w|`` along :meth:`kernel_axis`)."""
        return quantizer.weight_amax(self.kernel, self.kernel_axis())

    def compute(self, inputs: Any, kernel: Any) -> Any:
        """The wrapped layer's op with ``kernel`` in place of its own (weighted wrappers)."""
        raise NotImplementedError

    # -- serialization -----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            quantize_inputs=self.quantize_inputs,
            input_indices=None if self.input_indices is None else list(self.input_indices),
            quantize_weight=self.quantize_weight,
            num_bits=self.num_bits,
            calibrated=self.calibrated,
            unsigned_indices=list(self.unsigned_indices),
            target=self.target,
            weight_bits=self.weight_bits,
            range_ties=[[position, name] for position, name in sorted(self.range_ties.items())],
            kept_float=self.kept_float,
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizeWrapper:
        config = dict(config)
        config["layer"] = keras.layers.deserialize(config["layer"])
        return cls(**config)


def _is_multi(shape: Any) -> bool:
    return isinstance(shape, list | tuple) and len(shape) > 0 and isinstance(shape[0], list | tuple)


def _activate(layer: Any, y: Any) -> Any:
    return layer.activation(y) if getattr(layer, "activation", None) is not None else y


def _bias(layer: Any, y: Any) -> Any:
    if not layer.use_bias:
        return y
    fmt = "NCHW" if getattr(layer, "data_format", "channels_last") == "channels_first" else "NHWC"
    return tf.nn.bias_add(y, layer.bias, data_format=fmt)  # Conv's bias input in ONNX, not a separate Add


@register_wrapper("Conv2D")
@keras.saving.register_keras_serializable(package="qdq")
class Conv2DQuantizeWrapper(QuantizeWrapper):
    """Conv2D: per-tensor input, per-output-channel kernel (HWIO, axis 3)."""

    weighted = True

    def kernel_axis(self) -> int:
        return 3

    def compute(self, inputs: Any, kernel: Any) -> Any:
        return _activate(self.layer, _bias(self.layer, self.layer.convolution_op(inputs, kernel)))


@register_wrapper("DepthwiseConv2D")
@keras.saving.register_keras_serializable(package="qdq")
class DepthwiseConv2DQuantizeWrapper(QuantizeWrapper):
    """DepthwiseConv2D: per-tensor input, kernel ``(kh, kw, in, multiplier)`` per input channel (axis 2)."""

    weighted = True

    def kernel_axis(self) -> int:
        return 2

    def compute(self, inputs: Any, kernel: Any) -> Any:
        layer = self.layer
        y = keras.ops.depthwise_conv(
            inputs, kernel, strides=layer.strides, padding=layer.padding,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format,
        )  # fmt: skip
        return _activate(layer, _bias(layer, y))


@register_wrapper("Dense")
@keras.saving.register_keras_serializable(package="qdq")
class DenseQuantizeWrapper(QuantizeWrapper):
    """Dense: per-tensor input, kernel ``(in, units)`` per unit (axis 1)."""

    weighted = True

    def kernel_axis(self) -> int:
        return 1

    def compute(self, inputs: Any, kernel: Any) -> Any:
        return _activate(self.layer, _bias(self.layer, keras.ops.matmul(inputs, kernel)))


def _input_only(class_name: str, doc: str) -> type[QuantizeWrapper]:
    cls: type[QuantizeWrapper] = type(
        f"{class_name}QuantizeWrapper", (QuantizeWrapper,), {"__doc__": doc, "__module__": __name__}
    )
    cls = keras.saving.register_keras_serializable(package="qdq")(cls)
    return register_wrapper(class_name)(cls)


AveragePooling2DQuantizeWrapper = _input_only("AveragePooling2D", "AveragePooling2D: per-tensor input.")
GlobalAveragePooling2DQuantizeWrapper = _input_only(
    "GlobalAveragePooling2D", "GlobalAveragePooling2D: per-tensor input."
)
MaxPooling2DQuantizeWrapper = _input_only("MaxPooling2D", "MaxPooling2D: per-tensor input (off by default).")
BatchNormalizationQuantizeWrapper = _input_only(
    "BatchNormalization", "BatchNormalization: per-tensor input (off by default; pre-activation BN of ResNet-v2)."
)
AddQuantizeWrapper = _input_only("Add", "Add: per-tensor Q/DQ on the selected inputs (off by default).")
MultiplyQuantizeWrapper = _input_only("Multiply", "Multiply: per-tensor Q/DQ on the selected inputs (off by default).")
ConcatenateQuantizeWrapper = _input_only(
    "Concatenate", "Concatenate: per-tensor Q/DQ on the selected inputs, one shared range (off by default)."
)
ConcatenateQuantizeWrapper.shared_input_range = True

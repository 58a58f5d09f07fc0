"""Custom Q/DQ insertion cases: graph patterns that decide extra Q/DQ for TensorRT's fusions.

A case looks at the original (float) model and the user's spec and returns a new
:class:`~qdq.keras.spec.QuantizationSpec` with entries for the layers it treats specially; layers the user
named are left to the user. The built-in cases (the NVIDIA TF2 toolkit's rules):

* :class:`ResidualConnectionQDQCase`: on each ``Add``, Q/DQ on every input except the one TensorRT fuses: of
  the inputs that come from a Conv or Dense (directly, or through BatchNormalization / Activation / Dropout)
  and feed nothing else, the deepest branch (the toolkit took the first in argument order; the choice is now
  the ``residual_add`` rule's, the same on the PyTorch path), so TensorRT fuses Conv(+BN)+Add(+ReLU) into one
  int8 convolution with a residual input;
* :class:`BNQDQCase`: Q/DQ on the input of every BatchNormalization that does not follow a Conv (the
  pre-activation BN of ResNet-v2, which TensorRT cannot fold);
* :class:`MaxPoolQDQCase`: Q/DQ on the input of every MaxPooling2D (horizontal fusion of branches);
* per network: :class:`ResNetV1QDQCase`, :class:`ResNetV2QDQCase`, :class:`MobileNetQDQCase`,
  :class:`EfficientNetQDQCase` (also both inputs of the squeeze-excitation ``Multiply``),
  :class:`InceptionQDQCase`.
"""

from __future__ import annotations

import abc
from typing import Any

from qdq.keras.graph import producers
from qdq.keras.spec import QuantizationSpec

__all__ = [
    "BNQDQCase",
    "CustomQDQInsertionCase",
    "EfficientNetQDQCase",
    "InceptionQDQCase",
    "MaxPoolQDQCase",
    "MobileNetQDQCase",
    "ResNetV1QDQCase",
    "ResNetV2QDQCase",
    "ResidualConnectionQDQCase",
]


class CustomQDQInsertionCase(abc.ABC):
    """A rule that adds spec entries; override :meth:`case` (and optionally :meth:`info`)."""

    @abc.abstractmethod
    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec | None:
        """Entries for the layers this case handles in ``keras_model`` (the float model).

        ``qspec`` is a copy of the user's spec: skip the layers it names.
        """

    def info(self) -> str:
        """One line on what the case does."""
        return (type(self).__doc__ or type(self).__name__).strip().splitlines()[0]


def _layers_of(model: Any, class_name: str, qspec: QuantizationSpec) -> list[Any]:
    taken = qspec.names()
    return [layer for layer in model.layers if type(layer).__name__ == class_name and layer.name not in taken]


def _is_conv(layer: Any) -> bool:
    return "Conv" in type(layer).__name__


class ResidualConnectionQDQCase(CustomQDQInsertionCase):
    """Q/DQ on the residual inputs of every Add; the input TensorRT fuses into its conv stays float."""

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        """Every input of each Add but the one TensorRT fuses (every input when none comes from a weighted
        layer): the choice of the ``residual_add`` placement rule, :func:`qdq.targets.common.residual.fused_input`
        (of two weighted inputs, the deeper branch is fused: the shortcut of a projection block is quantized)."""
        from qdq.graphs.keras import KerasPlacement
        from qdq.targets.common.residual import fused_input

        graph = KerasPlacement(keras_model, {}, None)
        spec = QuantizationSpec()
        for add in _layers_of(keras_model, "Add", qspec):
            inputs = producers(add)
            fused = fused_input(
                [graph.follows_weighted(p) for p in inputs], lambda i, xs=inputs: graph.weighted_depth(xs[i])
            )
            index = [i for i in range(len(inputs)) if i != fused]
            if index:
                spec.add(add.name, quantize_input=True, quantize_weight=False, quantization_index=index)
        return spec


class BNQDQCase(CustomQDQInsertionCase):
    """Q/DQ on the input of every BatchNormalization whose input is not a Conv's output."""

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        spec = QuantizationSpec()
        for bn in _layers_of(keras_model, "BatchNormalization", qspec):
            parents = producers(bn)
            if parents and not _is_conv(parents[0]):
                spec.add(bn.name, quantize_input=True, quantize_weight=False)
        return spec


class MaxPoolQDQCase(CustomQDQInsertionCase):
    """Q/DQ on the input of every MaxPooling2D."""

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        spec = QuantizationSpec()
        for pool in _layers_of(keras_model, "MaxPooling2D", qspec):
            spec.add(pool.name, quantize_input=True, quantize_weight=False)
        return spec


class _Composite(CustomQDQInsertionCase):
    parts: tuple[type[CustomQDQInsertionCase], ...] = ()

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        spec = QuantizationSpec()
        for part in self.parts:
            spec.extend(part().case(keras_model, qspec) or QuantizationSpec())
        return spec


class ResNetV1QDQCase(_Composite):
    """ResNet v1 (keras.applications.ResNet50/101/152): the residual case."""

    parts = (ResidualConnectionQDQCase,)


class ResNetV2QDQCase(_Composite):
    """ResNet v2: the residual, pre-activation BN and MaxPool cases."""

    parts = (ResidualConnectionQDQCase, BNQDQCase, MaxPoolQDQCase)


class MobileNetQDQCase(_Composite):
    """MobileNet v1/v2: the residual case (v1 has no Add: nothing to do)."""

    parts = (ResidualConnectionQDQCase,)


class InceptionQDQCase(_Composite):
    """Inception: the MaxPool case (horizontal fusion at the Concatenates)."""

    parts = (MaxPoolQDQCase,)


class EfficientNetQDQCase(_Composite):
    """EfficientNet: the residual case and both inputs of each squeeze-excitation Multiply."""

    parts = (ResidualConnectionQDQCase,)

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        spec = super().case(keras_model, qspec)
        for multiply in _layers_of(keras_model, "Multiply", qspec):
            spec.add(multiply.name, quantize_input=True, quantize_weight=False, quantization_index=[0, 1])
        return spec

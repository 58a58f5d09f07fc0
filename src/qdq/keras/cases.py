"""Custom Q/DQ insertion cases: graph patterns that decide extra Q/DQ for TensorRT's fusions.

A case looks at the original (float) model and the user's spec and returns a new
:class:`~qdq.keras.spec.QuantizationSpec` with entries for the layers it treats specially; layers the user
named are left to the user. The built-in cases are placement rules written once against the graph view
(:mod:`qdq.graphs.view`, the rules every front end runs): each runs its rule on the model's view and returns
the inputs it decided to quantize as spec entries (:func:`spec_of_rule`). The built-in cases (the NVIDIA TF2
toolkit's rules):

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
import functools
from collections.abc import Callable
from typing import Any

from qdq.graphs.keras import build_view
from qdq.graphs.view import GraphView
from qdq.keras.spec import QuantizationSpec
from qdq.targets.common.residual import residual_adds
from qdq.targets.tensorrt.cases import MAXPOOL_INPUTS, NORM_INPUTS, PRODUCT_INPUTS

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
    "spec_of_rule",
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


def spec_of_rule(keras_model: Any, qspec: QuantizationSpec, decide: Callable[[GraphView], None]) -> QuantizationSpec:
    """The inputs a placement rule ``decide(view)`` quantizes on ``keras_model``'s graph view, as spec entries (one
    per layer, its input positions); layers ``qspec`` names are left out."""
    view = build_view(keras_model, {}, None)
    decide(view)
    taken = qspec.names()
    positions: dict[str, set[int]] = {}
    for quantizer in view.quantizers():
        for site in quantizer.sites:
            pairs = [(site.reader, site.index)] if site.reader is not None else site.value.readers
            for op, index in pairs:
                if not isinstance(op.ref, tuple) and op.ref.name not in taken:
                    positions.setdefault(op.ref.name, set()).add(index)
    spec = QuantizationSpec()
    for name, found in positions.items():
        spec.add(name, quantize_input=True, quantize_weight=False, quantization_index=sorted(found))
    return spec


class _RuleCase(CustomQDQInsertionCase):
    rule: Callable[[GraphView], None]

    def case(self, keras_model: Any, qspec: QuantizationSpec) -> QuantizationSpec:
        return spec_of_rule(keras_model, qspec, type(self).rule)


class ResidualConnectionQDQCase(_RuleCase):
    """Q/DQ on the residual inputs of every Add; the input TensorRT fuses into its conv stays float.

    Every input of each Add but the one TensorRT fuses (every input when none comes from a weighted layer): the
    choice of the ``residual_add`` placement rule (:func:`qdq.targets.common.residual.fused_input`: of two
    weighted inputs, the deeper branch is fused, so the shortcut of a projection block is quantized).
    """

    rule = staticmethod(functools.partial(residual_adds, mode="skip", lone=True))


class BNQDQCase(_RuleCase):
    """Q/DQ on the input of every BatchNormalization whose input is not a Conv's output."""

    rule = staticmethod(NORM_INPUTS.decide)


class MaxPoolQDQCase(_RuleCase):
    """Q/DQ on the input of every MaxPooling2D."""

    rule = staticmethod(MAXPOOL_INPUTS.decide)


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


class _ProductCase(_RuleCase):
    rule = staticmethod(PRODUCT_INPUTS.decide)


class EfficientNetQDQCase(_Composite):
    """EfficientNet: the residual case and both inputs of each squeeze-excitation Multiply."""

    parts = (ResidualConnectionQDQCase, _ProductCase)

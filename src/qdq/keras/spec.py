"""``QuantizationSpec``: which layers (by name or by Keras class) get Q/DQ, and on which inputs.

The NVIDIA TF2 toolkit's API, kept so its scripts port: ``spec.add(name, is_keras_class=False,
quantize_input=True, quantize_weight=True, quantization_index=None)``; every argument may also be a list
of the same length as ``name``. Differences: ``quantize_model`` never modifies the spec it is given, and
a name that matches no layer, or a class qdq has no quantized wrapper for, is an error (not a warning).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError

__all__ = ["LayerConfig", "QuantizationSpec"]


@dataclass(frozen=True)
class LayerConfig:
    """One entry of a :class:`QuantizationSpec`.

    Attributes:
        name: a layer name, or a Keras class name (``"Add"``) when ``is_keras_class``.
        is_keras_class: the entry names every layer of that class (its flags are the defaults).
        quantize_input: Q/DQ on the layer's inputs.
        quantize_weight: Q/DQ on the layer's kernel (weighted layers only).
        quantization_index: positions of the inputs to quantize (multi-input layers such as ``Add``);
            None quantizes every input.
    """

    name: str
    is_keras_class: bool = False
    quantize_input: bool = True
    quantize_weight: bool = True
    quantization_index: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a QuantizationSpec name must be a non-empty string, got {self.name!r}.")
        index = self.quantization_index
        if index is not None:
            items = (index,) if isinstance(index, int) else tuple(index)
            if not items or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
                raise QdqConfigError(
                    f"quantization_index of {self.name!r} must be None or non-negative input positions, got {index!r}."
                )
            object.__setattr__(self, "quantization_index", tuple(sorted(set(items))))


class QuantizationSpec:
    """An ordered list of :class:`LayerConfig` entries; for the same name, the last entry wins.

    Example:
        >>> spec = QuantizationSpec()
        >>> spec.add("Add", is_keras_class=True)                    # every Add: Q/DQ on all inputs
        >>> spec.add("conv1", quantize_input=False)                 # conv1: weight only
        >>> spec.add(["add_1", "add_2"], quantization_index=[[1], [1]])  # the skip input only
    """

    def __init__(self) -> None:
        self.layers: list[LayerConfig] = []

    def add(
        self,
        name: str | Sequence[str],
        is_keras_class: bool | Sequence[bool] = False,
        quantize_input: bool | Sequence[bool] = True,
        quantize_weight: bool | Sequence[bool] = True,
        quantization_index: Sequence[int] | Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Add one entry, or one per name when ``name`` is a list (other arguments: scalar or same-length list)."""
        if isinstance(name, str):
            self.layers.append(LayerConfig(name, bool(is_keras_class), bool(quantize_input), bool(quantize_weight),
                                           _index(quantization_index)))  # fmt: skip
            return
        names = list(name)
        flags = {"is_keras_class": is_keras_class, "quantize_input": quantize_input, "quantize_weight": quantize_weight}
        columns = [_column(value, len(names), label) for label, value in flags.items()]
        indices = _index_column(quantization_index, len(names))
        for i, layer_name in enumerate(names):
            self.add(layer_name, columns[0][i], columns[1][i], columns[2][i], indices[i])

    def extend(self, other: QuantizationSpec) -> None:
        """Append every entry of ``other``."""
        if not isinstance(other, QuantizationSpec):
            raise QdqTypeError(f"expected a QuantizationSpec, got {type(other).__name__}.")
        self.layers.extend(other.layers)

    def copy(self) -> QuantizationSpec:
        spec = QuantizationSpec()
        spec.layers = [replace(entry) for entry in self.layers]
        return spec

    def names(self) -> set[str]:
        """Layer names with an entry."""
        return {entry.name for entry in self.layers if not entry.is_keras_class}

    def classes(self) -> set[str]:
        """Keras class names with an entry."""
        return {entry.name for entry in self.layers if entry.is_keras_class}

    def by_name(self) -> dict[str, LayerConfig]:
        """The effective entry of each named layer (the last one added)."""
        return {entry.name: entry for entry in self.layers if not entry.is_keras_class}

    def __iter__(self) -> Iterator[LayerConfig]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"QuantizationSpec({self.layers!r})"


def _index(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, int) else tuple(value)


def _column(value: Any, n: int, label: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise QdqConfigError(f"{label} has {len(value)} values for {n} names; give one per name or a scalar.")
        return list(value)
    return [value] * n


def _index_column(value: Any, n: int) -> list[Any]:
    if value is None:
        return [None] * n
    items = list(value)
    if items and all(isinstance(v, int) for v in items):  # one index list shared by every name
        return [tuple(items)] * n
    if len(items) != n:
        raise QdqConfigError(f"quantization_index has {len(items)} entries for {n} names; give one per name.")
    return items

"""What the runtime layer reads from an ONNX file before any backend sees it.

:func:`read_model_info` checks that a path is a readable ONNX model (a missing file or a file that is
not ONNX raises :class:`~qdq.errors.QdqConfigError`, so the CLI can report it in one line), and returns
the graph's inputs, outputs, whether it is quantized and its metadata (the target a qdq export was made
for). :func:`random_inputs` makes a feed for those inputs at a chosen batch size, for benchmarks and
smoke tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qdq.errors import QdqConfigError
from qdq.runtime._text import first_line

if TYPE_CHECKING:
    import onnx

__all__ = ["FLOAT_KEY", "TARGET_KEY", "ModelInfo", "TensorSpec", "load_onnx", "random_inputs", "read_model_info"]

#: the metadata entry of a qdq export naming the target it was made for
TARGET_KEY = "qdq.target"
#: the metadata entry of a low-precision export naming the type its float part computes in (``"float16"``)
FLOAT_KEY = "qdq.float"

Dim = int | str | None
"""One dimension of an input: a fixed size, a named dynamic size (``"batch"``), or unknown (``None``)."""

# Ops whose presence means the graph computes (part of) its work on integer data.
_QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "ConvInteger",
        "MatMulInteger",
        "QGemm",
    }
)

_FLOAT_LABELS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and NumPy dtype of one graph input."""

    name: str
    shape: tuple[Dim, ...]
    dtype: np.dtype

    def concrete_shape(self, batch: int, sizes: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """Return the shape with a dynamic leading (batch) dimension set to ``batch`` and the named dynamic
        dimensions in ``sizes`` (e.g. ``{"sequence": 128}``) set to theirs.

        Raises:
            QdqConfigError: the leading dimension is fixed to another size, or another dimension is
                dynamic and not in ``sizes`` (the caller must then give its size or the inputs).
        """
        sizes = sizes or {}
        shape: list[int] = []
        for axis, dim in enumerate(self.shape):
            if isinstance(dim, int):
                if axis == 0 and dim != batch:
                    raise QdqConfigError(
                        f"input {self.name!r} has a fixed batch size of {dim}; cannot make a batch of "
                        f"{batch}. Export the model with a dynamic batch axis, or use batch {dim}."
                    )
                shape.append(dim)
            elif axis == 0:
                shape.append(batch)
            elif dim is not None and dim in sizes:
                shape.append(int(sizes[dim]))
            else:
                raise QdqConfigError(
                    f"input {self.name!r} has a dynamic dimension {dim!r} at axis {axis} "
                    f"(shape {self.shape}); give its size (e.g. sizes={{{dim!r}: 128}}, qdq bench --seq-len for "
                    "'sequence') or pass the inputs explicitly."
                )
        return tuple(shape)


@dataclass(frozen=True)
class ModelInfo:
    """Facts about an ONNX file that every backend needs: inputs, outputs and op types."""

    path: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    op_counts: Mapping[str, int]
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str | None:
        """The target the file was exported for (its ``qdq.target`` metadata), None for a file qdq did not write."""
        return self.metadata.get(TARGET_KEY)

    @property
    def float_type(self) -> str:
        """The type the file's float part computes in, as its low-precision export recorded it (``qdq.float``):
        ``"float16"``, ``"bfloat16"``; ``"float32"`` for any other file."""
        return self.metadata.get(FLOAT_KEY, "float32")

    @property
    def quantized(self) -> bool:
        """True if the graph holds Q/DQ nodes or integer kernels."""
        return any(op in _QUANTIZED_OPS for op in self.op_counts)

    @property
    def precision(self) -> str:
        """``"int8"`` for a quantized graph (``"int8+fp16"`` / ``"int8+bf16"`` when its float part computes in
        that type), else the float type of the first float input (``"fp32"``...)."""
        if self.quantized:
            low = _FLOAT_LABELS.get(self.float_type, self.float_type)
            return "int8" if low == "fp32" else f"int8+{low}"
        for spec in self.inputs:
            if _is_float(spec.dtype):
                return _FLOAT_LABELS.get(spec.dtype.name, spec.dtype.name)
        return "fp32"


def read_model_info(path: str | Path) -> ModelInfo:
    """Load the graph of an ONNX file (without external weights) and describe it.

    Raises:
        QdqConfigError: the file does not exist, or is not an ONNX model.
    """
    from qdq.graphs.onnx import feed_inputs

    model = load_onnx(path)
    inputs = tuple(_spec(vi) for vi in feed_inputs(model))
    outputs = tuple(vi.name for vi in model.graph.output)
    op_counts = Counter(node.op_type for node in model.graph.node)
    metadata = {prop.key: prop.value for prop in model.metadata_props}
    return ModelInfo(Path(path), inputs, outputs, dict(op_counts), metadata)


def load_onnx(path: str | Path, *, external_data: bool = False) -> onnx.ModelProto:
    """Load an ONNX file, turning "no such file" and "not ONNX" into :class:`QdqConfigError`."""
    import onnx
    from google.protobuf.message import DecodeError

    file = Path(path)
    if not file.exists():
        raise QdqConfigError(f"{file}: no such file")
    if not file.is_file():
        raise QdqConfigError(f"{file}: not a file")
    try:
        model = onnx.load(str(file), load_external_data=external_data)
    except (DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as err:
        raise QdqConfigError(f"{file}: not an ONNX model ({first_line(err)})") from None
    if model.ir_version <= 0 or not model.graph.node:
        raise QdqConfigError(f"{file}: not an ONNX model (no graph found)")
    return model


def random_inputs(
    specs: Sequence[TensorSpec], batch: int = 1, *, seed: int = 0, sizes: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Make one random array per input: standard normal for floats, ones for integer inputs named like an
    attention mask (``*mask*``: nothing masked), small integers otherwise (token ids, token types).

    A dynamic leading dimension takes the size ``batch``, other named dynamic dimensions theirs in ``sizes``;
    see :meth:`TensorSpec.concrete_shape`.
    """
    if batch < 1:
        raise QdqConfigError(f"batch must be >= 1, got {batch}")
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = spec.concrete_shape(batch, sizes)
        if _is_float(spec.dtype):
            feed[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif "mask" in spec.name.lower():
            feed[spec.name] = np.ones(shape, dtype=spec.dtype)
        elif spec.dtype.kind == "b":
            feed[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feed[spec.name] = rng.integers(0, 10, size=shape).astype(spec.dtype)
    return feed


def _spec(value_info: onnx.ValueInfoProto) -> TensorSpec:
    from onnx.helper import tensor_dtype_to_np_dtype

    from qdq.graphs.onnx_types import dim_size

    tensor_type = value_info.type.tensor_type
    dims: list[Dim] = []
    for dim in tensor_type.shape.dim:
        size = dim_size(dim)
        dims.append(size if size is not None else dim.dim_param or None)
    return TensorSpec(value_info.name, tuple(dims), np.dtype(tensor_dtype_to_np_dtype(tensor_type.elem_type)))


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")

"""The ONNX front end: quantize an existing FP32 ONNX file for a target (``qdq.quantize_onnx``).

The same placement language as the PyTorch and Keras front ends (:mod:`qdq.graphs.view`): the file's graph is the
view, the target's rules decide, Q/DQ nodes are written. See :func:`qdq.onnx_in.quantize.quantize_onnx`; a file loaded
and prepared once, placed and written again with other float tensors: :class:`qdq.onnx_in.prepared.PreparedModel`.
Importing this package imports nothing; names resolve on first use.
"""

from __future__ import annotations

from qdq.lazy import lazy_names

__all__ = ["KeepFloat", "OnnxQuantizeResult", "PreparedModel", "quantize_onnx"]

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "KeepFloat": "qdq.onnx_in.view",
        "OnnxQuantizeResult": "qdq.onnx_in.quantize",
        "PreparedModel": "qdq.onnx_in.prepared",
        "quantize_onnx": "qdq.onnx_in.quantize",
    },
)

"""Block-quantized weights for the MatMuls a Q/DQ file runs in float: ONNX Runtime's ``MatMulNBits``.

A MatMul whose activation input is float (no DequantizeLinear before it: a tensor left float, or an op the target
does not run in int8) and whose weight is a constant 2-D float matrix can run as ``com.microsoft.MatMulNBits``:
the weight stored in ``bits`` (4 or 8) bits in blocks of ``block_size`` along its reduction axis, one scale per
block (symmetric), and, at ``accuracy_level=4``, the activation quantized to int8 per block of each row at run
time, so the product runs on ONNX Runtime's int8 kernels. It is a precision between the file's static per-tensor
int8 and float: the activation's range is taken per row and block, never calibrated. The rewrite itself is ONNX
Runtime's own quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``), applied to the chosen nodes only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from qdq.graphs.ir_graph import const, source

if TYPE_CHECKING:
    import onnx

__all__ = ["float_weight_matmuls", "matmul_nbits"]

#: ``MatMulNBits``'s compute mode for the activation: 4 = int8, quantized per block at run time.
INT8_ACTIVATIONS = 4


def float_weight_matmuls(model: onnx.ModelProto) -> list[str]:
    """The MatMuls of ``model`` that run in float on a constant 2-D float weight: their activation is not a
    DequantizeLinear's output and their second input is a float initializer (not a dequantized int8 one)."""
    import onnx_ir as ir

    found = []
    for node in ir.serde.deserialize_model(model).graph:  # read only: nothing to serialize back
        if node.op_type != "MatMul" or not node.name:
            continue
        producer, weight = source(node.inputs[0]), const(node.inputs[1])
        floating = weight is not None and weight.ndim == 2 and weight.dtype.kind == "f"
        if floating and (producer is None or producer.op_type != "DequantizeLinear"):
            found.append(node.name)
    return found


def matmul_nbits(model: onnx.ModelProto, nodes: Sequence[str], bits: int = 8,
                 block_size: int = 32) -> onnx.ModelProto:  # fmt: skip
    """``model`` with the MatMuls named in ``nodes`` as ``MatMulNBits`` (``bits``-bit symmetric weights in blocks
    of ``block_size`` along the reduction axis; int8 activations per block at run time). ``model`` is unchanged.

    Raises:
        ValueError: ``bits`` other than 4 or 8, or a ``block_size`` that is not a power of two >= 16 (what
            ``MatMulNBits`` accepts).
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits weights are 4 or 8 bits here, got bits={bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"MatMulNBits blocks are a power of two >= 16, got block_size={block_size}")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                          accuracy_level=INT8_ACTIVATIONS, bits=bits)  # fmt: skip
    quantizer = MatMulNBitsQuantizer(copy, nodes_to_include=list(nodes), algo_config=config)
    with _quiet("onnxruntime.quantization"):
        quantizer.process()
    return quantizer.model.model


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """ONNX Runtime's quantizer logs a line per node at INFO level: silence its loggers for the rewrite."""
    loggers = [logging.getLogger(key) for key in list(logging.root.manager.loggerDict) if key.startswith(name)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)

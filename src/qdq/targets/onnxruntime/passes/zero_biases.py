"""Biases of zeros dropped: a ``Gemm`` whose bias is a constant of zeros loses it (the same product).

``QGemm`` adds an int32 bias by writing it over its whole output before accumulating the product onto it, a pass
that costs a large share of the GEMM at transformer sizes (benchmarks/RESULTS.md, code_figures), even when every
entry is 0. Zero biases come from :mod:`qdq.placement.attention_biases` (the key and value projections, folded) and
from models trained with them frozen at 0. Runs after :mod:`.packed_projections` (whose per-part Gemms take their
slice of the packed bias) and before :mod:`.float_biases` and :mod:`.biases`, while biases are float constants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdq.graphs.ir_graph import const_input

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["drop_zero_biases"]


def drop_zero_biases(graph: ir.Graph) -> int:
    """Remove each ``Gemm``'s constant all-zero bias input; returns how many were removed."""
    count = 0
    for gemm in graph:
        if gemm.op_type != "Gemm" or len(gemm.inputs) < 3 or gemm.inputs[2] is None:
            continue
        bias = const_input(gemm, 2)
        if bias is not None and not np.any(bias):
            gemm.resize_inputs(2)
            count += 1
    return count

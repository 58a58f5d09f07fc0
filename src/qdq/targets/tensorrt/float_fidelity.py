"""How far a low-precision Q/DQ graph is from its float32 reference, quantizer by quantizer, in ONNX Runtime.

:func:`compare_graphs` runs both graphs on the same inputs with every QuantizeLinear's int8 output exposed,
matched by quantizer name (node metadata ``qdq.quantizer``), and reports per quantizer the fraction of
int8 codes that agree, plus the output error in int8 steps of the reference output (``max |ref| / 127``) and
the top-1 agreement. It also checks each of the candidate's QuantizeLinear nodes against the definition
``clamp(round_half_even(float32(x) / float32(scale)))`` on the input ONNX Runtime gave it (``q_exact``): a
disagreement there would be the runtime's, not float16 arithmetic upstream.

Compare against :func:`qdq.targets.tensorrt.float_scales.round_scales` of the float32 export: its steps are the low
type's, so what remains is float16 (bfloat16) arithmetic alone. ONNX Runtime's CPU provider runs FP16
graphs (it adds FP32 kernels with Casts where it has no FP16 one); it has no BF16 DequantizeLinear.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qdq.graphs.ir_graph import const
from qdq.graphs.onnx_session import ort_session, outputs_of, probe_model
from qdq.graphs.onnx_tags import quantizer_names
from qdq.markdown import markdown_table
from qdq.targets.tensorrt.float_ranges import Batch, feeds

__all__ = ["GraphComparison", "compare_graphs", "weight_bytes"]

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass
class GraphComparison:
    """Result of :func:`compare_graphs`.

    Attributes:
        agreement: quantizer -> fraction of its int8 codes equal in both graphs (activation quantizers).
        q_exact: quantizer -> whether the candidate's QuantizeLinear matches the definition on its own input
            (those whose scale is a constant).
        max_steps: largest output difference in int8 steps of the reference output (``max |ref| / 127``).
        rel_error: ``||candidate - reference|| / ||reference||`` over all outputs (L2).
        top1: fraction of samples whose argmax (last axis) agrees; ``samples``: how many were compared.
    """

    agreement: dict[str, float] = field(default_factory=dict)
    q_exact: dict[str, bool] = field(default_factory=dict)
    max_steps: float = 0.0
    rel_error: float = 0.0
    top1: float = 1.0
    samples: int = 0

    @property
    def min_agreement(self) -> float:
        return min(self.agreement.values(), default=1.0)

    @property
    def mean_agreement(self) -> float:
        return float(np.mean(list(self.agreement.values()))) if self.agreement else 1.0

    def __str__(self) -> str:
        exact = sum(self.q_exact.values())
        head = (f"{len(self.agreement)} quantizers: codes agree on {100 * self.mean_agreement:.3f} % (mean), "
                f"{100 * self.min_agreement:.3f} % (worst); {exact}/{len(self.q_exact)} QuantizeLinear nodes exact "
                f"on their own input; output within {self.max_steps:.2f} int8 steps (relative L2 error "
                f"{self.rel_error:.2e}), top-1 agreement "
                f"{100 * self.top1:.2f} % of {self.samples}")  # fmt: skip
        worst = sorted(self.agreement.items(), key=lambda kv: kv[1])[:5]
        rows = [[name, f"{100 * value:.3f} %"] for name, value in worst]
        return head + ("\n\n" + markdown_table(["quantizer (5 worst)", "codes equal"], rows) if rows else "")


def _session(model: Any) -> tuple[Any, dict[str, tuple[str, np.ndarray | None, str]]]:
    """An ORT session of ``model`` exposing every Q output; quantizer -> (Q input name, its constant step or None,
    Q output name)."""
    import onnx_ir as ir

    exposed: dict[str, tuple[str, np.ndarray | None, str]] = {}
    for node in ir.serde.deserialize_model(model).graph:
        names = quantizer_names(node) if node.op_type == "QuantizeLinear" else []
        x = node.inputs[0] if names else None
        if x is not None and x.name and const(x) is None:
            exposed.setdefault(names[0], (x.name, const(node.inputs[1]), node.outputs[0].name or ""))
    tensors = [t for x, _, q in exposed.values() for t in (x, q)]
    # ORT 1.32's NCHWc layout pass crashes the process on some FP16 graphs (a torchvision ViT): leave it out; the
    # factory runs a float16 Q/DQ graph without optimizations at all, as TensorRT computes it
    return ort_session(probe_model(model, tensors), disabled_optimizers=("NchwcTransformer",)), exposed


def _run(session: Any, batch: Batch) -> dict[str, np.ndarray]:
    return outputs_of(session, feeds([i.name for i in session.get_inputs()], batch))


def _oracle(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(np.divide(x.astype(np.float32), scale.astype(np.float32), dtype=np.float32)), -128, 127)


def compare_graphs(reference: Any, candidate: Any, batches: Iterable[Batch]) -> GraphComparison:
    """Compare two Q/DQ graphs of one model (``onnx.ModelProto`` or paths) on ``batches`` in ONNX Runtime."""
    import onnx

    ref_model = reference if isinstance(reference, onnx.ModelProto) else onnx.load(str(reference))
    cand_model = candidate if isinstance(candidate, onnx.ModelProto) else onnx.load(str(candidate))
    ref, ref_sites = _session(ref_model)
    cand, cand_sites = _session(cand_model)
    output = ref.get_outputs()[0].name
    equal: dict[str, list[int]] = {}
    result = GraphComparison()
    ref_outs, cand_outs = [], []
    for batch in batches:
        got_ref, got = _run(ref, batch), _run(cand, batch)
        ref_outs.append(got_ref[output])
        cand_outs.append(got[cand.get_outputs()[0].name].astype(np.float32))
        for name, (x, step, q) in cand_sites.items():
            codes = got[q]
            if step is not None:  # a constant step (TensorRT takes no other): the codes it gives, exactly
                exact = np.array_equal(_oracle(got[x], step), codes.astype(np.float32))
                result.q_exact[name] = result.q_exact.get(name, True) and exact
            if name in ref_sites:
                counts = equal.setdefault(name, [0, 0])
                counts[0] += int(np.count_nonzero(got_ref[ref_sites[name][2]] == codes))
                counts[1] += codes.size
    result.agreement = {name: hit / total for name, (hit, total) in equal.items() if total}
    reference_out, candidate_out = np.concatenate(ref_outs), np.concatenate(cand_outs)
    unit = float(np.abs(reference_out).max()) / 127 or 1.0
    difference = reference_out.astype(np.float64) - candidate_out
    result.max_steps = float(np.abs(difference).max() / unit)
    result.rel_error = float(np.linalg.norm(difference) / (np.linalg.norm(reference_out.astype(np.float64)) or 1.0))
    result.top1 = float(np.mean(reference_out.argmax(-1) == candidate_out.argmax(-1)))
    result.samples = int(reference_out.shape[0])
    return result


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of a graph's initializers by role: ``"float_layers"`` (float values read by ops that are not
    Q/DQ), ``"quantized_weights"`` (what a Q or a weight DQ reads: float32 before conversion, int8 codes
    after) and ``"other"`` (scales, zero points, shapes)."""
    import onnx
    import onnx_ir as ir

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    graph = ir.serde.deserialize_model(proto).graph
    sizes = {"float_layers": 0, "quantized_weights": 0, "other": 0}
    for value in graph.initializers.values():
        # (op type, input slot) of each read; a read inside a subgraph counts as its control-flow node's (no Q/DQ)
        reads = [(u.node.op_type if u.node.graph is graph else "", u.idx) for u in value.uses()]
        values = const(value)
        nbytes = 0 if values is None else int(values.nbytes)
        if any(op in _QDQ and slot == 0 for op, slot in reads):
            sizes["quantized_weights"] += nbytes
        elif (
            values is not None
            and values.dtype.kind == "f"
            and values.size > 1
            and any(op not in _QDQ for op, _ in reads)
        ):
            sizes["float_layers"] += nbytes
        else:
            sizes["other"] += nbytes
    return sizes

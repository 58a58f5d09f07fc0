"""``check_tensorrt``: does an ONNX graph follow TensorRT's explicit-quantization and strong-typing rules?

The rules, their ids and their sources are in :mod:`qdq.targets.tensorrt.engine_rules`. The check reads the
graph only (no TensorRT needed): it runs on any ONNX file, whoever wrote it, and reports every violation with
the node, the rule and what is wrong, plus counts that describe the graph (Q/DQ pairs, int8 ops, nodes
computing in each float type, FP32 nodes outside the allow-list). ``qdq check model.onnx --target tensorrt``
prints the same report and exits 1 on a violation.

FP32 allow-list: in a graph computing in FP16/BF16, a node may stay in FP32 when its op type is in
``fp32_ops`` (default :data:`FP32_OPS`, the op types the low-precision export keeps in FP32,
:mod:`qdq.targets.tensorrt.float_types`) or when the file's metadata records it (``qdq.float.fp32_nodes``,
written by the low-precision export with the reason).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError
from qdq.graphs.onnx_types import type_name
from qdq.markdown import markdown_table
from qdq.targets.tensorrt.engine_rules import RULES, GraphFacts, Violation, run_rules
from qdq.targets.tensorrt.engine_rules.facts import WEIGHTED
from qdq.targets.tensorrt.engine_rules.strong_typing import compute_precisions, fp32_allowed

__all__ = ["FP32_OPS", "CheckReport", "Violation", "check_tensorrt", "load_onnx"]

#: Op types that compute in FP32 inside an FP16/BF16 graph on purpose: exponentials, powers and sums over
#: many elements, whose intermediate values outgrow FP16 even when their inputs and outputs fit (the list
#: :mod:`qdq.targets.tensorrt.float_types` keeps in FP32; torch.autocast keeps the same ops in float32).
FP32_OPS = frozenset({"Exp", "Pow", "ReduceSum", "ReduceSumSquare", "ReduceProd", "ReduceL2", "ReduceLogSumExp",
                      "CumSum"})  # fmt: skip


@dataclass
class CheckReport:
    """The result of :func:`check_tensorrt`: violations and what the graph holds.

    Attributes:
        source: the file (or ``"<model>"``) that was checked.
        violations: every broken rule, in rule order.
        qdq_pairs: QuantizeLinear -> DequantizeLinear pairs; ``weight_dqs``: DQs of constant (int8) weights.
        int8_ops: Conv/ConvTranspose/Gemm/MatMul nodes whose two inputs are dequantized (TensorRT runs them in
            int8: strong typing gives each op its inputs' type); ``float_ops``: the others, node name -> op type.
        compute: float type name -> number of nodes computing in it.
        fp32_allowed: FP32 compute nodes the allow-list admits; ``fp32_outside``: those it does not
            (counted in a graph that computes in FP16/BF16; 0 in a pure FP32 graph).
    """

    source: str
    violations: list[Violation]
    qdq_pairs: int = 0
    weight_dqs: int = 0
    int8_ops: int = 0
    float_ops: dict[str, str] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)
    fp32_allowed: int = 0
    fp32_outside: int = 0

    @property
    def ok(self) -> bool:
        """True when no rule is broken."""
        return not self.violations

    def rules_broken(self) -> set[str]:
        """The ids of the rules with at least one violation."""
        return {v.rule for v in self.violations}

    def summary(self) -> str:
        """One line: PASS/FAIL, the violation count and what the graph holds."""
        verdict = "PASS" if self.ok else f"FAIL ({len(self.violations)} violations of {len(self.rules_broken())} rules)"
        compute = ", ".join(f"{n} {name}" for name, n in sorted(self.compute.items())) or "none"
        return (
            f"TensorRT check of {self.source}: {verdict}; {self.qdq_pairs} Q/DQ pairs, {self.weight_dqs} int8 "
            f"weights, {self.int8_ops} int8 ops; compute nodes by type: {compute}; FP32 nodes outside the "
            f"allow-list: {self.fp32_outside} ({self.fp32_allowed} allowed)"
        )

    def __str__(self) -> str:
        counts = Counter(v.rule for v in self.violations)
        rules = [[r.id, "PASS" if not counts[r.id] else f"FAIL ({counts[r.id]})", r.summary] for r in RULES.values()]
        parts = [self.summary(), "", markdown_table(["rule", "result", "TensorRT requires"], rules)]
        if self.violations:
            rows = [[v.node, v.rule, v.message] for v in self.violations]
            parts += ["", markdown_table(["node", "rule", "problem"], rows)]
        legend = (
            "Legend: one row per rule of TensorRT's explicit quantization and strong typing (sources in "
            "qdq.targets.tensorrt.engine_rules); FAIL (n): n nodes break it, listed with the problem."
        )
        parts += ["", legend]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ok": self.ok,
            "violations": [{"rule": v.rule, "node": v.node, "message": v.message} for v in self.violations],
            "qdq_pairs": self.qdq_pairs,
            "weight_dqs": self.weight_dqs,
            "int8_ops": self.int8_ops,
            "compute": dict(self.compute),
            "fp32_allowed": self.fp32_allowed,
            "fp32_outside": self.fp32_outside,
        }


def load_onnx(model_or_path: Any) -> tuple[Any, str]:
    """``(onnx.ModelProto, name)`` of a model or an ONNX file (weights in the file are not needed to check)."""
    import onnx

    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, "<model>"
    if not isinstance(model_or_path, str | Path):
        raise QdqTypeError(f"expected an onnx.ModelProto or a path, got {type(model_or_path).__name__}.")
    path = Path(model_or_path)
    if not path.is_file():
        raise QdqConfigError(f"{str(path)!r} is not a file.")
    try:
        return onnx.load(str(path)), path.name  # with its external data: the rules read scales and zero points
    except Exception as err:
        raise QdqConfigError(f"{str(path)!r} is not an ONNX model ({type(err).__name__}: {err}).") from err


def check_tensorrt(model_or_path: Any, *, fp32_ops: Iterable[str] = FP32_OPS) -> CheckReport:
    """Check an ONNX graph (a ``ModelProto`` or a path) against TensorRT's rules.

    Args:
        model_or_path: the graph to check; it is not modified.
        fp32_ops: op types allowed to compute in FP32 inside an FP16/BF16 graph (default :data:`FP32_OPS`).

    Returns:
        A :class:`CheckReport`; ``report.ok`` is True when no rule is broken, ``str(report)`` is the table.
    """
    model, name = load_onnx(model_or_path)
    facts = GraphFacts.of(model, fp32_ops)
    report = CheckReport(source=name, violations=run_rules(facts))
    _count(facts, report)
    return report


def _count(facts: GraphFacts, report: CheckReport) -> None:
    for node in facts.nodes:
        if node.op_type == "DequantizeLinear":
            if facts.q_of(node) is not None:
                report.qdq_pairs += 1
            elif facts.is_constant(node.inputs[0]):
                report.weight_dqs += 1
        elif node.op_type in WEIGHTED and len(node.inputs) > 1:
            if all(facts.quantized_source(node.inputs[i])[0] is not None for i in (0, 1)):
                report.int8_ops += 1
            else:
                report.float_ops[facts.name(node)] = node.op_type
    precisions = compute_precisions(facts)
    report.compute = dict(Counter(type_name(t) for t in precisions.values()))
    if any(t != 1 for t in precisions.values()):
        fp32 = [n for n in facts.nodes if precisions.get(id(n)) == 1]
        report.fp32_allowed = sum(fp32_allowed(facts, n) for n in fp32)
        report.fp32_outside = len(fp32) - report.fp32_allowed

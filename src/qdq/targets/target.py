"""What a target is: everything qdq knows about one runtime's int8 execution, in one object.

A :class:`Target` is built by its package (``qdq/targets/tensorrt/``, ``qdq/targets/onnxruntime/``) and
passed, as an object, to whatever needs it: placement runs its rules, export runs its ONNX rewrite with its
export defaults and records its name in the file, runtimes read that name back and ask it whether they run
its graphs. No code looks a target up by its own name from inside, and no code outside a target's package
asks which target it holds.

This module imports neither torch nor onnx.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qdq.errors import QdqConfigError, QdqTypeError, did_you_mean
from qdq.graphs.ops import ATTENTION_SITES
from qdq.runtime_registry import RUNTIME_REGISTRY, RuntimeEntry, find_runtime_entry
from qdq.targets.rules import PLACEMENT_RULES, PlacementRule

__all__ = ["VERDICTS", "AttentionFacts", "BlockWeights", "ExportDefaults", "FusionFacts", "RuntimeSupport", "Target",
           "WeightEncoding"]  # fmt: skip

_RESIDUAL_MODES = ("skip", "both")
#: How a runtime runs a target's graphs (:class:`RuntimeSupport`): what the target is made for, runs it with a
#: caveat (said to the user), cannot run it (loading it raises).
VERDICTS = ("native", "runs", "refuses")


@dataclass(frozen=True)
class FusionFacts:
    """How a runtime turns ``DequantizeLinear -> op -> QuantizeLinear`` groups into int8 kernels (ONNX op types).

    Attributes:
        int8_forms: float op -> ``(int8 kernel, indices of the inputs that must be dequantized)``; None
            means every input. The op's output must be read by a QuantizeLinear.
        int8_kernels: kernels that compute a Conv/Gemm/MatMul on integer data.
        float_kernels: kernels a weighted op runs in when it is not fused (fused variants included).
        folded_activations: activations dropped between an int8 op and its QuantizeLinear when that Q's zero
            point is its type's minimum (asymmetric, e.g. uint8 with zero point 0).
        int8_data_movers: ops run on int8 data directly when the DQ before and the Q after share parameters.
        layout_ops: ops that only move data (the runtime adds them around its kernels); graph walks look
            through them.
        mover_modes: data mover -> the values of its ``mode`` attribute the runtime moves on int8 data (a mover
            not listed: every mode). ONNX Runtime resizes int8 data only in ``nearest`` mode.
    """

    int8_forms: Mapping[str, tuple[str, tuple[int, ...] | None]]
    int8_kernels: frozenset[str]
    float_kernels: frozenset[str]
    folded_activations: frozenset[str]
    int8_data_movers: frozenset[str] = frozenset()
    layout_ops: frozenset[str] = frozenset()
    mover_modes: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "int8_forms", MappingProxyType(dict(self.int8_forms)))
        object.__setattr__(self, "mover_modes", MappingProxyType(dict(self.mover_modes)))

    def moves_int8(self, op_type: str, mode: str) -> bool:
        """Does the runtime run an ``op_type`` node of this ``mode`` attribute (its value, the op's default where
        the node has none) on int8 data, given a DQ before it and a Q after it with the same parameters?"""
        modes = self.mover_modes.get(op_type)
        return op_type in self.int8_data_movers and (modes is None or mode in modes)

    def fuses(self, op_type: str) -> bool:
        """Does the runtime have an int8 kernel for ``op_type`` between DQ and Q?"""
        return op_type in self.int8_forms

    def dequantized_inputs(self, op_type: str, n_inputs: int) -> tuple[int, ...]:
        """Indices of the inputs of an ``op_type`` node (with ``n_inputs`` inputs) that must be dequantized."""
        _, indices = self.int8_forms[op_type]
        return tuple(range(n_inputs)) if indices is None else tuple(i for i in indices if i < n_inputs)


@dataclass(frozen=True)
class AttentionFacts:
    """Which inputs of the two attention matmuls (``Q·Kᵀ`` and ``softmax·V``) a runtime runs in int8, and at which
    shapes.

    Placement gives every attention of a model placed for the target these facts (every ``Attention`` op of its
    view: a :class:`~qdq.nn.attention.QuantScaledDotProductAttention` module, attention an ONNX file writes out op by
    op): the tensors in :attr:`quantized` are quantized, the others stay float. With :attr:`head_sizes` or
    :attr:`max_length`, the shapes decide too: where the head size or the sequence length of the calibration data
    falls outside, none of the four is quantized (the matmuls stay float), and the front end says so.

    Attributes:
        quantized: the tensors to quantize, by their neutral names (:data:`~qdq.graphs.ops.ATTENTION_SITES`:
            ``"query"``, ``"key"``, ``"probs"``, ``"value"``); empty: attention stays float.
        head_sizes: the head sizes (last dimension of Q) the int8 kernel takes; None: any.
        max_length: the longest query or key sequence the int8 kernel takes; None: any.
        reason: one sentence: why the shapes matter (said when they leave attention float).
        scale_query: where the softmax scale multiplies: False, ``Q·Kᵀ`` (``(Q·Kᵀ) · scale``, the pattern
            TensorRT's fused attention matches); True, the query before its quantizer
            (``query_quantizer(Q · scale)·Kᵀ``): the same numbers for a power-of-two scale (head sizes 4, 16,
            64, 256...), and an ONNX rewrite can fold that ``Mul`` into the query's QuantizeLinear, where ONNX
            Runtime's int8 ``Q·Kᵀ`` kernel cannot take a scale after it.
        fold_biases: placement folds the key bias away and the value bias into the output Linear
            (:mod:`qdq.placement.attention_biases`: the same float function) where the target's int8 GEMM pays for
            a bias; the key and value projections then have none.
    """

    quantized: tuple[str, ...] = ATTENTION_SITES
    head_sizes: tuple[int, ...] | None = None
    max_length: int | None = None
    reason: str = ""
    scale_query: bool = False
    fold_biases: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.quantized) - set(ATTENTION_SITES))
        if unknown:
            raise QdqConfigError(f"attention facts name {unknown}; the quantized tensors are {list(ATTENTION_SITES)}.")
        if (self.head_sizes is not None or self.max_length is not None) and not self.reason:
            raise QdqConfigError("attention facts with shape limits need the reason (said to the user).")

    def outside(self, head_size: int, length: int) -> str | None:
        """Why attention with this head size and longest sequence stays float, or None when it fits."""
        if self.head_sizes is not None and head_size not in self.head_sizes:
            return f"head size {head_size} (not one of {list(self.head_sizes)})"
        if self.max_length is not None and length > self.max_length:
            return f"sequence length {length} (> {self.max_length})"
        return None


@dataclass(frozen=True)
class RuntimeSupport:
    """How one registered runtime (:mod:`qdq.runtime_registry`) runs a target's graphs.

    Attributes:
        runtime: the runtime: its registered entry (``ORT_RUNTIME``, ``OPENVINO_RUNTIME``, ``TENSORRT_RUNTIME``
            of :mod:`qdq.runtime_registry`, or one added with :func:`qdq.runtime.register_runtime`) or its name
            (an alias is accepted); stored as the registered name (``"onnxruntime"``).
        verdict: ``"native"`` (what the target is made for), ``"runs"`` (it runs, with the caveat ``reason``,
            which :mod:`qdq.runtime` reports), ``"refuses"`` (it cannot: loading the file raises with ``reason``).
        reason: one sentence: why (for ``"runs"`` and ``"refuses"``).
        entry: the runtime's registered :class:`~qdq.runtime_registry.RuntimeEntry` (set from ``runtime``).

    Raises:
        QdqConfigError: ``runtime`` is not a registered runtime (register the runtime before the targets that
            name it), or the verdict is unknown or lacks its reason.
    """

    runtime: str | RuntimeEntry  # the registered name once made
    verdict: str
    reason: str = ""
    entry: RuntimeEntry = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entry = _registered_runtime(self.runtime)
        object.__setattr__(self, "entry", entry)
        object.__setattr__(self, "runtime", entry.name)
        if self.verdict not in VERDICTS:
            raise QdqConfigError(f"runtime {self.runtime!r}: verdict must be one of {VERDICTS}, got {self.verdict!r}.")
        if self.verdict != "native" and not self.reason:
            raise QdqConfigError(f"runtime {self.runtime!r}: a {self.verdict!r} verdict needs its reason.")


def _registered_runtime(runtime: str | RuntimeEntry) -> RuntimeEntry:
    """The registered entry ``runtime`` names (an entry must be the registered one of its name)."""
    if isinstance(runtime, RuntimeEntry):
        found = RUNTIME_REGISTRY.find(runtime.name)
        name = runtime.name
    elif isinstance(runtime, str):
        found, name = find_runtime_entry(runtime), runtime
    else:
        raise QdqTypeError(f"RuntimeSupport names a runtime by its registered entry or name, got {runtime!r}.")
    if found is None or (isinstance(runtime, RuntimeEntry) and found is not runtime):
        names = sorted(RUNTIME_REGISTRY)
        raise QdqConfigError(
            f"RuntimeSupport names runtime {name!r}, which is not registered (registered: {names})."
            f"{did_you_mean(name, names)} Register the runtime first (qdq.runtime.register_runtime(backend)), then "
            "the targets that name it."
        )
    return found


@dataclass(frozen=True)
class WeightEncoding:
    """How the int8 weights of a Q/DQ graph are stored as uint8 (zero point + 128: the same dequantized values), for
    CPUs whose int8 dot products saturate (:mod:`qdq.cpu`: x86 without VNNI).

    A target whose runtime has kernels for uint8 weights records it (``"onnxruntime"``: its export option
    ``weights``); the CPU runtimes re-encode a file with it before compiling (:mod:`qdq.runtime.saturation`).

    Attributes:
        recorded: ``recorded(model) -> "int8" | "uint8" | None``: the encoding an ``onnx.ModelProto`` says its export
            chose (None: the file says nothing).
        to_uint8: ``to_uint8(model) -> count``: re-encode, in place, the int8 weights of more than 64 levels (those
            a saturating CPU gets wrong) as uint8; how many were.
    """

    recorded: Callable[[Any], str | None]
    to_uint8: Callable[[Any], int]

    def __post_init__(self) -> None:
        if not (callable(self.recorded) and callable(self.to_uint8)):
            raise QdqTypeError("WeightEncoding takes two callables: recorded(model) and to_uint8(model).")


@dataclass(frozen=True)
class BlockWeights:
    """How the target's runtime runs a float MatMul on a constant weight with block-quantized weights
    (``"onnxruntime"``: ``com.microsoft.MatMulNBits``), a precision between the file's int8 and float. A runtime with
    kernels for it declares their widths (:attr:`qdq.runtime.Backend.block_weight_bits`) and reads the rewrite from
    the targets made for it; :func:`qdq.tune` tries it on the MatMuls a configuration leaves float.

    Attributes:
        matmuls: ``matmuls(model) -> [node name]``: the MatMuls of an ``onnx.ModelProto`` that run in float on a
            constant 2-D float weight.
        convert: ``convert(model, nodes, bits) -> model``: a copy with the MatMuls ``nodes`` on ``bits``-bit block
            weights (``model`` unchanged).
    """

    matmuls: Callable[[Any], list[str]]
    convert: Callable[[Any, Sequence[str], int], Any]

    def __post_init__(self) -> None:
        if not (callable(self.matmuls) and callable(self.convert)):
            raise QdqTypeError("BlockWeights takes two callables: matmuls(model) and convert(model, nodes, bits).")


@dataclass(frozen=True)
class ExportDefaults:
    """What :func:`qdq.export.export_onnx` uses for a target when the call does not say.

    Attributes:
        opset: ONNX opset (None: the exporter's own default, 18 for dynamo).
        options: the target's ONNX rewrite options (``"onnxruntime"``: ``{"weights": "auto"}``, the weight
            encoding); the call's ``target_options`` override them one by one.
    """

    opset: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


Rewrite = Callable[..., dict[str, int]]
#: ``step_type(options) -> "float32" | "float16" | "bfloat16"``: the float type of a target's exported steps.
StepType = Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class Target:
    """One runtime a model can be quantized and exported for.

    Attributes:
        name: what users pass as ``QuantConfig(target=...)``, ``apply_placement(target=...)``,
            ``export_onnx(target=...)``, and what the exported file records (``qdq.target``).
        description: one line for listings.
        placement_rules: the :class:`~qdq.targets.rules.PlacementRule` s applied in order (a registered rule's
            name is accepted and replaced by the rule).
        residual_add: which inputs of an add that follows a weighted op get quantized: ``"skip"`` (the ones
            the runtime does not fuse into the weighted op), ``"both"``.
        onnx_rewrite: ``rewrite(model: onnx.ModelProto, **options) -> {edit: count}``, run on the exported
            graph (its options are keyword-only), or None.
        fusion: which ONNX op groups the runtime turns into int8 kernels, or None when qdq records none.
        export: the export defaults (:class:`ExportDefaults`).
        runtimes: how each runtime runs this target's graphs (:class:`RuntimeSupport`); a runtime not listed
            is not known to run them well or badly.
        step_type: ``step_type(options) -> float type``: the type (``"float32"``, ``"float16"``,
            ``"bfloat16"``) the quantization steps of an export with these rewrite options are numbers of; None
            means float32 always. Placement gives the model's quantizers that type
            (:attr:`qdq.quantizer.TensorQuantizer.step_type`), so that they quantize on the file's grid.
        attention: which attention-matmul inputs run in int8, and at which shapes (:class:`AttentionFacts`;
            default: all four, any shape).
        rule_check: ``rule_check(model_or_path) -> report``: checks any ONNX graph against the rules of the runtime
            the target is made for (the report has ``ok``, ``violations`` with ``node`` / ``rule`` / ``message``,
            ``str()`` and ``to_dict()``), or None. The runtime checks a file with it before building
            (:mod:`qdq.runtime.tensorrt`), ``qdq check`` prints it.
        weight_encoding: how the target's runtime stores int8 weights as uint8 where the CPU saturates
            (:class:`WeightEncoding`), or None.
        block_weights: how the target's runtime runs a float MatMul with block-quantized weights
            (:class:`BlockWeights`), or None.
    """

    name: str
    description: str = ""
    placement_rules: tuple[PlacementRule, ...] = ()
    residual_add: str = "skip"
    onnx_rewrite: Rewrite | None = None
    fusion: FusionFacts | None = field(default=None, repr=False)
    export: ExportDefaults = field(default_factory=ExportDefaults, repr=False)
    runtimes: tuple[RuntimeSupport, ...] = field(default=(), repr=False)
    step_type: StepType | None = field(default=None, repr=False)
    attention: AttentionFacts = field(default_factory=AttentionFacts, repr=False)
    rule_check: Callable[[Any], Any] | None = field(default=None, repr=False)
    weight_encoding: WeightEncoding | None = field(default=None, repr=False)
    block_weights: BlockWeights | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QdqTypeError(f"a target name is a non-empty string, got {self.name!r}.")
        object.__setattr__(self, "placement_rules", tuple(_rule(self.name, r) for r in self.placement_rules))
        if self.residual_add not in _RESIDUAL_MODES:
            raise QdqConfigError(f"target {self.name!r}: residual_add must be one of {_RESIDUAL_MODES}.")
        if self.onnx_rewrite is not None and not callable(self.onnx_rewrite):
            raise QdqTypeError(
                f"target {self.name!r}: onnx_rewrite must be a callable rewrite(model, **options), got "
                f"{type(self.onnx_rewrite).__name__}."
            )
        if self.fusion is not None and not isinstance(self.fusion, FusionFacts):
            raise QdqTypeError(f"target {self.name!r}: fusion must be a FusionFacts or None.")
        if not isinstance(self.export, ExportDefaults):
            raise QdqTypeError(f"target {self.name!r}: export must be an ExportDefaults.")
        object.__setattr__(self, "runtimes", tuple(self.runtimes))
        if not all(isinstance(r, RuntimeSupport) for r in self.runtimes):
            raise QdqTypeError(f"target {self.name!r}: runtimes are RuntimeSupport entries.")
        for support in self.runtimes:  # still the registered runtime of that name (none unregistered since)
            if RUNTIME_REGISTRY.find(support.entry.name) is not support.entry:
                raise QdqConfigError(
                    f"target {self.name!r} names runtime {support.entry.name!r}, which is no longer registered; "
                    "register the runtime again before the target."
                )
        if self.step_type is not None and not callable(self.step_type):
            raise QdqTypeError(f"target {self.name!r}: step_type must be a callable step_type(options) or None.")
        if not isinstance(self.attention, AttentionFacts):
            raise QdqTypeError(f"target {self.name!r}: attention must be an AttentionFacts.")
        if self.rule_check is not None and not callable(self.rule_check):
            raise QdqTypeError(f"target {self.name!r}: rule_check must be a callable rule_check(model) or None.")
        if self.weight_encoding is not None and not isinstance(self.weight_encoding, WeightEncoding):
            raise QdqTypeError(f"target {self.name!r}: weight_encoding must be a WeightEncoding or None.")
        if self.block_weights is not None and not isinstance(self.block_weights, BlockWeights):
            raise QdqTypeError(f"target {self.name!r}: block_weights must be a BlockWeights or None.")

    @property
    def rule_names(self) -> tuple[str, ...]:
        """The names of :attr:`placement_rules`, in order."""
        return tuple(rule.name for rule in self.placement_rules)

    @property
    def native_runtime(self) -> str | None:
        """The name of the first runtime this target is made for (its default runtime), or None."""
        return next((str(support.runtime) for support in self.runtimes if support.verdict == "native"), None)

    def support(self, runtime: str | RuntimeEntry) -> RuntimeSupport | None:
        """How ``runtime`` (a registered entry, or a name or alias) runs this target's graphs, or None when the
        target does not say."""
        if isinstance(runtime, RuntimeEntry):
            name = runtime.name
        else:
            found = find_runtime_entry(runtime)
            name = runtime if found is None else found.name
        return next((entry for entry in self.runtimes if entry.runtime == name), None)

    def export_options(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """The rewrite options of an export: the target's defaults, overridden by ``given``."""
        return {**self.export.options, **dict(given or {})}

    def check_options(self, options: Mapping[str, Any] | None) -> None:
        """Raise ``QdqConfigError`` when ``options`` name one the target's rewrite does not take."""
        if not options:
            return
        if self.onnx_rewrite is None:
            raise QdqConfigError(f"target {self.name!r} has no ONNX rewrite, so no options: {sorted(options)}.")
        _check_options(self.name, self.onnx_rewrite, options)

    def step_float_type(self, given: Mapping[str, Any] | None = None) -> str:
        """The float type of the quantization steps of an export with the options ``given`` (over the target's
        defaults): ``"float32"`` unless the target's :attr:`step_type` says otherwise."""
        return "float32" if self.step_type is None else self.step_type(self.export_options(given))

    def rewrite_onnx(self, model: Any, **options: Any) -> dict[str, int]:
        """Apply the target's ONNX rewrite to ``model`` (an ``onnx.ModelProto``) in place; counts of edits.

        ``options`` are the rewrite's keyword options (``"onnxruntime"``: ``weights``); one it does not take
        raises ``QdqConfigError`` naming those it does.
        """
        self.check_options(options)
        if self.onnx_rewrite is None:
            return {}
        return self.onnx_rewrite(model, **options)

    def require_fusion(self) -> FusionFacts:
        """The target's fusion facts; raises when it has none."""
        if self.fusion is None:
            raise QdqConfigError(f"target {self.name!r} records no fusion facts.")
        return self.fusion


def _rule(target: str, rule: PlacementRule | str) -> PlacementRule:
    if isinstance(rule, PlacementRule):
        return rule
    if isinstance(rule, str):
        return PLACEMENT_RULES.get(rule)  # an unknown name raises with the registered ones
    raise QdqTypeError(f"target {target!r}: placement_rules are PlacementRule objects or rule names (strings).")


def _check_options(target: str, rewrite: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Refuse options the rewrite function has no keyword-only parameter for."""
    if not options:
        return
    accepted = [p.name for p in inspect.signature(rewrite).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise QdqConfigError(
            f"target {target!r} takes the export options {accepted or 'none'}; got unknown {unknown}."
            f"{did_you_mean(unknown[0], accepted)}"
        )

"""Q/DQ placement: where a quantized model needs quantizers beyond its Conv/Linear inputs and weights.

``quantize_model`` quantizes the inputs and weights of weighted modules. A runtime needs a few more
quantizers, at places torch writes as *functions* in ``forward`` (``out += identity``, ``torch.cat``), which
module replacement cannot reach. :func:`apply_placement` traces the model with ``torch.fx``, applies the
placement rules of a target to the graph, and returns the rewritten model (a ``torch.fx.GraphModule``
with the same parameters, buffers and ``state_dict`` keys, plus the added quantizers)::

    model = quantize_model(torchvision.models.resnet18())
    model = apply_placement(model, target="tensorrt")   # then calibrate, fine-tune, export

Which rules run for a target, and how residual adds are treated, is recorded in that target's
registration (:mod:`qdq.targets`). The rules:

* ``residual_add``: an ``a + b`` (``+=``, ``torch.add``) one of whose inputs comes from a weighted op
  (Conv/ConvTranspose/Linear/MatMul, possibly through BatchNorm, an activation, Dropout or stochastic
  depth, each used once) becomes a :class:`~qdq.nn.QuantAdd`. With the target's ``residual_add="skip"``
  (TensorRT) it quantizes the *other* input only: TensorRT then fuses the weighted op and the add, with int8
  in and out; the first such input (in argument order) stays float, as in the seed TF toolkit's
  ``ResidualConnectionQDQCase``. With ``"both"`` (ONNX Runtime's ``QLinearAdd``) it quantizes both inputs.
  Adds with no weighted input are left alone (a Q/DQ the runtime cannot fuse only costs time).
* ``concat``: ``torch.cat`` becomes a :class:`~qdq.nn.QuantConcat`: one scale shared by every input. Skipped
  when every consumer of the concatenation already quantizes it (their own quantizer gives the shared scale).
* Outputs of weighted ops, BatchNorm and ReLU are not quantized by these two: TensorRT fuses them.

Rules for runtimes whose int8 kernels need quantized *outputs* (``target="onnxruntime"``; see
``qdq.export.ort_target``):

* ``conv_output``: the output of every Conv/ConvTranspose, after its BatchNorm and an activation the target
  folds into the int8 conv (ReLU/ReLU6 for ONNX Runtime: Relu/Clip) if any, is quantized (``DQ -> Conv -> Q``
  is what becomes ``QLinearConv``), unless every consumer already quantizes it (looking through Dropout /
  stochastic depth). A conv followed by anything else (SiLU, Sigmoid, an add, a pool) is quantized right
  after its BatchNorm;
* ``silu``: a SiLU of a quantized tensor is written ``x * sigmoid(x)`` (the ONNX form), and
  ``sigmoid_output`` quantizes the output of a Sigmoid of a quantized tensor: ORT then runs SiLU and the
  squeeze-excitation gates as ``QLinearSigmoid`` and ``QLinearMul`` instead of float ops between Q/DQ;
* ``mul_inputs``: a ``tensor * tensor`` with one operand quantized and its output quantized by every consumer
  gets its other operand quantized (``QLinearMul``; the squeeze-excitation product of EfficientNet), by the
  quantizer another reader already applies to it when there is one (ORT fuses only a tensor with one Q);
* ``unsigned_activations``: a quantizer whose input is non-negative by construction (after ReLU, ReLU6,
  Sigmoid, or pooling/reshaping of such) becomes unsigned: uint8 over the same range ``[0, amax]``, step
  ``amax / 255``. ONNX Runtime drops a ReLU/Clip before such a Q and fuses the Conv. The PyTorch model carries
  these quantizers, so what is trained and calibrated is what ORT computes.

The placed model remembers its target (:func:`qdq.targets.placed_target`; ``export_onnx`` defaults to it).
When placement builds a new model, the one passed in is marked stale: running or exporting it raises, so the
returned model is the one to use.

Extending: :func:`register_placement_rule` adds a rule (the counterpart of the TF toolkit's
``CustomQDQInsertionCase``): a function ``rule(ctx: PlacementContext) -> None`` that edits
``ctx.graph_module.graph`` with the context's helpers. :func:`function_inputs_rule` builds the common case
"quantize inputs of every call to these functions" (e.g. the squeeze-excitation ``mul`` of EfficientNet).

Fallback: when ``torch.fx`` cannot trace the whole model (data-dependent control flow), each child module
is placed on its own, recursively, with a warning; adds in the untraceable ``forward`` itself stay float
(use :class:`~qdq.nn.QuantAdd` there by hand).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from qdq.descriptor import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor
from qdq.errors import QdqConfigError, QdqTypeError
from qdq.nn.base import QuantInputMixin
from qdq.nn.elementwise import QuantAdd, QuantConcat, QuantMatMul
from qdq.quantizer import TensorQuantizer
from qdq.registry import Registry
from qdq.targets import (
    DEFAULT_TARGET,
    Target,
    add_placement_rule,
    check_not_superseded,
    get_target,
    mark_placed,
    mark_superseded,
    placed_target,
    target_names,
)
from qdq.targets import remove_placement_rule as _remove_from_targets

__all__ = [  # and TARGETS, the registered target names (module __getattr__)
    "PLACEMENT_RULES",
    "PlacementContext",
    "apply_placement",
    "function_inputs_rule",
    "placement_rules",
    "register_placement_rule",
    "unregister_placement_rule",
]

_QDQ_LEAVES = (QuantInputMixin, TensorQuantizer, QuantAdd, QuantConcat, QuantMatMul)
_WEIGHTED_MODULES = (nn.modules.conv._ConvNd, nn.Linear, QuantMatMul)
_CONV_MODULES = (nn.modules.conv._ConvNd,)
_WEIGHTED_FUNCTIONS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
                       F.linear, torch.matmul, operator.matmul}  # fmt: skip
_NORM_MODULES = (nn.modules.batchnorm._BatchNorm,)
# The ONNX op each activation a runtime may fold into an int8 conv exports to (the target's fusion facts
# list which ops it folds).
_ACTIVATION_MODULE_OPS: dict[type, str] = {nn.ReLU: "Relu", nn.ReLU6: "Clip"}
_ACTIVATION_FUNCTION_OPS: dict[Any, str] = {F.relu: "Relu", torch.relu: "Relu", F.relu6: "Clip"}
_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.SiLU, nn.GELU, nn.LeakyReLU, nn.Hardswish, nn.Sigmoid,
                       nn.Tanh, nn.ELU, nn.Mish)  # fmt: skip
_PASS_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_ACTIVATION_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.silu, F.gelu, F.hardswish, torch.sigmoid, F.leaky_relu}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
_MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul}
_MUL_METHODS = {"mul", "mul_"}
_LEAF_CLASS_NAMES = {"StochasticDepth"}  # its forward bakes ``self.training`` into a traced call
_PASS_FUNCTION_NAMES = {"stochastic_depth", "dropout"}

# Non-negative by construction, and ops that keep a non-negative input non-negative.
_NONNEG_MODULES = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Hardsigmoid, nn.Softmax)
_NONNEG_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.sigmoid, F.sigmoid, F.hardsigmoid, F.softmax, torch.softmax}
_NONNEG_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "softmax"}
_KEEP_SIGN_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Flatten, nn.Upsample, *_PASS_MODULES)  # fmt: skip
_KEEP_SIGN_FUNCTIONS = {torch.flatten, torch.reshape, F.adaptive_avg_pool2d, F.adaptive_avg_pool1d,
                        F.adaptive_avg_pool3d, F.avg_pool2d, F.max_pool2d, F.interpolate, torch.squeeze,
                        torch.unsqueeze, torch.permute, torch.transpose}  # fmt: skip
_KEEP_SIGN_METHODS = {"view", "reshape", "flatten", "contiguous", "permute", "transpose", "squeeze", "unsqueeze",
                      "mean", "max"}  # fmt: skip
_NON_TENSOR_METHODS = {"size", "dim", "numel", "item", "tolist", "__len__", "nelement"}


# ------------------------------------------------------------------------------------------ context
@dataclass
class PlacementContext:
    """What a placement rule works on.

    Attributes:
        graph_module: the traced model; rules edit ``graph_module.graph`` (recompiled after all rules).
        target: the name of a registered target (``"tensorrt"``, ``"onnxruntime"``...); its registration is
            :attr:`target_spec`.
        quant_desc: descriptor of the quantizers rules add (per tensor).
        changes: one line per edit, for :attr:`summary`.
    """

    graph_module: fx.GraphModule
    target: str
    quant_desc: QuantDescriptor
    changes: list[str] = field(default_factory=list)

    @property
    def target_spec(self) -> Target:
        """The registered :class:`~qdq.targets.Target` named :attr:`target`."""
        return get_target(self.target)

    # --- reading the graph
    def module(self, node: fx.Node) -> nn.Module | None:
        """The submodule a ``call_module`` node calls, else None."""
        if node.op != "call_module":
            return None
        return self.graph_module.get_submodule(str(node.target))

    def is_weighted(self, node: fx.Node) -> bool:
        """Conv / ConvTranspose / Linear / MatMul (as a module or a function)."""
        module = self.module(node)
        if module is not None:
            return isinstance(module, _WEIGHTED_MODULES)
        return node.op == "call_function" and node.target in _WEIGHTED_FUNCTIONS

    def is_conv(self, node: fx.Node) -> bool:
        return isinstance(self.module(node), _CONV_MODULES)

    def is_tensor(self, node: Any) -> bool:
        """Best-effort: does ``node`` produce a tensor (not a size, a shape entry or a Python number)?"""
        if not isinstance(node, fx.Node):
            return False
        if node.op == "get_attr":
            return isinstance(_fetch_attr(self.graph_module, str(node.target)), torch.Tensor)
        if node.op == "call_method":
            return node.target not in _NON_TENSOR_METHODS
        if node.op == "call_function":
            if node.target in (getattr, len):
                return False
            if node.target is operator.getitem:
                return self.is_tensor(node.args[0])
            if getattr(node.target, "__module__", None) in ("_operator", "operator"):
                return any(self.is_tensor(a) for a in node.args)
        return True

    def follows_weighted(self, node: fx.Node) -> bool:
        """``node`` is a weighted op's output, possibly through BN, activation, dropout, and is read by one node.

        Each tensor on the way (``node`` included) must have a single reader, or the runtime cannot fuse.
        """
        if len(node.users) != 1:
            return False
        for _ in range(8):
            if self.is_weighted(node):
                return True
            if not self._is_passthrough(node):
                return False
            parent = node.args[0] if node.args else None
            if not isinstance(parent, fx.Node) or len(parent.users) != 1:
                return False
            node = parent
        return False

    def _is_passthrough(self, node: fx.Node) -> bool:
        module = self.module(node)
        if module is not None:
            return isinstance(module, (*_NORM_MODULES, *_ACTIVATION_MODULES, *_PASS_MODULES)) or (
                type(module).__name__ in _LEAF_CLASS_NAMES
            )
        if node.op == "call_function":
            return node.target in _ACTIVATION_FUNCTIONS or getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES
        return node.op == "call_method" and node.target in ("relu", "relu_")

    def input_quantizers(self, node: fx.Node) -> list[tuple[Any, TensorQuantizer]]:
        """``(input node, quantizer)`` pairs of the enabled input quantizers of a qdq module node."""
        module = self.module(node)
        pairs: list[tuple[Any, TensorQuantizer]] = []
        if isinstance(module, QuantInputMixin) and node.args:
            pairs.append((node.args[0], module.input_quantizer))
        elif isinstance(module, QuantAdd | QuantMatMul):
            pairs += list(zip(node.args[:2], module.input_quantizers))
        elif isinstance(module, QuantConcat) and node.args:
            pairs += [(arg, module.input_quantizer) for arg in node.args[0]]
        elif isinstance(module, TensorQuantizer) and node.args:
            pairs.append((node.args[0], module))
        return [(arg, q) for arg, q in pairs if q.is_quantizing]

    def quantized_by(self, user: fx.Node, node: fx.Node) -> bool:
        """Does ``user`` quantize ``node`` as it reads it?"""
        return any(arg is node for arg, _ in self.input_quantizers(user))

    # --- editing the graph
    def add_module(self, near: fx.Node, stem: str, module: nn.Module) -> str:
        """Register ``module`` in the submodule that owns ``near`` (from its module stack); return its name."""
        stack = [path for path in (near.meta.get("nn_module_stack") or {}) if path != near.target]
        owner = stack[-1] if stack else ""
        base = f"{owner}.{stem}" if owner else stem
        name, i = base, 1
        while _fetch_attr(self.graph_module, name) is not None:
            name, i = f"{base}_{i}", i + 1
        self.graph_module.add_submodule(name, module)
        return name

    def new_quantizer(self) -> TensorQuantizer:
        return TensorQuantizer(self.quant_desc)

    def replace_with_module(self, node: fx.Node, stem: str, module: nn.Module, args: tuple) -> fx.Node:
        """Replace ``node`` by a call of ``module`` on ``args``; return the new node."""
        name = self.add_module(node, stem, module)
        with self.graph_module.graph.inserting_after(node):
            new = self.graph_module.graph.call_module(name, args=args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph_module.graph.erase_node(node)
        return new

    def quantize_output(self, node: fx.Node, stem: str = "output_quantizer") -> fx.Node:
        """Insert a new quantizer after ``node``, read by every former user of ``node``."""
        name = self.add_module(node, stem, self.new_quantizer())
        with self.graph_module.graph.inserting_after(node):
            new = self.graph_module.graph.call_module(name, args=(node,))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        self.changes.append(f"{name}: quantize the output of {node.name}")
        return new

    def quantize_input(self, node: fx.Node, index: int, stem: str = "input_quantizer") -> fx.Node:
        """Insert a new quantizer on argument ``index`` of ``node`` only."""
        arg = node.args[index]
        if not isinstance(arg, fx.Node):
            raise QdqConfigError(f"argument {index} of {node.name} is not a graph value; cannot quantize it.")
        name = self.add_module(node, f"{stem}_{index}" if index else stem, self.new_quantizer())
        with self.graph_module.graph.inserting_before(node):
            new = self.graph_module.graph.call_module(name, args=(arg,))
        node.update_arg(index, new)
        self.changes.append(f"{name}: quantize input {index} of {node.name}")
        return new

    @property
    def summary(self) -> str:
        return "\n".join(self.changes) if self.changes else "no change"


def _fetch_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# ------------------------------------------------------------------------------------------ rules
Rule = Callable[[PlacementContext], None]


#: name -> rule. Which rules run for a target, in which order, is the target's ``placement_rules``.
PLACEMENT_RULES: Registry[str, Rule] = Registry("placement rule")


def register_placement_rule(
    name: str, rule: Rule | None = None, *, targets: Sequence[str] | None = None, override: bool = False
) -> Any:
    """Register a placement rule and append it to the rules of ``targets`` (default: every registered
    target); usable as a decorator.

    Example:
        >>> @register_placement_rule("my_mul", targets=("tensorrt",))  # doctest: +SKIP
        ... def quantize_mul(ctx):
        ...     for node in list(ctx.graph_module.graph.nodes):
        ...         if node.target is operator.mul:
        ...             ctx.quantize_input(node, 0)
    """
    chosen = target_names() if targets is None else tuple(targets)
    for target in chosen:
        get_target(target)  # unknown names raise before anything is registered

    def _register(fn: Rule) -> Rule:
        if not callable(fn):
            raise QdqTypeError(f"a placement rule must be callable, got {fn!r}.")
        PLACEMENT_RULES.register(name, fn, override=override)
        add_placement_rule(name, chosen)
        return fn

    return _register if rule is None else _register(rule)


def unregister_placement_rule(name: str) -> Rule:
    """Remove a rule, and remove it from every target's rules; returns it."""
    rule = PLACEMENT_RULES.unregister(name)
    _remove_from_targets(name)
    return rule


def placement_rules(target: str) -> list[str]:
    """Names of the rules applied for ``target``, in order."""
    return list(get_target(target).placement_rules)


# Built-in rules: the targets in qdq.targets list them by name.
_builtin_rule = PLACEMENT_RULES.decorator


def _add_operands(ctx: PlacementContext, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of an addition node, or None when it is not a tensor + tensor add."""
    is_add = (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in _ADD_METHODS
    )
    if not is_add or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if not (ctx.is_tensor(a) and ctx.is_tensor(b)) or a.op == "get_attr" or b.op == "get_attr":
        return None
    return a, b


@_builtin_rule("residual_add")
def residual_add_rule(ctx: PlacementContext) -> None:
    """Adds that follow a weighted op become QuantAdd: quantizing the skip input only (the target's
    ``residual_add="skip"``, TensorRT) or both inputs (``"both"``, ONNX Runtime)."""
    for node in list(ctx.graph_module.graph.nodes):
        operands = _add_operands(ctx, node)
        if operands is None:
            continue
        from_weighted = [ctx.follows_weighted(x) for x in operands]
        if not any(from_weighted):
            continue
        if ctx.target_spec.residual_add == "skip":
            fused = from_weighted.index(True)
            quantize = tuple(i != fused for i in range(2))
        else:
            quantize = (True, True)
        module = QuantAdd(ctx.quant_desc, quantize=quantize)
        new = ctx.replace_with_module(node, "residual_add", module, operands)
        ctx.changes.append(f"{new.target}: QuantAdd(quantize={quantize})")


@_builtin_rule("concat")
def concat_rule(ctx: PlacementContext) -> None:
    """``torch.cat`` becomes QuantConcat (one scale for all inputs) unless every consumer quantizes it."""
    for node in list(ctx.graph_module.graph.nodes):
        if not (node.op == "call_function" and node.target in (torch.cat, torch.concat)):
            continue
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(tensors, list | tuple) or not isinstance(dim, int):
            continue
        if node.users and all(ctx.quantized_by(user, node) for user in node.users):
            continue
        new = ctx.replace_with_module(node, "concat", QuantConcat(dim, ctx.quant_desc), (list(tensors),))
        ctx.changes.append(f"{new.target}: QuantConcat(dim={dim})")


def _onnx_activation(ctx: PlacementContext, node: fx.Node) -> str | None:
    """The ONNX op a ReLU / ReLU6 node exports to (``"Relu"``, ``"Clip"``), else None."""
    module = ctx.module(node)
    if module is not None:
        return _ACTIVATION_MODULE_OPS.get(type(module))
    return _ACTIVATION_FUNCTION_OPS.get(node.target) if node.op == "call_function" else None


def _conv_chain_end(ctx: PlacementContext, node: fx.Node) -> fx.Node:
    """Follow a conv's output through its BatchNorm and one activation the target folds into int8 convs
    (each used once)."""
    fusion = ctx.target_spec.fusion
    folded = fusion.folded_activations if fusion is not None else frozenset()
    if len(node.users) == 1 and isinstance(ctx.module(next(iter(node.users))), _NORM_MODULES):
        node = next(iter(node.users))
    if len(node.users) == 1 and _onnx_activation(ctx, next(iter(node.users))) in folded:
        node = next(iter(node.users))
    return node


def _is_identity(ctx: PlacementContext, node: fx.Node) -> bool:
    """Dropout, Identity or stochastic depth: the identity at inference."""
    module = ctx.module(node)
    if module is not None:
        return isinstance(module, _PASS_MODULES) or type(module).__name__ in _LEAF_CLASS_NAMES
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES


def _readers_quantize(ctx: PlacementContext, node: fx.Node) -> bool:
    """Does every reader of ``node`` quantize it (looking through a chain of single-reader identities)?"""
    while len(node.users) == 1 and _is_identity(ctx, next(iter(node.users))):
        node = next(iter(node.users))
    return bool(node.users) and all(ctx.quantized_by(user, node) for user in node.users)


@_builtin_rule("conv_output")
def conv_output_rule(ctx: PlacementContext) -> None:
    """Quantize each conv's output (after BN/ReLU) unless all its consumers already quantize it."""
    for node in list(ctx.graph_module.graph.nodes):
        if not ctx.is_conv(node):
            continue
        end = _conv_chain_end(ctx, node)
        if not _readers_quantize(ctx, end):
            ctx.quantize_output(end)


def _is_quantized(ctx: PlacementContext, node: Any) -> bool:
    """``node`` is the output of a quantizer (a :class:`~qdq.quantizer.TensorQuantizer` call)."""
    return isinstance(node, fx.Node) and isinstance(ctx.module(node), TensorQuantizer)


def _silu_input(ctx: PlacementContext, node: fx.Node) -> Any:
    """The input of a SiLU node (``nn.SiLU`` or ``F.silu``), else None."""
    functional = node.op == "call_function" and node.target is F.silu
    if not (functional or isinstance(ctx.module(node), nn.SiLU)):
        return None
    return node.args[0] if node.args else node.kwargs.get("input")


def _meta_outside(node: fx.Node) -> dict[str, Any]:
    """``node.meta`` with the module ``node`` calls left out of its module stack (new nodes then live in
    the module that called it, and so do quantizers added next to them)."""
    meta = dict(node.meta)
    stack = meta.get("nn_module_stack")
    if stack and node.op == "call_module":
        meta["nn_module_stack"] = {k: v for k, v in stack.items() if k != node.target}
    return meta


@_builtin_rule("silu")
def silu_rule(ctx: PlacementContext) -> None:
    """A SiLU of a quantized tensor is written ``x * sigmoid(x)``, as ONNX has it (Sigmoid, Mul), so that
    ``sigmoid_output`` can quantize the Sigmoid: ORT then runs both as QLinearSigmoid and QLinearMul."""
    graph = ctx.graph_module.graph
    for node in list(graph.nodes):
        x = _silu_input(ctx, node)
        if not _is_quantized(ctx, x):
            continue
        meta = _meta_outside(node)
        with graph.inserting_after(node):
            sigmoid = graph.call_function(torch.sigmoid, (x,))
        with graph.inserting_after(sigmoid):
            product = graph.call_function(operator.mul, (x, sigmoid))
        sigmoid.meta.update(meta)
        product.meta.update(meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        ctx.changes.append(f"{node.name}: SiLU written x * sigmoid(x)")


def _is_sigmoid(ctx: PlacementContext, node: fx.Node) -> bool:
    if isinstance(ctx.module(node), nn.Sigmoid):
        return True
    if node.op == "call_function":
        return node.target in (torch.sigmoid, F.sigmoid)
    return node.op == "call_method" and node.target == "sigmoid"


@_builtin_rule("sigmoid_output")
def sigmoid_output_rule(ctx: PlacementContext) -> None:
    """Quantize the output of a Sigmoid of a quantized tensor (``DQ -> Sigmoid -> Q`` is QLinearSigmoid)
    unless all its consumers already quantize it."""
    for node in list(ctx.graph_module.graph.nodes):
        if not (_is_sigmoid(ctx, node) and node.args and _is_quantized(ctx, node.args[0])):
            continue
        if node.users and all(ctx.quantized_by(user, node) for user in node.users):
            continue
        ctx.quantize_output(node, "sigmoid_quantizer")


def _mul_operands(ctx: PlacementContext, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensor operands of a ``tensor * tensor`` node, else None (constants and numbers excluded)."""
    is_mul = (node.op == "call_function" and node.target in _MUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MUL_METHODS
    )
    if not is_mul or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if not (ctx.is_tensor(a) and ctx.is_tensor(b)) or a.op == "get_attr" or b.op == "get_attr":
        return None
    return a, b


def _sibling_quantizer(ctx: PlacementContext, node: fx.Node) -> str | None:
    """Module name of a per-tensor quantizer another reader of ``node`` applies to it, if any."""
    for user in node.users:
        for arg, quantizer in ctx.input_quantizers(user):
            if arg is node and quantizer.axis is None:
                return next(name for name, m in ctx.graph_module.named_modules() if m is quantizer)
    return None


def _quantize_operand(ctx: PlacementContext, node: fx.Node, index: int) -> None:
    """Quantize argument ``index`` of ``node`` with the quantizer another reader already applies to it (one
    Q per tensor, as ORT needs), else with a new quantizer."""
    arg = node.args[index]
    shared = _sibling_quantizer(ctx, arg)  # type: ignore[arg-type]
    if shared is None:
        ctx.quantize_input(node, index)
        return
    with ctx.graph_module.graph.inserting_before(node):
        quantized = ctx.graph_module.graph.call_module(shared, args=(arg,))
    node.update_arg(index, quantized)
    ctx.changes.append(f"{shared}: also quantizes input {index} of {node.name}")


@_builtin_rule("mul_inputs")
def mul_inputs_rule(ctx: PlacementContext) -> None:
    """A ``tensor * tensor`` with one operand quantized and its output quantized by every consumer gets its
    other operand quantized too: ``DQ, DQ -> Mul -> Q`` is QLinearMul (EfficientNet's squeeze-excitation)."""
    for node in list(ctx.graph_module.graph.nodes):
        operands = _mul_operands(ctx, node)
        if operands is None or not any(_is_quantized(ctx, x) for x in operands):
            continue
        if not node.users or not all(ctx.quantized_by(user, node) for user in node.users):
            continue
        for index, x in enumerate(operands):
            if not _is_quantized(ctx, x):
                _quantize_operand(ctx, node, index)


def is_nonnegative(ctx: PlacementContext, node: Any, depth: int = 0) -> bool:
    """Is ``node`` non-negative by construction (ReLU, Sigmoid... possibly pooled or reshaped)?"""
    if not isinstance(node, fx.Node) or depth > 32:
        return False
    module = ctx.module(node)
    if module is not None:
        if isinstance(module, _NONNEG_MODULES) or (isinstance(module, nn.Hardtanh) and module.min_val >= 0):
            return True
        if isinstance(module, TensorQuantizer):
            return module.unsigned or is_nonnegative(ctx, node.args[0], depth + 1)
        if isinstance(module, QuantConcat):
            return all(is_nonnegative(ctx, a, depth + 1) for a in node.args[0])
        if isinstance(module, QuantAdd):
            return all(is_nonnegative(ctx, a, depth + 1) for a in node.args[:2])
        keeps = isinstance(module, _KEEP_SIGN_MODULES) or type(module).__name__ in _LEAF_CLASS_NAMES
        return keeps and is_nonnegative(ctx, node.args[0], depth + 1)
    if node.op == "call_function":
        if node.target in _NONNEG_FUNCTIONS:
            return True
        if node.target in _KEEP_SIGN_FUNCTIONS or getattr(node.target, "__name__", "") in _PASS_FUNCTION_NAMES:
            return is_nonnegative(ctx, node.args[0], depth + 1)
        if node.target in (operator.add, operator.mul, torch.cat):
            args = node.args[0] if node.target is torch.cat else node.args
            return all(is_nonnegative(ctx, a, depth + 1) for a in args if isinstance(a, fx.Node))
        return False
    if node.op == "call_method":
        if node.target in _NONNEG_METHODS:
            return True
        return node.target in _KEEP_SIGN_METHODS and is_nonnegative(ctx, node.args[0], depth + 1)
    return False


@_builtin_rule("unsigned_activations")
def unsigned_activations_rule(ctx: PlacementContext) -> None:
    """Quantizers of non-negative tensors become unsigned (uint8, zero point 0, step amax / 255).

    A quantizer read at several places (QuantConcat's shared quantizer) becomes unsigned only when every
    tensor it quantizes is non-negative.
    """
    inputs: dict[TensorQuantizer, list[Any]] = {}
    for node in ctx.graph_module.graph.nodes:
        for arg, quantizer in ctx.input_quantizers(node):
            inputs.setdefault(quantizer, []).append(arg)
    for quantizer, args in inputs.items():
        if quantizer.unsigned or quantizer.axis is not None:
            continue
        if all(is_nonnegative(ctx, arg) for arg in args):
            quantizer.unsigned = True
            quantizer.narrow_range = False
            ctx.changes.append(f"unsigned quantizer on {', '.join(a.name for a in args)} (>= 0)")


def function_inputs_rule(functions: Iterable[Any], indices: Sequence[int] | None = None) -> Rule:
    """A rule quantizing the tensor inputs ``indices`` (default: all) of every call to ``functions``.

    ``functions`` may hold callables (``operator.mul``, ``torch.matmul``) or method names (``"mul"``). The
    seed TF toolkit's EfficientNet case, for example, quantizes both inputs of the squeeze-excitation
    multiply: ``register_placement_rule("se_mul", function_inputs_rule([operator.mul]))``.
    """
    wanted = list(functions)

    def rule(ctx: PlacementContext) -> None:
        for node in list(ctx.graph_module.graph.nodes):
            if node.op not in ("call_function", "call_method") or node.target not in wanted:
                continue
            for index in indices if indices is not None else range(len(node.args)):
                if index < len(node.args) and ctx.is_tensor(node.args[index]):
                    ctx.quantize_input(node, index)

    return rule


def __getattr__(name: str) -> Any:
    if name == "TARGETS":  # the registered target names, as a tuple (qdq.targets holds the registry)
        return target_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------- tracing
class _Tracer(fx.Tracer):
    """Keeps torch.nn modules, qdq's quantized modules and the given classes as leaves."""

    def __init__(self, leaf_modules: tuple[type, ...] = ()) -> None:
        super().__init__()
        self._extra_leaves = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _QDQ_LEAVES + self._extra_leaves) or type(m).__name__ in _LEAF_CLASS_NAMES:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _trace(module: nn.Module, leaf_modules: tuple[type, ...]) -> fx.GraphModule:
    tracer = _Tracer(leaf_modules)
    graph = tracer.trace(module)
    gm = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
    gm.train(module.training)
    return gm


def _default_desc(model: nn.Module) -> QuantDescriptor:
    """Per-tensor descriptor matching the model's first input quantizer (bits, calibrator)."""
    for module in model.modules():
        if isinstance(module, QuantInputMixin):
            q = module.input_quantizer
            return QuantDescriptor(num_bits=q.num_bits, calib_method=q.calib_method, narrow_range=q.narrow_range)
    return QUANT_DESC_8BIT_PER_TENSOR


def _place(
    module: nn.Module, path: str, target: str, desc: QuantDescriptor, rules: list[str], leaves: tuple[type, ...]
) -> tuple[nn.Module, list[str]]:
    try:
        gm = _trace(module, leaves)
    except Exception as err:  # torch.fx raises many kinds (TraceError, TypeError, NotImplementedError...)
        return _place_children(module, path, target, desc, rules, leaves, err)
    ctx = PlacementContext(gm, target, desc)
    for name in rules:
        PLACEMENT_RULES.get(name)(ctx)
    if not ctx.changes:
        return module, []
    gm.graph.lint()
    gm.recompile()
    prefix = f"{path}: " if path else ""
    return gm, [prefix + line for line in ctx.changes]


def _place_children(
    module: nn.Module,
    path: str,
    target: str,
    desc: QuantDescriptor,
    rules: list[str],
    leaves: tuple[type, ...],
    err: Exception,
) -> tuple[nn.Module, list[str]]:
    warnings.warn(
        f"torch.fx cannot trace {path or type(module).__name__} ({type(err).__name__}: {err}); placing "
        "quantizers inside its children instead. Additions written in its own forward stay float: use "
        "qdq.nn.QuantAdd / QuantConcat there, or register it as a leaf (leaf_modules=...).",
        stacklevel=4,
    )
    changes: list[str] = []
    for name, child in list(module.named_children()):
        if isinstance(child, _QDQ_LEAVES + leaves):
            continue
        child_path = f"{path}.{name}" if path else name
        new, lines = _place(child, child_path, target, desc, rules, leaves)
        if new is not child:
            setattr(module, name, new)
        changes += lines
    return module, changes


def apply_placement(
    model: nn.Module,
    target: str = DEFAULT_TARGET,
    *,
    quant_desc: QuantDescriptor | None = None,
    rules: Sequence[str] | None = None,
    leaf_modules: Sequence[type] = (),
    verbose: bool = False,
) -> nn.Module:
    """Add the quantizers ``target`` needs beyond Conv/Linear inputs and weights (see the module doc).

    Usually called by :func:`qdq.quantize_model` (``QuantConfig(target=...)``); call it yourself after
    ``quantize_model`` and before calibration (the added quantizers are ordinary
    :class:`~qdq.quantizer.TensorQuantizer` modules, calibrated like the others). Use the returned model:
    when it is a new one, ``model`` is marked stale and raises when run or exported.

    Args:
        model: a model quantized with ``quantize_model`` (float modules are fine too).
        target: a registered target (``"tensorrt"``, ``"onnxruntime"``); the model computes what that
            target's export runs.
        quant_desc: descriptor of the added quantizers; default 8-bit per tensor with the calibrator of the
            model's first input quantizer.
        rules: names of the rules to apply (default: the target's ``placement_rules``, in order).
        leaf_modules: module classes not to trace into (kept as calls).
        verbose: print one line per change.

    Returns:
        A ``torch.fx.GraphModule`` computing the placed model (same parameters, same ``state_dict`` keys
        plus the added quantizers), or ``model`` itself when no rule changed anything. When the model
        cannot be traced, ``model`` with its traceable children replaced. Either way it remembers
        ``target`` (:func:`qdq.targets.placed_target`).

    Raises:
        QdqConfigError: an unknown target or rule, a model already placed for another target, or a stale
            model (one a previous placement replaced).
    """
    get_target(target)
    if not isinstance(model, nn.Module):
        raise QdqTypeError(f"apply_placement needs an nn.Module, got {type(model).__name__}.")
    check_not_superseded(model)
    previous = placed_target(model)
    if previous is not None and previous != target:
        raise QdqConfigError(
            f"this model is already placed for target {previous!r}; placing it for {target!r} too would mix "
            "both. Quantize a fresh copy of the float model for the other target."
        )
    names = placement_rules(target) if rules is None else list(rules)
    for name in names:
        PLACEMENT_RULES.get(name)  # unknown names raise with a suggestion
    desc = _default_desc(model) if quant_desc is None else quant_desc
    placed, changes = _place(model, "", target, desc, names, tuple(leaf_modules))
    mark_placed(placed, target)
    if placed is not model:
        mark_superseded(model, target)
    if verbose:
        print("\n".join(changes) if changes else "apply_placement: no change")
    return placed

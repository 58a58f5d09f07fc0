"""What a PyTorch placement rule works on: the traced model, and the questions and edits rules share.

A rule is a function ``rule(ctx: PlacementContext) -> None`` (:class:`qdq.targets.PlacementRule` holds it): it
reads ``ctx.graph_module.graph`` with the context's questions (is this node a weighted op? does every reader
of this tensor already quantize it?) and the op vocabulary of :mod:`qdq.graphs.fx_ops`, and edits it with the
context's helpers (:meth:`PlacementContext.quantize_output`, :meth:`~PlacementContext.quantize_input`,
:meth:`~PlacementContext.replace_with_module`), each of which records one line in :attr:`~PlacementContext.changes`.
:func:`qdq.placement.apply_placement` traces the model, builds the context for a target and runs the target's
rules.

A quantized module tells which quantizer reads each of its arguments
(:meth:`~qdq.nn.base.QuantModule.argument_quantizers`); the context never assumes an ``input_quantizer``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError
from qdq.graphs import fx_ops
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer

__all__ = ["PlacementContext", "fetch_attr"]

_NON_TENSOR_METHODS = {"size", "dim", "numel", "item", "tolist", "__len__", "nelement"}


def fetch_attr(root: nn.Module, target: str) -> Any:
    """``root``'s attribute at the dotted path ``target``, or None."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass
class PlacementContext:
    """What a placement rule works on.

    Attributes:
        graph_module: the traced model; rules edit ``graph_module.graph`` (recompiled after all rules).
        target: the :class:`qdq.targets.Target` the model is placed for (its ``name``, ``residual_add``,
            ``fusion`` facts...).
        quant_desc: descriptor of the quantizers rules add (per tensor).
        changes: one line per edit, for :attr:`summary`.
    """

    graph_module: fx.GraphModule
    target: Any
    quant_desc: QuantDescriptor
    changes: list[str] = field(default_factory=list)

    @property
    def target_spec(self) -> Any:
        """The target (the name of :attr:`target` before targets were passed as objects)."""
        return self.target

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
            return fx_ops.is_weighted_module(module)
        return fx_ops.is_weighted_function(node)

    def is_conv(self, node: fx.Node) -> bool:
        return isinstance(self.module(node), nn.modules.conv._ConvNd)

    def is_tensor(self, node: Any) -> bool:
        """Best-effort: does ``node`` produce a tensor (not a size, a shape entry or a Python number)?"""
        if not isinstance(node, fx.Node):
            return False
        if node.op == "get_attr":
            return isinstance(fetch_attr(self.graph_module, str(node.target)), torch.Tensor)
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
            if not fx_ops.is_passthrough(self, node):
                return False
            parent = node.args[0] if node.args else None
            if not isinstance(parent, fx.Node) or len(parent.users) != 1:
                return False
            node = parent
        return False

    def weighted_depth(self, node: fx.Node) -> int:
        """How many weighted ops the longest path from a graph input to ``node`` (included) goes through.

        The main branch of a residual block is deeper than its shortcut (three convs against one in a
        ResNet bottleneck), whichever order the model writes the two operands of the add in.
        """
        depth: dict[fx.Node, int] = {}
        for n in self.graph_module.graph.nodes:
            before = max((depth.get(a, 0) for a in n.all_input_nodes), default=0)
            depth[n] = before + int(self.is_weighted(n))
            if n is node:
                break
        return depth.get(node, 0)

    def input_quantizers(self, node: fx.Node) -> list[tuple[Any, TensorQuantizer]]:
        """``(argument node, quantizer)`` for each enabled quantizer ``node`` reads an argument through: a
        quantizer called on a tensor, or a quantized module's
        :meth:`~qdq.nn.base.QuantModule.argument_quantizers`."""
        module = self.module(node)
        pairs: list[tuple[Any, TensorQuantizer]] = []
        if isinstance(module, TensorQuantizer) and node.args:
            pairs.append((node.args[0], module))
        elif isinstance(module, QuantModule):
            for arg, quantizer in zip(node.args, module.argument_quantizers()):
                if quantizer is None:
                    continue
                elements = arg if isinstance(arg, list | tuple) else [arg]
                pairs += [(element, quantizer) for element in elements]
        return [(arg, q) for arg, q in pairs if q.is_quantizing]

    def quantized_by(self, user: fx.Node, node: fx.Node) -> bool:
        """Does ``user`` quantize ``node`` as it reads it?"""
        return any(arg is node for arg, _ in self.input_quantizers(user))

    def readers_quantize(self, node: fx.Node) -> bool:
        """Does every reader of ``node`` quantize it (looking through a chain of single-reader identities)?"""
        while len(node.users) == 1 and fx_ops.is_identity(self, next(iter(node.users))):
            node = next(iter(node.users))
        return bool(node.users) and all(self.quantized_by(user, node) for user in node.users)

    def is_quantized(self, node: Any) -> bool:
        """``node`` is the output of a quantizer (a :class:`~qdq.quantizer.TensorQuantizer` call)."""
        return isinstance(node, fx.Node) and isinstance(self.module(node), TensorQuantizer)

    def sibling_quantizer(self, node: fx.Node) -> str | None:
        """Module name of a per-tensor quantizer another reader of ``node`` applies to it, if any."""
        for user in node.users:
            for arg, quantizer in self.input_quantizers(user):
                if arg is node and quantizer.axis is None:
                    return next(name for name, m in self.graph_module.named_modules() if m is quantizer)
        return None

    # --- editing the graph
    def add_module(self, near: fx.Node, stem: str, module: nn.Module) -> str:
        """Register ``module`` in the submodule that owns ``near`` (from its module stack); return its name."""
        stack = [path for path in (near.meta.get("nn_module_stack") or {}) if path != near.target]
        owner = stack[-1] if stack else ""
        base = f"{owner}.{stem}" if owner else stem
        name, i = base, 1
        while fetch_attr(self.graph_module, name) is not None:
            name, i = f"{base}_{i}", i + 1
        self.graph_module.add_submodule(name, module)
        return name

    def new_quantizer(self, role: str = "input") -> TensorQuantizer:
        """A quantizer with the context's descriptor, for ``role`` (``"input"`` or ``"output"``)."""
        return TensorQuantizer(self.quant_desc, role=role)

    def swap_module(self, node: fx.Node, module: nn.Module) -> None:
        """Make the ``call_module`` ``node`` call ``module`` instead (same name, same arguments)."""
        parent, _, leaf = str(node.target).rpartition(".")
        setattr(self.graph_module.get_submodule(parent) if parent else self.graph_module, leaf, module)

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
        name = self.add_module(node, stem, self.new_quantizer("output"))
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
        name = self.add_module(node, f"{stem}_{index}" if index else stem, self.new_quantizer("input"))
        with self.graph_module.graph.inserting_before(node):
            new = self.graph_module.graph.call_module(name, args=(arg,))
        node.update_arg(index, new)
        self.changes.append(f"{name}: quantize input {index} of {node.name}")
        return new

    @property
    def summary(self) -> str:
        return "\n".join(self.changes) if self.changes else "no change"

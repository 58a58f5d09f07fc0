"""The PyTorch front end's view: a traced model (``torch.fx``) as a :class:`~qdq.graphs.view.GraphView`.

Every tensor-producing node becomes an op named in the ONNX vocabulary (:mod:`qdq.graphs.fx_ops`); a module's
weights become constant inputs (position 1, the bias 2). Quantizers are not ops: a
:class:`~qdq.quantizer.TensorQuantizer` called on a tensor, and the quantizers a quantized module reads its
arguments through (:meth:`~qdq.nn.base.QuantModule.argument_quantizers`) and its weights with, become the
view's existing quantizers at those sites (disabled ones are not quantizing anything and are left out). An
``nn.SiLU`` is one ``Silu`` op whose sigmoid is an inner value (its front end splits it when a rule quantizes it).
Quantized attention modules inside a module the graph calls as a whole are ``Attention`` ops without inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from qdq.graphs import fx_ops
from qdq.graphs.view import GraphView, Op, Site, Value
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantModule
from qdq.quantizer import TensorQuantizer

__all__ = ["build_view", "trace", "trace_view", "untraced_view"]


class _Tracer(fx.Tracer):
    """Keeps torch.nn modules, qdq's quantized modules, the given classes and the given modules as leaves."""

    def __init__(self, leaf_modules: tuple[type, ...] = (), leaf_objects: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self._extra_leaves, self._leaf_objects = leaf_modules, leaf_objects

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, fx_ops.QDQ_LEAVES + self._extra_leaves) or type(m).__name__ in fx_ops.LEAF_CLASS_NAMES:
            return True
        if id(m) in self._leaf_objects:
            return True
        return super().is_leaf_module(m, module_qualified_name)


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """After the block, no module attribute holds a torch.fx Proxy: each one that does gets its value from before
    the block back (or goes, if it is new). A forward that caches what its first call computes (torchvision's
    ``MultiScaleRoIAlign`` its scales and level mapper) would otherwise keep the trace's Proxies, and the model fail
    at its next real call. (What the tracer itself adds, its tensor constants on the root, is kept.)"""
    saved = [(m, dict(m.__dict__)) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes in saved:
            for key in [key for key, value in m.__dict__.items() if _holds_proxy(value)]:
                if key in attributes:
                    m.__dict__[key] = attributes[key]
                else:
                    del m.__dict__[key]


def _holds_proxy(value: Any, depth: int = 2) -> bool:
    """Is ``value`` a Proxy, or does a container or plain object hold one (``depth`` levels down)?"""
    if isinstance(value, fx.Proxy):
        return True
    if depth == 0 or isinstance(value, nn.Module | torch.Tensor):
        return False
    if isinstance(value, list | tuple | set):
        return any(_holds_proxy(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_proxy(v, depth - 1) for v in value.values())
    attributes = getattr(value, "__dict__", None)
    return isinstance(attributes, dict) and any(_holds_proxy(v, depth - 1) for v in attributes.values())


def trace(module: nn.Module, leaf_modules: tuple[type, ...] = (),
          leaf_objects: frozenset[int] = frozenset()) -> fx.GraphModule:  # fmt: skip
    """``module`` traced by torch.fx, qdq's modules, ``leaf_modules`` classes and ``leaf_objects`` (by ``id``) kept
    as calls. Raises what torch.fx raises on a module it cannot trace."""
    tracer = _Tracer(leaf_modules, leaf_objects)
    with _attributes_kept(module):
        graph = tracer.trace(module)
    gm = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
    originals = dict(module.named_modules())
    for name, copied in gm.named_modules():  # each its own mode (gm.train would give every one the root's)
        copied.training = originals.get(name, module).training
    return gm


def trace_view(model: nn.Module) -> GraphView:
    """The view of ``model``'s graph as placement sees it (:func:`trace`), its quantizers as existing sites (each
    op's ``ref`` its fx node). Raises what torch.fx raises on a model it cannot trace."""
    return build_view(trace(model), None)


def build_view(gm: fx.GraphModule, target: Any) -> GraphView:
    """The view of ``gm``'s graph for ``target`` (ops in graph order; each op's ``ref`` is its fx node)."""
    view = GraphView("torch", target)
    values: dict[fx.Node, Value] = {}
    through: dict[fx.Node, tuple[Any, TensorQuantizer]] = {}  # a quantizer call -> (its input, the quantizer)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values[node] = view.value(node.name)
        elif node.op == "get_attr":
            if fx_ops.is_tensor(gm, node):
                values[node] = view.value(node.name, constant=True)
        elif node.op == "output":
            for arg in _flat(node.args):
                source = _resolve(arg, through)[0]
                if source in values:
                    values[source].graph_output = True
        else:
            module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
            if isinstance(module, TensorQuantizer) and node.args:
                through[node] = (node.args[0], module)
            elif fx_ops.is_tensor(gm, node):
                _add_node(view, gm, node, module, values, through)
            if module is not None and not isinstance(module, QuantScaledDotProductAttention):
                _inner_attention(view, str(node.target), module)
    return view


def untraced_view(modules: dict[str, nn.Module], target: Any) -> GraphView:
    """The view of modules placement could not trace and no graph calls (captured Hugging Face attention layers
    inside untraceable parents): an ``Attention`` op without inputs for each quantized attention in them."""
    view = GraphView("torch", target)
    for path, module in modules.items():
        _inner_attention(view, path, module)
    return view


def _inner_attention(view: GraphView, path: str, module: nn.Module) -> None:
    """An ``Attention`` op without inputs (``ref``: the module) for each quantized attention inside a module the
    graph calls without tracing into it (a captured Hugging Face layer, ``QuantMultiheadAttention``): what the
    target decides about attention reaches those too."""
    for name, inner in module.named_modules():
        if isinstance(inner, QuantScaledDotProductAttention) and f"{path}.{name}" not in {o.name for o in view.ops}:
            view.add_op(f"{path}.{name}", "Attention", [], [view.value(f"{path}.{name}:output")], ref=inner)


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for arg in args if isinstance(args, list | tuple) else [args]:
        out += _flat(arg) if isinstance(arg, list | tuple) else [arg]
    return out


def _resolve(arg: Any, through: dict[fx.Node, tuple[Any, TensorQuantizer]]) -> tuple[Any, TensorQuantizer | None]:
    """The tensor ``arg`` reads past quantizer calls, and the quantizer nearest to the reader (or None)."""
    first = None
    while arg in through:
        arg, quantizer = through[arg]
        first = first or quantizer
    return arg, first


def _arguments(node: fx.Node, op_type: str) -> list[Any]:
    """The data arguments of ``node`` in ONNX input order (a concatenation's list flattened)."""
    if op_type == "Concat":
        tensors = node.args[0] if node.args else node.kwargs.get("tensors", [])
        return list(tensors) if isinstance(tensors, list | tuple) else []
    if op_type in ("Slice", "Resize", "Pad", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
                   "ReduceMean", "ReduceMax"):  # fmt: skip
        return [node.args[0]] if node.args else []
    return [a for a in node.args if isinstance(a, fx.Node)]


def _add_node(view: GraphView, gm: fx.GraphModule, node: fx.Node, module: nn.Module | None, values: dict,
              through: dict) -> None:  # fmt: skip
    op_type, attrs = fx_ops.op_type(node, module)
    if op_type.startswith("torch:") and module is not None and next(module.parameters(), None) is not None:
        attrs = {**attrs, "holds_weights": True}  # a call placement cannot see into: it may hold a Linear
    if op_type in ("Add", "Mul") and (node.kwargs.get("alpha", 1) != 1 or (op_type == "Mul" and node.kwargs)):
        op_type = f"torch:{node.target}"
    arguments = _arguments(node, op_type)
    resolved = [_resolve(a, through) for a in arguments]
    inputs = [values[a] if a in values else view.value(f"{node.name}:const{i}", constant=True)
              for i, (a, _) in enumerate(resolved)]  # fmt: skip
    weights = _module_weights(view, node, module)
    output = values[node] = view.value(node.name, real=not fx_ops.returns_sequence(node, module))
    weight_positions = range(len(inputs), len(inputs) + min(len(weights), 1))  # the weight; a bias is a constant
    op = view.add_op(node.name, op_type, inputs + weights, [output], attrs=attrs, weights=weight_positions,
                     ref=node)  # fmt: skip
    for index, (_, quantizer) in enumerate(resolved):
        if quantizer is not None and quantizer.is_quantizing:
            view.existing(Site(op.inputs[index], op, index), quantizer, unsigned=quantizer.unsigned)
    if isinstance(module, QuantModule):
        _module_sites(view, op, module, node, len(inputs))
    elif node.op == "call_function" and op_type == "AveragePool":
        # F.avg_pool2d / F.adaptive_avg_pool2d: quantized as a QuantAvgPool module's input is, as the ONNX front
        # end quantizes every average pool (the same model through either door gets the same Q/DQ)
        view.quantize_input(op, 0, "the input of an average pool (a function call, as its module would be)")


def _module_weights(view: GraphView, node: fx.Node, module: nn.Module | None) -> list[Value]:
    """A module's weight and bias as constant values (a conv's, a linear layer's, a norm's)."""
    weight = getattr(module, "weight", None) if module is not None else None
    if not isinstance(weight, torch.Tensor):
        return []
    found = [view.value(f"{node.name}.weight", constant=True)]
    if isinstance(getattr(module, "bias", None), torch.Tensor):
        found.append(view.value(f"{node.name}.bias", constant=True))
    return found


def _module_sites(view: GraphView, op: Op, module: QuantModule, node: fx.Node, n_inputs: int) -> None:
    """The quantizers ``module`` reads its arguments through, and its weight quantizer, as existing sites."""
    quantizers = module.argument_quantizers()
    if op.type == "Concat":
        quantizers = quantizers[:1] * n_inputs  # one quantizer for every tensor of the list
    for index, quantizer in enumerate(quantizers[:n_inputs]):
        if quantizer is not None and quantizer.is_quantizing:
            view.existing(Site(op.inputs[index], op, index), quantizer, unsigned=quantizer.unsigned)
    weight = getattr(module, "_weight_quantizer", None)
    if isinstance(weight, TensorQuantizer) and weight.is_quantizing and n_inputs < len(op.inputs):
        view.existing(Site(op.inputs[n_inputs], op, n_inputs), weight, per_channel=weight.axis is not None)

"""The PyTorch front end's edits: the decisions on a :class:`~qdq.graphs.view.GraphView` made into modules.

:func:`materialize` turns each quantizer of the view into one :class:`~qdq.quantizer.TensorQuantizer` module
and makes every site of it read through that module:

* a value-level site: a call of the module after the value's node, read by every former reader;
* a site on a plain add: the add becomes a :class:`~qdq.nn.QuantAdd` quantizing exactly the decided inputs; a
  concatenation whose every input shares one new quantizer becomes a :class:`~qdq.nn.QuantConcat`;
* a site on a quantized module's argument: that module's argument quantizer (enabled, or replaced by the shared
  one);
* any other site: a call of the module on that argument only.

A quantizer's module is the one at its earliest site in graph order: the model's own when it had one there,
else a new module registered in the submodule that owns that node (named after the rule's stem). Quantizers
the view merged (one range) become one module: the others' places (module attributes, calls) are pointed at
it. An ``nn.SiLU`` whose sigmoid a rule quantizes is first written ``x * sigmoid(x)``. Ops kept float go back
to their float module (:meth:`~qdq.nn.base.QuantInputMixin.to_float`); attention modules get the facts the
rules annotated.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import fx, nn

from qdq.descriptor import QuantDescriptor
from qdq.graphs.fx_ops import fetch_attr, meta_outside
from qdq.graphs.ops import ATTENTION_SITES
from qdq.graphs.view import GraphView, Op, Quantizer, Site, Value
from qdq.nn.attention import QuantScaledDotProductAttention
from qdq.nn.base import QuantInputMixin, QuantModule
from qdq.nn.elementwise import QuantAdd, QuantConcat
from qdq.quantizer import TensorQuantizer

__all__ = ["apply_attention_facts", "apply_notes", "materialize"]


def materialize(view: GraphView, gm: fx.GraphModule, quant_desc: QuantDescriptor) -> list[str]:
    """Make ``view``'s decisions in ``gm`` (its graph and submodules; the caller recompiles); the change lines."""
    _Editor(view, gm, quant_desc).run()
    return view.changes


def apply_notes(view: GraphView, module_of: Any = None) -> None:
    """Give each annotated op's module what the rules annotated (the target's attention facts). ``module_of(ref)``
    finds the module of an op's ``ref`` (default: the ref is the module)."""
    for name, notes in view.notes.items():
        facts = notes.get("attention")
        ref = view.op(name).ref
        module = ref if module_of is None else module_of(ref)
        if facts is not None and module is not None:
            apply_attention_facts(module, facts)


def apply_attention_facts(module: QuantScaledDotProductAttention, facts: Any) -> None:
    """Give a quantized attention module its target's facts: the quantizers of the tensors they do not list
    (:data:`~qdq.graphs.ops.ATTENTION_SITES`: the module's four quantizers, in that order) are disabled, the softmax
    scale goes where they say, calibration checks the shapes against them."""
    module.target_facts = facts
    module.scale_query = facts.scale_query
    for name, quantizer in zip(ATTENTION_SITES, module.quantizers().values(), strict=True):
        if name not in facts.quantized:
            quantizer.disable()


class _Editor:
    def __init__(self, view: GraphView, gm: fx.GraphModule, quant_desc: QuantDescriptor) -> None:
        self.view, self.gm, self.desc, self.graph = view, gm, quant_desc, gm.graph
        self.order = {node: index for index, node in enumerate(gm.graph.nodes)}
        self.slots: dict[Site, TensorQuantizer] = {}  # sites served by a quantizer of a module made here
        self.expanded: dict[Op, tuple[fx.Node, fx.Node]] = {}  # Silu op -> (sigmoid node, product node)

    def run(self) -> None:
        quantizers = [(q, sorted(q.sites, key=self._position)) for q in self.view.quantizers()]
        self._expand_silus()
        self._replace_adds_and_concats()
        for quantizer, sites in quantizers:
            self._realize(quantizer, sites)
        self._float_ops()
        self._notes()

    # --- ordering and lookup
    def _position(self, site: Site) -> float:
        if site.reader is not None:
            return self.order.get(site.reader.ref, len(self.order))
        producer = site.value.producer
        return self.order.get(producer.ref, len(self.order)) - 0.5 if producer is not None else -1.0

    def _name_of(self, module: nn.Module) -> str:
        return next(name for name, m in self.gm.named_modules(remove_duplicate=False) if m is module)

    def _module(self, node: fx.Node) -> nn.Module | None:
        return self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None

    # --- structure
    def _expand_silus(self) -> None:
        """Write each SiLU whose sigmoid a rule quantizes as ``x * sigmoid(x)``."""
        for op in self.view.ops_of("Silu"):
            inner = op.inner.get("sigmoid")
            if inner is None or self.view.output_quantizer(inner) is None:
                continue
            node = op.ref
            x = node.args[0] if node.args else node.kwargs.get("input")
            meta = meta_outside(node)
            with self.graph.inserting_after(node):
                sigmoid = self.graph.call_function(torch.sigmoid, (x,))
            with self.graph.inserting_after(sigmoid):
                product = self.graph.call_function(operator.mul, (x, sigmoid))
            sigmoid.meta.update(meta)
            product.meta.update(meta)
            node.replace_all_uses_with(product)
            self.graph.erase_node(node)
            self.expanded[op] = (sigmoid, product)
            self.view.changes.append(f"{node.name}: SiLU written x * sigmoid(x)")

    def _new_sites(self, op: Op) -> list[Site]:
        found = []
        for index, value in enumerate(op.inputs):
            site = Site(value, op, index)
            if self.view.output_quantizer(value) is None and self._quantizer(site) and not self.view.is_existing(site):
                found.append(site)
        return found

    def _quantizer(self, site: Site) -> Quantizer | None:
        return self.view.site_quantizer(site)

    def _stem(self, site: Site) -> str:
        """The name stem of the quantizer at ``site`` (one of :meth:`_new_sites`: it has one)."""
        quantizer = self.view.site_quantizer(site)
        if quantizer is None:
            raise KeyError(site)
        return quantizer.stem

    def _replace_adds_and_concats(self) -> None:
        for op in self.view.ops_of("Add", "Concat"):
            node = op.ref
            if not isinstance(node, fx.Node) or node.op == "call_module" or node.graph is not self.graph:
                continue
            sites = self._new_sites(op)
            if not sites:
                continue
            if op.type == "Add":
                self._quant_add(op, node, sites)
            elif len(sites) == len(op.data_inputs) and len({id(self._quantizer(s)) for s in sites}) == 1:
                self._quant_concat(op, node, sites)

    def _quant_add(self, op: Op, node: fx.Node, sites: list[Site]) -> None:
        flags = tuple(any(s.index == i for s in sites) for i in range(len(op.inputs)))
        module = QuantAdd(self.desc, quantize=flags)
        new = self._replace(node, self._stem(sites[0]), module, tuple(node.args[:2]))
        op.ref = new
        for site in sites:
            self.slots[site] = cast(TensorQuantizer, module.input_quantizers[site.index])  # a ModuleList of them
        self.view.changes.append(f"{new.target}: QuantAdd(quantize={flags})")

    def _quant_concat(self, op: Op, node: fx.Node, sites: list[Site]) -> None:
        # torch.cat's arguments: a sequence of tensors (nodes) and an int
        tensors = list(cast("Sequence[fx.Node]", node.args[0] if node.args else node.kwargs["tensors"]))
        dim = cast(int, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
        module = QuantConcat(dim, self.desc)
        new = self._replace(node, self._stem(sites[0]), module, (tensors,))
        op.ref = new
        for site in sites:
            self.slots[site] = module.input_quantizer
        self.view.changes.append(f"{new.target}: QuantConcat(dim={dim})")

    def _replace(self, node: fx.Node, stem: str, module: nn.Module, args: tuple) -> fx.Node:
        name = self._add_module(node, stem, module)
        with self.graph.inserting_after(node):
            new = self.graph.call_module(name, args=args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    def _add_module(self, near: fx.Node, stem: str, module: nn.Module) -> str:
        """Register ``module`` in the submodule that owns ``near`` (from its module stack); return its name."""
        stack = [path for path in (near.meta.get("nn_module_stack") or {}) if path != near.target]
        owner = stack[-1] if stack else ""
        base = f"{owner}.{stem}" if owner else stem
        name, i = base, 1
        while fetch_attr(self.gm, name) is not None:
            name, i = f"{base}_{i}", i + 1
        self.gm.add_submodule(name, module)
        return name

    # --- quantizers
    def _realize(self, quantizer: Quantizer, sites: list[Site]) -> None:
        if not sites:
            return
        module, name = self._owner(quantizer, sites[0])
        for site in sites:
            self._serve(site, module, name)
        module.enable()
        if quantizer.unsigned and not module.unsigned:
            module.unsigned = True
            module.narrow_range = False

    def _owner(self, quantizer: Quantizer, first: Site) -> tuple[TensorQuantizer, str]:
        """The module of a quantizer: the one at its earliest site (the model's, a slot, or a new one)."""
        handle = self.view.handle_of(first)
        if handle is not None:
            return handle, self._name_of(handle)
        if first in self.slots:
            return self.slots[first], self._name_of(self.slots[first])
        role = "output" if first.reader is None else "input"
        stem = quantizer.stem if first.reader is None or not first.index else f"{quantizer.stem}_{first.index}"
        module = TensorQuantizer(self.desc, role=role)
        near = self._value_node(first.value) if first.reader is None else self._reader_nodes(first.reader)[0]
        return module, self._add_module(near, stem, module)

    def _serve(self, site: Site, module: TensorQuantizer, name: str) -> None:
        """Make ``site`` read through ``module``."""
        held = self.view.handle_of(site) or self.slots.get(site)
        if held is not None:
            if held is not module:
                self._point(held, module)
            return
        if site.reader is None:
            self._call_after(site.value, name)
            return
        slot = self._argument_slot(site)
        if slot is not None:
            self._point(slot, module) if slot is not module else None
            return
        self._call_before(site, name)

    def _argument_slot(self, site: Site) -> TensorQuantizer | None:
        """The quantizer a quantized module reads this argument through (disabled until now), if any."""
        node = site.reader.ref if site.reader is not None else None
        module = self._module(node) if isinstance(node, fx.Node) and node.op == "call_module" else None
        if not isinstance(module, QuantModule):
            return None
        slots = module.argument_quantizers()
        return slots[site.index] if site.index < len(slots) else None

    def _point(self, old: TensorQuantizer, new: TensorQuantizer) -> None:
        """Every module attribute holding ``old`` holds ``new`` instead."""
        places = [path for path, m in self.gm.named_modules(remove_duplicate=False) if m is old and path]
        for path in places:
            parent, _, leaf = path.rpartition(".")
            setattr(self.gm.get_submodule(parent) if parent else self.gm, leaf, new)

    def _value_node(self, value: Value) -> fx.Node:
        op = value.producer
        if op is None:  # a model input (build_view names it after its placeholder)
            return next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == value.name)
        if op in self.expanded:
            return self.expanded[op][0 if value is op.inner.get("sigmoid") else 1]
        return op.ref

    def _reader_nodes(self, op: Op) -> list[fx.Node]:
        return list(self.expanded[op]) if op in self.expanded else [op.ref]

    def _call_after(self, value: Value, name: str) -> None:
        node = self._value_node(value)
        with self.graph.inserting_after(node):
            new = self.graph.call_module(name, args=(node,))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)

    def _call_before(self, site: Site, name: str) -> None:
        assert site.reader is not None  # _serve: a site with a reader
        readers = self._reader_nodes(site.reader)
        arg = self._argument(readers[0], site)
        with self.graph.inserting_before(readers[0]):
            new = self.graph.call_module(name, args=(arg,))
        for reader in readers:
            reader.args = _replaced(reader.args, arg, new)
            reader.kwargs = {k: new if v is arg else v for k, v in reader.kwargs.items()}

    def _argument(self, node: fx.Node, site: Site) -> fx.Node:
        """The fx node ``node`` reads at the site's input position."""
        op = site.reader
        if op is not None and op.type == "Concat":  # torch.cat's first argument: a sequence of tensors (nodes)
            return cast("Sequence[fx.Node]", node.args[0] if node.args else node.kwargs["tensors"])[site.index]
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        return tensors[site.index] if site.index < len(tensors) else tensors[0]

    # --- float ops and notes
    def _float_ops(self) -> None:
        for name in self.view.float_ops:
            node = self.view.op(name).ref
            module = self._module(node) if isinstance(node, fx.Node) else None
            if isinstance(module, QuantInputMixin):
                parent, _, leaf = str(node.target).rpartition(".")
                setattr(self.gm.get_submodule(parent) if parent else self.gm, leaf, module.to_float())
            elif isinstance(module, QuantModule):
                for quantizer in module.quantizers().values():
                    quantizer.disable()
        for handle in self.view.dropped:
            if isinstance(handle, TensorQuantizer):
                handle.disable()

    def _notes(self) -> None:
        apply_notes(self.view, lambda ref: self._module(ref) if isinstance(ref, fx.Node) else ref)


def _replaced(args: Any, old: fx.Node, new: fx.Node) -> Any:
    if isinstance(args, tuple | list):
        return type(args)(_replaced(a, old, new) for a in args)
    return new if args is old else args

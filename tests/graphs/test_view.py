"""The placement language on hand-built views: its questions, its decisions, and the rules written against it.

No front end here: each view is written op by op, as an ONNX file would give it, so what a rule decides can be
read off the graph by hand.
"""

from __future__ import annotations

import pytest

from qdq.graphs.view import GraphView, Site
from qdq.targets import get_target


def _chain(view: GraphView, spec: list[tuple[str, str, list[str], dict]]) -> None:
    """Add ops ``(name, type, input names, attrs)``; each op writes the value named after it. Names starting with
    ``w:`` are constant weights (position 1 of a weighted op)."""
    for name, op_type, inputs, attrs in spec:
        values = [view.value(i[2:], constant=True) if i.startswith("w:") else view.value(i) for i in inputs]
        weights = [i for i, n in enumerate(inputs) if n.startswith("w:")]
        view.add_op(name, op_type, values, [view.value(name)], attrs=attrs, weights=weights)


def residual_block(target: str = "tensorrt") -> GraphView:
    """x -> conv1 -> bn1 -> relu1 -> conv2 -> bn2 --+-> add -> out ; x -> proj (1 conv) -----^ (shortcut first)."""
    view = GraphView("test", get_target(target))
    _chain(view, [
        ("conv1", "Conv", ["x", "w:w1"], {}), ("bn1", "BatchNormalization", ["conv1"], {}),
        ("relu1", "Relu", ["bn1"], {}), ("conv2", "Conv", ["relu1", "w:w2"], {}),
        ("bn2", "BatchNormalization", ["conv2"], {}), ("proj", "Conv", ["x", "w:w3"], {}),
        ("add", "Add", ["proj", "bn2"], {}),
    ])  # fmt: skip
    view.values["add"].graph_output = True
    return view


def test_questions_on_a_residual_block():
    view = residual_block()
    assert view.follows_weighted(view.values["bn2"]) and view.follows_weighted(view.values["proj"])
    assert not view.follows_weighted(view.values["x"])  # read twice, and no weighted op behind it
    assert [view.weighted_depth(view.values[n]) for n in ("bn2", "proj", "relu1", "x")] == [2, 1, 1, 0]
    assert view.non_negative(view.values["relu1"]) and not view.non_negative(view.values["bn2"])
    assert not view.non_negative(view.values["add"])  # relu1 + ... is not: bn2 can be negative


def test_residual_rule_quantizes_the_shortcut_and_fuses_the_deeper_branch():
    view = residual_block("tensorrt")
    get_target("tensorrt").placement_rules[0].decide(view)  # residual_add
    add = view.op("add")
    assert view.reads_quantized(add, 0) and not view.reads_quantized(add, 1)  # proj (depth 1) quantized, bn2 fused
    view = residual_block("onnxruntime")
    get_target("onnxruntime").placement_rules[1].decide(view)
    assert view.reads_quantized(add := view.op("add"), 0) and view.reads_quantized(add, 1)  # QLinearAdd: both


def test_decisions_are_idempotent_and_share_and_unsigned_follow_every_site():
    view = GraphView("test", get_target("onnxruntime"))
    _chain(view, [("relu", "Relu", ["x"], {}), ("pool", "MaxPool", ["relu"], {}), ("neg", "Neg", ["x"], {}),
                  ("cat", "Concat", ["pool", "neg"], {})])  # fmt: skip
    relu, pool, cat = view.op("relu"), view.op("pool"), view.op("cat")
    first = view.quantize_output(relu.outputs[0], "test")
    assert view.quantize_output(relu.outputs[0], "again") is first and view.reads_quantized(pool, 0)
    a = view.quantize_input(cat, 0, "test")
    b = view.quantize_input(cat, 1, "test")
    assert view.quantize_input(cat, 1, "again") is b
    shared = view.share_range([first, a], "one range")
    assert shared is first and view.quantizer_at(cat, 0) is first and len(view.quantizers()) == 2
    (unsigned,) = [r for r in get_target("onnxruntime").placement_rules if r.name == "unsigned_activations"]
    unsigned.decide(view)
    assert first.unsigned and not b.unsigned  # relu and pool(relu) >= 0; neg(x) is not
    view.share_range([first, b], "mixed")
    assert not first.unsigned  # a range shared with a signed tensor is signed


def test_keep_float_removes_the_op_quantizers_and_says_why():
    view = residual_block()
    conv = view.op("conv2")
    marker = object()
    view.existing(Site(conv.inputs[0], conv, 0), marker)
    view.existing(Site(conv.inputs[1], conv, 1), object(), per_channel=True)
    assert view.is_quantized(conv)
    view.keep_float(conv, "sensitive")
    assert not view.reads_quantized(conv, 0) and view.float_ops == {"conv2": "sensitive"}
    assert marker in view.dropped and "conv2: float (sensitive)" in view.changes


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_onnxruntime_rules_move_int8_through_a_unet_step_and_keep_an_output_concat_apart(mode):
    """enc -> relu (skip) -> maxpool -> down -> relu2 -> resize -> cat(resize, skip) -> head -> out; and a second
    concatenation of head's output with a score that is a model output (a detector's head)."""
    view = GraphView("test", get_target("onnxruntime"))
    _chain(view, [
        ("enc", "Conv", ["x", "w:a"], {}), ("relu", "Relu", ["enc"], {}), ("pool", "MaxPool", ["relu"], {}),
        ("down", "Conv", ["pool", "w:b"], {}), ("relu2", "Relu", ["down"], {}),
        ("resize", "Resize", ["relu2"], {"mode": mode}), ("cat", "Concat", ["resize", "relu"], {}),
        ("head", "Conv", ["cat", "w:c"], {}), ("score", "Sigmoid", ["head"], {}),
        ("out", "Concat", ["head", "score"], {}),
    ])  # fmt: skip
    view.values["out"].graph_output = True
    for name in ("enc", "down", "head"):  # module replacement: inputs and weights quantized
        conv = view.op(name)
        view.existing(Site(conv.inputs[0], conv, 0), object())
        view.existing(Site(conv.inputs[1], conv, 1), object(), per_channel=True)
    for rule in get_target("onnxruntime").placement_rules:
        rule.decide(view)
    pool, cat, out = view.op("pool"), view.op("cat"), view.op("out")
    assert view.quantizer_at(pool, 0) is view.quantizer_at(view.op("down"), 0)  # one range around the pool
    assert view.quantizer_at(view.op("resize"), 0) is view.quantizer_at(cat, 0)  # and around the resize
    assert view.reads_quantized(cat, 1) and view.quantizer_at(cat, 1) is not view.quantizer_at(cat, 0)
    # the model's output concatenation is no int8 op: not quantized, and its inputs (head's output, quantized for
    # QLinearConv, and the scores, for QLinearSigmoid) keep ranges of their own, never one for boxes and scores
    assert view.output_quantizer(out.outputs[0]) is None
    assert view.quantizer_at(out, 0) is not view.quantizer_at(out, 1)
    assert all(q.unsigned for q in (view.quantizer_at(pool, 0), view.quantizer_at(cat, 0), view.quantizer_at(cat, 1)))

"""``export_onnx``: a quantized PyTorch model to one self-contained Q/DQ ONNX file.

Conventions of the written file:

* graph inputs named by qdq's batch convention (:mod:`qdq.utils.batches`): keyword arguments (a dict
  example, Hugging Face style) by their keyword, positional ones ``input`` (``input_0``, ``input_1``... for
  several); outputs ``output`` (``output_0``...), or a mapping's keys (a Hugging Face ``ModelOutput``:
  ``logits``); symbolic dimensions ``batch`` (dimension 0, with ``dynamic_batch``) and ``sequence``
  (dimension 1 of token-like inputs, with ``dynamic_sequence``), or the ones ``dynamic_axes`` names;
* one ``QuantizeLinear -> DequantizeLinear`` pair per quantizer call, exactly where the PyTorch model
  quantizes, tagged with the quantizer's module name (node metadata ``qdq.quantizer``);
* model metadata ``qdq.target`` and ``qdq.version``; weights inside the file (no external data);
* for a target with an ONNX rewrite (:mod:`qdq.targets`; ``"onnxruntime"``), the graph rewritten for it with
  the target's export options (the weight encoding is recorded as ``qdq.weights``);
* ``onnx.checker`` clean (full check, with shape inference).

The dynamo exporter (torch's default) cannot write opsets below 18: asking for less gives a file at opset
18 (torch tries to convert down and keeps 18 when that fails). qdq warns when the file's opset is not the
one requested; :func:`onnx_opset` reads it back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qdq.errors import QdqConfigError, QdqExportError, QdqTypeError
from qdq.export import _ops
from qdq.export.mode import QdqSpec, export_mode, quantizer_specs
from qdq.graphs import onnx as graph
from qdq.graphs import onnx_tags as tags
from qdq.graphs import onnx_types
from qdq.graphs.ir_graph import tidy
from qdq.quantizer import TensorQuantizer
from qdq.targets import Target, export_target
from qdq.targets.marks import placed_options, placed_target
from qdq.targets.onnxruntime.passes.float_convs import float_convs_said
from qdq.utils.batches import ModelInputs, indexed_names, model_inputs, onnx_input_names, output_names
from qdq.utils.modes import eval_mode

if TYPE_CHECKING:
    import onnx

__all__ = ["export_float_onnx", "export_onnx", "finish_onnx", "float_graph_export", "onnx_opset"]

_MIN_OPSET = 10  # QuantizeLinear / DequantizeLinear
_MIN_OPSET_PER_CHANNEL = 13  # their ``axis`` attribute


def export_onnx(
    model: nn.Module,
    example_input: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    path: str | Path,
    target: str | Target | None = None,
    opset: int | None = None,
    dynamic_batch: bool = True,
    dynamo: bool = True,
    *,
    dynamic_sequence: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    target_options: Mapping[str, Any] | None = None,
) -> Path:
    """Export a quantized model as a Q/DQ ONNX graph for ``target``.

    Args:
        model: a model quantized by qdq, with every used quantizer calibrated (a stored ``amax``).
            It is exported in eval mode and put back in its previous mode afterwards.
        example_input: a batch as :func:`qdq.calibrate` takes it (:mod:`qdq.utils.batches`): one input
            tensor, a tuple of positional arguments, or a dict of keyword arguments (Hugging Face:
            ``{"input_ids": ids, "attention_mask": mask}``), batch first. Keyword inputs are named after
            their keyword in the graph; ``None`` values are left out; other non-tensor values are constants
            of the graph.
        path: the ``.onnx`` file to write (replaced atomically; parent folders are created).
        target: a registered target (:mod:`qdq.targets`); None (default) uses the one the model was placed
            for (``QuantConfig(target=...)``), else ``"tensorrt"``. ``"tensorrt"``: signed int8, zero point 0,
            Q/DQ exactly at the model's quantizers (what TensorRT's explicit quantization wants).
            ``"onnxruntime"``: the same values rewritten for ONNX Runtime's CPU int8 kernels (see
            :mod:`qdq.targets.onnxruntime`); quantize the model with ``QuantConfig(target="onnxruntime")`` for
            every Conv to run in int8.
        opset: ONNX opset; None uses the target's default (:class:`~qdq.targets.ExportDefaults`), and where
            that is None too the exporter's (18 for dynamo). Per-channel quantizers need 13 or more.
        dynamic_batch: make dimension 0 of every input (and output) symbolic (``batch``).
        dynamic_sequence: make dimension 1 of token-like inputs symbolic (``sequence``): integer and bool
            inputs of rank >= 2 (token ids, attention masks, token types) and the keyword ``inputs_embeds``.
            Export with a sequence length of 2 or more (torch.export specializes a dimension of size 1).
        dynamic_axes: ``{input name: {axis: dimension name}}``, symbolic dimensions for the inputs it names
            (ONNX names: the keyword, or ``input`` / ``input_0``...), replacing the two defaults above for
            those inputs; equal names are one dimension (e.g. ``"sequence"`` of ids and mask).
        dynamo: use torch's ``torch.export``-based exporter (default; where it cannot trace the model, the
            TorchScript exporter writes the file, said in one warning); False uses the TorchScript exporter.
        target_options: options of the target's ONNX rewrite, over those the model was quantized with
            (``QuantConfig(target_options=...)``) and the target's defaults. ``"onnxruntime"``:
            ``{"weights": "auto" | "int8" | "uint8"}``, the weight encoding, decided here once and recorded in
            the file (:func:`qdq.targets.onnxruntime.rewrite.rewrite_for_onnxruntime`; ``"auto"``, the default,
            picks uint8 on an x86 CPU without VNNI, where int8 kernels saturate). ``"tensorrt"``:
            ``{"float": "float16", "calibration_data": batches}`` writes the float part in FP16 for TensorRT 11,
            nodes whose values overflow FP16 on the calibration batches kept FP32, what was done logged and
            recorded in the file (:func:`qdq.targets.tensorrt.rewrite.rewrite_for_tensorrt`).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        QdqConfigError: an unknown target.
        QdqExportError: ``target`` is not the one the model was placed for; the model is stale (placement
            returned a new model: export that one); a used quantizer has no ``amax`` (uncalibrated), is not
            8-bit; the opset is too old for Q/DQ or for per-channel scales; or the exporter failed (with
            ``dynamo=True``: both exporters).
    """
    if not isinstance(model, nn.Module):
        raise QdqTypeError(f"export_onnx needs an nn.Module, got {type(model).__name__}.")
    chosen = export_target(model, target)
    target_options = {**placed_options(model), **dict(target_options or {})}  # the call's override the model's
    opset = chosen.export.opset if opset is None else opset
    inputs = _example(example_input, model)
    axes = _dynamic_axes(inputs, dynamic_batch, dynamic_sequence, dynamic_axes)
    path = Path(path)
    with eval_mode(model):
        specs = quantizer_specs(model, *inputs.args, example_kwargs=inputs.kwargs)
        _check_opset(specs, opset)
        with export_mode(model, *inputs.args, specs=specs, example_kwargs=inputs.kwargs):
            proto, names = _run_exporter(model, inputs, opset, axes, dynamo, specs)
    return _finish(proto, specs, path, chosen, opset, target_options, names, placed_target(model) is not None)


def export_float_onnx(
    model: nn.Module,
    example_input: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    path: str | Path,
    target: str | Target,
) -> Path:
    """The float ``model`` (no quantizer) as the FP32 ONNX file of the quantized files made for ``target``: the one
    they are compared with and timed against (the application's ``model_fp32.onnx``), and the one :func:`qdq.tune`
    places. It is :func:`export_onnx` for ``target`` (its rewrite on the float graph: what the target's runtimes run
    in float, a file each of them loads), without the rewrite's warnings about Convs running in float.
    """
    with float_graph_export():
        return export_onnx(model, example_input, path, target=target)


@contextlib.contextmanager
def float_graph_export() -> Iterator[None]:
    """Around the export of a float graph (an FP32 reference, or a file that leaves Convs float on purpose): the
    warning that its Convs will run in float on ONNX Runtime (the ``"onnxruntime"`` rewrite's) is not said."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Conv\(s\) will run in float", category=UserWarning)
        yield


def _finish(
    proto: onnx.ModelProto,
    specs: dict[TensorQuantizer, QdqSpec],
    path: Path,
    target: Target,
    opset: int | None,
    target_options: Mapping[str, Any] | None,
    names: tuple[list[str], list[str]],
    placed: bool = False,
) -> Path:
    annotate = functools.partial(_annotate, specs=specs)
    with float_convs_said(_placed_float_convs) if placed else contextlib.nullcontext():
        return finish_onnx(
            proto, path, target, opset=opset, annotate=annotate, target_options=target_options, io_names=names
        )


def _placed_float_convs(convs: list[str]) -> str:
    """Why Convs stay float on ONNX Runtime in a model placed for it (the rewrite's own advice is to place it)."""
    return (
        f"{len(convs)} Conv(s) will run in float on ONNX Runtime (e.g. {convs[0]}): their output has no quantizer. "
        "The model was quantized for this target, so placement did not reach them: a module torch.fx cannot "
        "trace computes them (quantize_model's warning names those; make them traceable, or use "
        "qdq.nn.QuantAdd / QuantConcat there), or a quantizer was disabled by hand."
    )


def finish_onnx(
    proto: onnx.ModelProto,
    path: str | Path,
    target: Target,
    *,
    opset: int | None = None,
    annotate: Callable[[onnx.ModelProto], None] | None = None,
    target_options: Mapping[str, Any] | None = None,
    io_names: tuple[Sequence[str], Sequence[str]] | None = None,
    edits: Sequence[Callable[[Any], Any]] = (),
) -> Path:
    """The common end of every qdq export, whatever the framework that traced ``proto``.

    Renames inputs/outputs to ``io_names`` (default ``input`` / ``output``, ``input_0``, ... for several),
    tidies the graph, runs the target's ONNX rewrite (with the target's export options, overridden by
    ``target_options``), gives every node a name of its own, records the target in the metadata, checks the model
    with ``onnx.checker`` (full check) and writes it atomically to ``path``. ``annotate`` (the PyTorch
    exporter's quantizer names) runs on the tidied graph, before the rewrite; ``target_options`` are the
    rewrite's options. ``edits`` (functions of an ``onnx_ir.Model``, such as the ONNX front end's Q/DQ writer) run
    first in the tidy's round trip through onnx_ir.

    Raises:
        QdqExportError: the graph fails ``onnx.checker``.
    """

    n_in, n_out = len(proto.graph.input), len(proto.graph.output)
    inputs, outputs = io_names or (indexed_names("input", n_in), indexed_names("output", n_out))
    if (len(inputs), len(outputs)) != (n_in, n_out):
        raise QdqExportError(
            f"the exported graph has {n_in} inputs and {n_out} outputs, expected {len(inputs)} ({list(inputs)}) "
            f"and {len(outputs)} ({list(outputs)}): an input the model does not use was dropped by the exporter, "
            "or an output is not a tensor. Leave unused inputs out of the example."
        )
    graph.rename_io(proto, inputs, outputs)
    graph.on_ir(proto, *edits, tidy)
    if annotate is not None:
        annotate(proto)
    target.rewrite_onnx(proto, **target.export_options(target_options))
    graph.name_nodes(proto)  # ONNX Runtime refuses two nodes of one name (an unnamed source's bias DQs)
    _set_metadata(proto, target.name)
    _warn_opset(proto, opset)
    large = proto.ByteSize() >= onnx_types.PROTOBUF_LIMIT
    if not large:
        _check(proto, declared=True)
    graph.atomic_save(proto, Path(path))
    if large:  # onnx.checker reads a model over 2 GB from its file; shape inference cannot read external data
        _check(str(path), full=False)
    _warn_broken_rules(str(path) if large else proto, target, Path(path))
    return Path(path)


def _warn_broken_rules(model: onnx.ModelProto | str, target: Target, path: Path) -> None:
    """One warning when the written file breaks rules its target's runtime states (``Target.rule_check``: TensorRT's
    explicit quantization, what ``qdq check`` reports)."""
    if target.rule_check is None:
        return
    violations = list(getattr(target.rule_check(model), "violations", []))
    if violations:
        shown = ", ".join(f"{v.rule} at {v.node}" for v in violations[:3]) + (", ..." if len(violations) > 3 else "")
        warnings.warn(
            f"{path.name} breaks {len(violations)} of the rules of the {target.name!r} target's runtime ({shown}): "
            f"the runtime takes the file but runs those parts in float or unfused. `qdq check {path}` lists each "
            "with its reason.",
            stacklevel=3,
        )


def _check(checked: onnx.ModelProto | str, full: bool = True, declared: bool = False) -> None:
    """``onnx.checker`` on a model or a file (``full``: with shape inference); one clear error when it fails.
    ``declared``: a model whose output a rewrite left declared with a stale rank (a Cast back to float32 before it)
    declares the computed shape (:func:`qdq.graphs.onnx.declare_computed_output_shapes`) and is checked again."""
    import onnx

    try:
        onnx.checker.check_model(checked, full_check=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        stale = declared and isinstance(err, onnx.shape_inference.InferenceError)
        if stale and isinstance(checked, onnx.ModelProto) and graph.declare_computed_output_shapes(checked):
            _check(checked, full)
            return
        hint = ""
        if "bfloat16" in str(err):
            hint = " bfloat16 Conv/Gemm/MatMul need ONNX opset >= 22: export with dynamo=True, opset=22."
        raise QdqExportError(f"The exported graph fails onnx.checker: {err}.{hint}") from err


def onnx_opset(model: onnx.ModelProto | str | Path) -> int:
    """The default-domain opset of an ONNX model (or file)."""
    import onnx

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _example(example_input: Any, model: nn.Module) -> ModelInputs:
    try:
        inputs = model_inputs(example_input, model)
    except QdqConfigError as err:
        raise QdqTypeError(f"example_input: {err}") from err
    if not any(True for _ in inputs.tensors()):
        raise QdqTypeError("example_input must hold at least one tensor (a tensor, a tuple or a dict of them).")
    return ModelInputs(inputs.args, _in_signature_order(model, inputs.kwargs))


def _in_signature_order(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments in the order ``forward`` declares them (others after, as given): the order of the
    graph inputs, whichever exporter traces the model (TorchScript orders them so, dynamo as given)."""
    try:
        order = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(kwargs.items(), key=lambda item: rank.get(item[0], len(order))))


_Axes = dict[str, dict[int, str]]


def _dynamic_axes(
    inputs: ModelInputs, batch: bool, sequence: bool, explicit: Mapping[str, Mapping[int, str]] | None
) -> _Axes:
    """Symbolic dimensions of each ONNX input: ``explicit`` ones, else batch / sequence by the defaults."""
    tensors = dict(inputs.tensors())
    unknown = sorted(set(explicit or {}) - set(tensors))
    if unknown:
        raise QdqConfigError(f"dynamic_axes names inputs {unknown}; the example's inputs are {list(tensors)}.")
    axes: _Axes = {}
    for name, tensor in tensors.items():
        if explicit and name in explicit:
            axes[name] = _checked_axes(name, tensor, explicit[name])
            continue
        dims: dict[int, str] = {}
        if batch and tensor.dim() >= 1:
            dims[0] = "batch"
        if sequence and tensor.dim() >= 2 and (_token_like(tensor) or name == "inputs_embeds"):
            dims[1] = "sequence"
        axes[name] = dims
    return axes


def _token_like(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex()


def _checked_axes(name: str, tensor: torch.Tensor, dims: Mapping[int, str]) -> dict[int, str]:
    checked = {}
    for axis, dim in dims.items():
        if not isinstance(axis, int) or not -tensor.dim() <= axis < tensor.dim() or not isinstance(dim, str):
            raise QdqConfigError(
                f"dynamic_axes[{name!r}] maps axes to names ({{0: 'batch'}}); got {axis!r}: {dim!r} for an "
                f"input of rank {tensor.dim()}."
            )
        checked[axis % tensor.dim()] = dim
    return checked


def _check_opset(specs: dict[TensorQuantizer, QdqSpec], opset: int | None) -> None:
    if opset is None:
        return
    if opset < _MIN_OPSET:
        raise QdqExportError(f"opset {opset} has no QuantizeLinear/DequantizeLinear; use opset >= 13.")
    per_channel = [s.name for s in specs.values() if s.per_channel]
    if per_channel and opset < _MIN_OPSET_PER_CHANNEL:
        raise QdqExportError(
            f"Per-channel quantization needs ONNX opset >= {_MIN_OPSET_PER_CHANNEL} (the 'axis' attribute of "
            f"QuantizeLinear), but opset={opset} was requested and {len(per_channel)} quantizer(s) are "
            f"per-channel, e.g. {per_channel[0]}. Export with opset >= 13, or use per-tensor weights."
        )


def _enlarged(inputs: ModelInputs, axes: _Axes) -> ModelInputs:
    """torch.export specializes a dimension of size 1: export a dynamic dimension of size 1 at size 2 by
    repeating the example (the graph does not change)."""
    tensors = dict(inputs.tensors())
    grown: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for axis in axes.get(name, {}):
            if tensor.shape[axis] == 1:
                tensor = torch.cat([tensor, tensor], dim=axis)
        grown[id(tensors[name])] = tensor

    def swap(value: Any) -> Any:
        return grown.get(id(value), value) if isinstance(value, torch.Tensor) else value

    return ModelInputs(tuple(swap(a) for a in inputs.args), {k: swap(v) for k, v in inputs.kwargs.items()})


def _output_names(model: nn.Module, inputs: ModelInputs) -> list[str]:
    with torch.no_grad():
        return output_names(inputs(model))


def _run_exporter(
    model: nn.Module,
    inputs: ModelInputs,
    opset: int | None,
    axes: _Axes,
    dynamo: bool,
    specs: Mapping[TensorQuantizer, QdqSpec],
) -> tuple[onnx.ModelProto, tuple[list[str], list[str]]]:
    """The model traced to ONNX by the chosen exporter. Where torch.export cannot trace it (a bug of torch's, such as
    a constant lifted twice in a module called twice), the TorchScript exporter writes it instead, said once."""
    names = (onnx_input_names(inputs), _output_names(model, inputs))
    try:
        return _export_with(dynamo, model, inputs, opset, axes, names), names
    except (QdqExportError, QdqConfigError):
        raise
    except Exception as err:
        if not dynamo:
            raise QdqExportError(f"torch.onnx.export (TorchScript exporter) failed: {_first_line(err)}. "
                                 "Try the dynamo exporter (dynamo=True).") from err  # fmt: skip
        failed = err
    for spec in specs.values():
        spec.traced.clear()  # the tensors of the failed trace
    try:
        proto = _export_with(False, model, inputs, opset, axes, names)
    except (QdqExportError, QdqConfigError):
        raise
    except Exception as err:
        raise QdqExportError(f"torch.onnx.export failed with both exporters: dynamo: {_first_line(failed)}; "
                             f"TorchScript: {_first_line(err)}.") from err  # fmt: skip
    warnings.warn(f"torch.export could not trace {type(model).__name__} ({_first_line(failed)}); the TorchScript "
                  "exporter wrote the file instead (export_onnx(..., dynamo=False) skips the attempt).",
                  stacklevel=3)  # fmt: skip
    return proto, names


def _export_with(dynamo: bool, model: nn.Module, inputs: ModelInputs, opset: int | None, axes: _Axes,
                 names: tuple[list[str], list[str]]) -> onnx.ModelProto:  # fmt: skip
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # TorchScript warns on every LSTM exported with a batch other than 1; qdq's exports take any batch
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        # torch says so once per input when several inputs share a dimension name (ids and mask: "sequence")
        warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used", category=UserWarning)
        # TorchScript's constant folding says so for every strided Slice it leaves (the file is the same)
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1 can be constant folded")
        if dynamo:
            return _export_dynamo(model, inputs, opset, axes, names)
        return _export_torchscript(model, inputs, opset, axes, names)


def _first_line(err: BaseException) -> str:
    """``err`` in one line: the exception summary torch's exporter writes after its advice, else the first line."""
    text = str(err)
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1].strip()
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first}"[:300]


def _dynamic_shapes(model: nn.Module, inputs: ModelInputs, axes: _Axes) -> dict[str, Any] | None:
    """torch.export's ``dynamic_shapes``: one spec per forward parameter, by name (one ``Dim`` per name)."""
    if not any(axes.values()):
        return None
    dims: dict[str, Any] = {}
    spec_of = {id(t): {a: dims.setdefault(d, torch.export.Dim(d)) for a, d in axes[n].items()} or None
               for n, t in inputs.tensors()}  # fmt: skip

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return spec_of.get(id(value))
        if isinstance(value, tuple | list):
            return type(value)(spec(v) for v in value)
        if isinstance(value, Mapping):
            return {k: spec(v) for k, v in value.items()}
        return None

    try:
        bound = inspect.signature(model.forward).bind(*inputs.args, **inputs.kwargs)
    except TypeError as err:
        raise QdqConfigError(f"the example does not match {type(model).__name__}.forward: {err}.") from err
    return {name: spec(value) for name, value in bound.arguments.items()}


def _export_dynamo(
    model: nn.Module,
    inputs: ModelInputs,
    opset: int | None,
    axes: _Axes,
    names: tuple[list[str], list[str]],
) -> onnx.ModelProto:
    inputs = _enlarged(inputs, axes)
    program = torch.onnx.export(
        model,
        inputs.args,
        kwargs=inputs.kwargs or None,
        dynamo=True,
        external_data=False,
        opset_version=opset,
        input_names=names[0],
        output_names=names[1],
        dynamic_shapes=_dynamic_shapes(model, inputs, axes),
        custom_translation_table=_ops.dynamo_translation_table(),
        optimize=True,
        verbose=False,
    )
    return program.model_proto  # type: ignore[union-attr]  # torch.onnx.export returns a program with dynamo=True


def _export_torchscript(
    model: nn.Module,
    inputs: ModelInputs,
    opset: int | None,
    axes: _Axes,
    names: tuple[list[str], list[str]],
) -> onnx.ModelProto:
    import onnx

    _ops.register_torchscript_symbolic()
    buffer = io.BytesIO()
    kwargs: dict[str, Any] = {"opset_version": opset} if opset is not None else {}
    dynamic = {name: dict(dims) for name, dims in axes.items() if dims}
    batch_outputs = {name: {0: "batch"} for name in names[1]} if any(0 in d for d in dynamic.values()) else {}
    if dynamic:
        kwargs["dynamic_axes"] = {**dynamic, **batch_outputs}
    args = (*inputs.args, inputs.kwargs) if inputs.kwargs else inputs.args
    torch.onnx.export(
        model,
        args,
        buffer,  # type: ignore[arg-type]  # torch's annotation omits the file objects the TorchScript exporter takes
        dynamo=False,
        input_names=names[0],
        output_names=names[1],
        do_constant_folding=True,
        custom_opsets={_ops.TAG_DOMAIN: 1},
        training=torch.onnx.TrainingMode.EVAL,
        **kwargs,
    )
    return onnx.load_from_string(buffer.getvalue())


def _annotate(proto: onnx.ModelProto, specs: dict[TensorQuantizer, QdqSpec]) -> None:
    """Tag Q/DQ nodes with quantizer names; account for quantizers an exporter merged (CSE)."""
    tags.annotate_quantizers(proto)
    found = {site.quantizer for site in tags.qdq_sites(proto)}
    by_name = {s.name: s for s in specs.values()}
    merged: dict[str, list[str]] = {}
    for spec in specs.values():
        if spec.name in found:
            continue
        partner = next((by_name[f] for f in found if f in by_name and _merged(spec, by_name[f])), None)
        if partner is None:
            raise QdqExportError(
                f"{spec.name} produced no Q/DQ pair in the exported graph: the exporter dropped it. "
                "Check that its output is used."
            )
        merged.setdefault(partner.name, []).append(spec.name)
    tags.record_merged(proto, merged)
    for spec in specs.values():
        spec.traced.clear()


def _merged(spec: QdqSpec, other: QdqSpec) -> bool:
    """Did the exporter merge ``spec``'s Q/DQ into ``other``'s: the same grid on the same input, or on an input of
    equal values (two identical computations, such as two heads whose equal weights the exporter deduplicated, are
    one node after its common-subexpression elimination)?"""
    return spec.same_qdq(other) and any(a is b or _equal_values(a, b) for a in spec.traced for b in other.traced)


def _equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    except Exception:  # a traced tensor without values (a fake tensor of the dynamo exporter)
        return False


def _set_metadata(proto: onnx.ModelProto, target: str) -> None:
    from qdq import __version__

    graph.set_metadata(proto, "qdq.target", target)
    graph.set_metadata(proto, "qdq.version", __version__)


def _warn_opset(proto: onnx.ModelProto, requested: int | None) -> None:
    actual = onnx_opset(proto)
    if requested is not None and actual != requested:
        warnings.warn(
            f"Requested ONNX opset {requested}, the file has opset {actual} (the dynamo exporter does not "
            "write opsets below 18; use dynamo=False for an older opset).",
            stacklevel=3,
        )

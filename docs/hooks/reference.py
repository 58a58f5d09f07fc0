"""MkDocs hook: the API reference pages, generated from the packages' ``__all__`` at each build.

One page per public package (:data:`PACKAGES`); one entry per name of its ``__all__``, rendered by mkdocstrings
from the docstring where the name is defined. A name added to or removed from an ``__all__`` changes the
reference with no edit here. qdq's lazy packages (``qdq``, ``qdq.export``, ``qdq.keras``, ``qdq.workflow``)
define their names elsewhere and list where in ``_LAZY``: the entry points there (mkdocstrings reads the source
and imports nothing, so TensorFlow is not needed to document ``qdq.keras``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGES = {
    "qdq": "The entry points: `quantize_model`, calibration, PTQ, QAT, export, verification, the seed "
    "toolkit's names (`QuantDescriptor`, `TensorQuantizer`, `tensor_quant`...) and the errors; the "
    "submodules it names are listed with their summary.",
    "qdq.workflow": "The library's model-level API: calibration, diagnostics, PTQ, QAT, sensitivity, "
    "smoothing, verification (`qdq` re-exports the main functions).",
    "qdq.workflow.distributed": "torch.distributed helpers for calibration and QAT under `torchrun`: process "
    "group, sharding, synchronisation checks, timeouts.",
    "qdq.export": "ONNX export of quantized models, TensorRT calibration caches and the TensorRT 11 tools "
    "(rule check, FP16/BF16 conversion).",
    "qdq.runtime": "Run and time ONNX models on ONNX Runtime, OpenVINO and TensorRT behind one interface.",
    "qdq.runtime.ort": "The ONNX Runtime backend: CPU sessions and the fusion report (which weighted ops run in "
    "int8 kernels, which stay float and why).",
    "qdq.runtime.openvino": "The OpenVINO backend: compiled models per input shape and the runtime precision of "
    "each layer.",
    "qdq.runtime.tensorrt": "The TensorRT backend: strongly typed engines checked with TensorRT's rules first, and "
    "TensorRT <= 10 calibration caches.",
    "qdq.keras": "The Keras 3 front end (the `tf` extra): NVIDIA's TF2 toolkit's API, calibrated and exported "
    "like the PyTorch path.",
}


@dataclass(frozen=True)
class Entry:
    public: str  # qdq.calibrate
    source: str | None  # qdq.workflow.calibration.calibrate: where mkdocstrings reads it; None: nowhere static
    module: bool = False  # a submodule: its summary only


def page_path(package: str) -> str:
    return f"reference/{package}.md"


def entries(package: str) -> list[Entry]:
    """Every name of ``package.__all__``, with the path of its definition."""
    pkg = importlib.import_module(package)
    lazy = getattr(pkg, "_LAZY", {})
    found = []
    for name in pkg.__all__:
        public = f"{package}.{name}"
        if name in lazy:
            defined = _defined_as(package, name, lazy[name])
            found.append(Entry(public, f"{lazy[name]}.{defined}" if defined else None))
        elif name in getattr(pkg, "_SUBMODULES", ()) or _is_submodule(package, name):
            found.append(Entry(public, public, module=True))
        else:  # imported into the package's namespace (qdq.runtime), or defined there (__version__)
            found.append(Entry(public, public))
    return found


def _is_submodule(package: str, name: str) -> bool:
    is_package = hasattr(importlib.import_module(package), "__path__")
    return is_package and importlib.util.find_spec(f"{package}.{name}") is not None


def _top_level_names(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"cannot find the source of {module}")
    tree = ast.parse(Path(spec.origin).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _defined_as(package: str, name: str, module: str) -> str | None:
    """The name under which ``module`` defines ``package.name`` (differs for an alias: a public name bound to an
    object its module defines under another name); None when it has no static definition (a module
    ``__getattr__``)."""
    if name in _top_level_names(module):
        return name
    value = getattr(importlib.import_module(package), name)
    static = _top_level_names(module)
    return next((key for key, obj in vars(importlib.import_module(module)).items()
                 if obj is value and key in static), None)  # fmt: skip


def render(package: str) -> str:
    lines = [f"# `{package}`", "", PACKAGES[package], ""]
    lines += [f"Every public name of `{package}` (its `__all__`), with the docstring where it is defined.", ""]
    for entry in entries(package):
        if entry.source is None:
            value = getattr(importlib.import_module(package), entry.public.rsplit(".", 1)[1])
            lines += [f"## `{entry.public.rsplit('.', 1)[1]}`", "",
                      f"`{entry.public}` is computed when read (a module `__getattr__`), so it has no docstring; "
                      f"when these pages were built it was `{value!r}`.", ""]  # fmt: skip
            continue
        options = ["show_root_heading: true", "show_root_full_path: false", "heading_level: 2"]
        if entry.module:
            options.append("members: false")
        lines += [f"::: {entry.source}", "    options:", *[f"      {opt}" for opt in options]]
        if entry.source != entry.public:
            lines += ["", f"Public name: `{entry.public}` (defined in `{entry.source.rsplit('.', 1)[0]}`)."]
        lines.append("")
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:  # MkDocs calls it with its Files and config
    from mkdocs.structure.files import File

    for package in PACKAGES:
        files.append(File.generated(config, page_path(package), content=render(package)))
    return files

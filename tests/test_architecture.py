"""ARCHITECTURE.md's layer table and the import-linter contract in pyproject.toml say the same thing.

CI's ``lint-imports`` checks the code against the contract; this test checks the document against the
contract, so neither can drift from the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _contract_layers() -> list[set[str]]:
    """The contract's layers, lowest first, each as a set of module names (optional ones included)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers" and c["containers"] == ["qdq"]]
    return [{name.strip().strip("()") for name in re.split(r"[|:]", layer)} for layer in reversed(contract["layers"])]


def _table_layers() -> list[set[str]]:
    """Each row of the layer table, top row first, as the set of ``qdq/...`` modules it names."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`qdq/" in line.split(" | ")[1]]
    paths = [re.findall(r"`qdq/([A-Za-z_/]+?)(?:\.py)?/?`", row.split(" | ")[1]) for row in rows]
    return [{path.replace("/", ".") for path in row} for row in paths]


def test_the_table_lists_the_contracts_layers_in_order():
    assert _table_layers() == _contract_layers()


# --- qdq.tuning imports nothing private from another package ---------------------------------------------------
# import-linter sees modules, not names (its private_modules contract covers `qdq.x._module`); this reads the
# package's source for the names: `from qdq.x import _name`, and `_name` read off anything imported from qdq.x.

NO_PRIVATE_IMPORTS = ("qdq.tuning",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute module of an import (``from ..x import y`` resolved against ``importer``)."""
    if not level:
        return module or ""
    base = importer.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join([*base, *([module] if module else [])])


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, importer: str, package: str, is_package: bool = False) -> list[str]:
    """The private names ``importer`` (a module of ``package``) takes from qdq modules outside ``package``: imported
    by name, or read as an attribute of a module or object imported from there."""
    import ast

    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    foreign: dict[str, str] = {}  # local name -> the qdq module outside ``package`` it comes from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, importer, is_package)
            if module.split(".")[0] != "qdq" or _inside(module, package):
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
                foreign[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "qdq":
                    continue
                if alias.asname is None:  # `import qdq.x.y` binds `qdq`: reads resolve through the attribute chain
                    foreign["qdq"] = "qdq"
                elif not _inside(alias.name, package):
                    foreign[alias.asname] = alias.name
                if any(_private(part) for part in alias.name.split(".")) and not _inside(alias.name, package):
                    found.append((node.lineno, f"import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                dotted = ".".join([root.id, *reversed(chain)])
                if not _inside(".".join([foreign[root.id], *reversed(chain[1:])]), package):
                    found.append((node.lineno, f"{dotted} (line {node.lineno})"))
    return [text for _, text in sorted(found)]


@pytest.mark.parametrize(
    "path",
    sorted(path for package in NO_PRIVATE_IMPORTS for path in (ROOT / "src" / package.replace(".", "/")).rglob("*.py")),
    ids=lambda path: str(path.relative_to(ROOT / "src")),
)
def test_the_package_imports_nothing_private_from_another_package(path):
    module = _module_name(path)
    package = next(p for p in NO_PRIVATE_IMPORTS if _inside(module, p))
    assert private_imports(path.read_text(encoding="utf-8"), module, package, path.name == "__init__.py") == []


def test_the_private_import_check_sees_each_form():
    source = (
        "import qdq.onnx_in.quantize as q\n"
        "import qdq.keras._backend\n"
        "from qdq.onnx_in.quantize import _minima, quantize_onnx\n"
        "from qdq.onnx_in import load\n"
        "from qdq.tuning.budget import _inside_ok\n"
        "from . import _sibling_ok\n"
        "q._reused(None)\n"
        "load._fold_batchnorms(None)\n"
        "quantize_onnx.__name__\n"
        "qdq.tuning.budget._ok\n"
        "qdq.runtime._text\n"
    )
    assert private_imports(source, "qdq.tuning.x", "qdq.tuning") == [
        "import qdq.keras._backend",
        "from qdq.onnx_in.quantize import _minima",
        "q._reused (line 7)",
        "load._fold_batchnorms (line 8)",
        "qdq.runtime._text (line 11)",
    ]

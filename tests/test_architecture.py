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

"""The documentation's structure: the API reference covers every public name, each guide includes its example from
examples/ (no copies), pages stay short, and the README's two commands are the ones CI runs.

The site itself is built by ``mkdocs build --strict`` in .ci/run (pass 2); these checks need no doc tools.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted([*(ROOT / "docs" / "guides").glob("*.md"), *(ROOT / "docs" / "migration").glob("*.md")])
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', flags=re.M)


@pytest.fixture(scope="module")
def reference():
    """docs/hooks/reference.py, loaded from its file (tests/reference.py holds the name ``reference``)."""
    spec = importlib.util.spec_from_file_location("qdq_docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize(
    "package",
    ["qdq", "qdq.keras", "qdq.export", "qdq.runtime", "qdq.runtime.ort", "qdq.runtime.openvino", "qdq.runtime.tensorrt",
     "qdq.workflow"],
)
def test_the_reference_lists_every_public_name(reference, package):
    assert package in reference.PACKAGES
    entries = reference.entries(package)
    names = importlib.import_module(package).__all__
    assert [entry.public for entry in entries] == [f"{package}.{name}" for name in names]
    page = reference.render(package)
    for entry in entries:
        assert f"::: {entry.source}" in page if entry.source else f"`{entry.public}`" in page


def test_each_reference_entry_points_at_a_definition(reference):
    """Where mkdocstrings will read each docstring: a module that defines the name (not a lazy re-export)."""
    for package in reference.PACKAGES:
        for entry in reference.entries(package):
            if entry.source is None or entry.module or entry.source == entry.public:
                continue
            module, name = entry.source.rsplit(".", 1)
            assert importlib.util.find_spec(module) is not None, entry
            assert name in reference._top_level_names(module), entry


def test_every_guide_includes_an_example_and_every_example_is_included():
    included = {}
    for page in GUIDES:
        paths = SNIPPET.findall(page.read_text())
        assert paths, f"{page.name} includes no example"
        for path in paths:
            assert (ROOT / path).is_file(), f"{page.name} includes {path}, which does not exist"
            included[path] = page.name
    examples = {f"examples/{path.name}" for path in (ROOT / "examples").glob("*.py")}
    assert set(included) == examples


def test_pages_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 150
    for page in GUIDES:
        assert len(page.read_text().splitlines()) < 200, page.name


def test_the_readme_commands_are_the_ones_ci_and_the_install_page_run():
    readme, install, ci = ((ROOT / p).read_text() for p in ("README.md", "docs/install.md", ".ci/run"))
    main_job = 'pip install -e ".[app,openvino]" && qdq demo'
    tests = 'pip install -e ".[test]" && python -m pytest -q -n auto --maxprocesses 4'
    for text in (readme, install):
        assert main_job in text and tests in text
    # the bare pass is the README's command (every test once), the second runs what it skipped, with the extras
    assert 'install -e ".[test]"\n' in ci and '"$py" -m pytest -q -n auto --maxprocesses 4 --skipped-to' in ci
    assert '"$py" -m pytest -q -n auto --maxprocesses 4 "@$skipped"' in ci
    assert "mkdocs build --strict" in ci and '"$py" -m mypy' in ci

"""What the repository itself holds: source and text, no large binaries (models, datasets, ONNX weights)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the largest file the repository may track, in bytes; RESULTS.md, the largest text file, is well under it and
#: the test fixtures under tests/data are a few kB
LARGEST_FILE = 1_000_000


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:  # e.g. git refusing a checkout another user owns ("dubious ownership")
        pytest.skip(f"git ls-files failed: {listed.stderr.decode(errors='replace').strip()}")
    return [ROOT / name for name in listed.stdout.decode().split("\0") if name]


def test_no_tracked_file_is_a_large_binary():
    sizes = {path.relative_to(ROOT).as_posix(): path.stat().st_size for path in _tracked_files() if path.is_file()}
    assert sizes, "git ls-files listed nothing"
    large = {name: size for name, size in sizes.items() if size > LARGEST_FILE}
    assert not large, f"tracked files over {LARGEST_FILE:,} bytes (untrack them; see .gitignore): {large}"

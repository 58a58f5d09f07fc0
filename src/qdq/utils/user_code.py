"""A function from the user's own Python file, named on the command line as ``path/to/file.py:function``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from qdq.errors import QdqConfigError, did_you_mean

__all__ = ["first_line", "import_file", "load_function"]


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def import_file(path: Path, what: str = "file") -> ModuleType:
    """Import ``path`` as a fresh module; its folder is on ``sys.path`` while it runs (for its own imports).

    Raises:
        QdqConfigError: not a Python file, or importing it raised (the first line of that error, ``what`` naming
            the file's role in the message).
    """
    module_name = f"_qdq_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise QdqConfigError(f"cannot import {what} {str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look classes up there
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise QdqConfigError(f"importing {what} {str(path)!r} failed: {first_line(err)}") from err
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_function(spec: str, what: str = "file") -> Callable[..., Any]:
    """The function ``spec`` (``path/to/file.py:function``) names.

    Raises:
        QdqConfigError: ``spec`` without ``:function``, a missing file, or no such function in it.
    """
    file, sep, name = str(spec).rpartition(":")
    if not sep or not file.endswith(".py") or not name:
        raise QdqConfigError(f"{what} {spec!r}: write it as path/to/file.py:function.")
    path = Path(file).expanduser()
    if not path.is_file():
        raise QdqConfigError(f"{what} {file!r} does not exist")
    module = import_file(path, what)
    function = getattr(module, name, None)
    if not callable(function):
        choices = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise QdqConfigError(f"{what} {file!r} has no function {name!r}.{did_you_mean(name, choices)}")
    return function

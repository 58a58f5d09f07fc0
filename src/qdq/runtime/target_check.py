"""What the file's target says about the runtime loading it.

qdq's export writes the target a file was made for into it (``qdq.target``). Before a backend compiles a file,
:func:`target_advice` reads that entry back and asks the target (:meth:`qdq.targets.Target.support`) how this
runtime runs its graphs: a runtime the target ``"refuses"`` raises one clear error (the TensorRT backend and an
``onnxruntime``-target graph), one it ``"runs"`` with a caveat gets that caveat as
:attr:`~qdq.runtime.base.Runtime.advice` (``qdq bench`` prints it), naming the target made for this runtime.
A file without the entry, or made for a target this process has not registered, is loaded as it is.
"""

from __future__ import annotations

from qdq.errors import QdqConfigError
from qdq.runtime.model_info import ModelInfo
from qdq.runtime_registry import RuntimeEntry, runtime_entry
from qdq.targets.registry import TARGET_REGISTRY, native_targets

__all__ = ["target_advice"]


def target_advice(info: ModelInfo, runtime: str | RuntimeEntry) -> str | None:
    """The caveat of running ``info``'s file on ``runtime`` (a registered runtime or its name), or None when there is
    none to tell.

    Raises:
        QdqConfigError: the file's target says ``runtime`` cannot run its graphs (the message says why and
            which target to export for instead).
    """
    if info.target is None:
        return None
    entry = runtime if isinstance(runtime, RuntimeEntry) else runtime_entry(runtime)
    target = TARGET_REGISTRY.find(info.target)
    support = target.support(entry) if target is not None else None
    if support is None or support.verdict == "native":
        return None
    natives = [t.name for t in native_targets(entry)]
    hint = (
        f" Quantize the float model for target {natives[0]!r} (qdq.QuantConfig(target={natives[0]!r})) and export "
        "it again for this runtime."
        if natives
        else ""
    )
    why = f"was exported for target {info.target!r}: {support.reason}.{hint}"
    if support.verdict == "refuses":
        raise QdqConfigError(f"{entry.name} cannot run {info.path.name}: it {why}")
    return f"{info.path.name} {why}"

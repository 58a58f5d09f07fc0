"""A small typed registry: the extension point for quantized modules, calibrators and runtimes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from qdq.errors import QdqConfigError, did_you_mean

__all__ = ["Registry"]

K = TypeVar("K")
V = TypeVar("V")


def _key_name(key: object) -> str:
    return key.__qualname__ if isinstance(key, type) else str(key)


class Registry(Generic[K, V]):
    """Maps keys (names or types) to values, refusing silent overwrites.

    Example:
        >>> reg: Registry[str, int] = Registry("example")
        >>> reg.register("one", 1); reg.get("one")
        1
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._items: dict[K, V] = {}

    def register(self, key: K, value: V, *, override: bool = False) -> V:
        if key in self._items and not override and self._items[key] is not value:
            raise QdqConfigError(
                f"{self._what} {_key_name(key)!r} is already registered as {self._items[key]!r}; "
                "pass override=True to replace it."
            )
        self._items[key] = value
        return value

    def decorator(self, key: K, *, override: bool = False) -> Callable[[V], V]:
        """``@registry.decorator(key)`` registers the decorated object under ``key``."""

        def wrap(value: V) -> V:
            return self.register(key, value, override=override)

        return wrap

    def unregister(self, key: K) -> V:
        """Remove and return the value for ``key``; an unknown key raises like :meth:`get`."""
        self.get(key)
        return self._items.pop(key)

    def get(self, key: K) -> V:
        """The value for ``key``; an unknown key raises with the registered names and a suggestion."""
        try:
            return self._items[key]
        except KeyError:
            names = [_key_name(k) for k in self._items]
            hint = did_you_mean(_key_name(key), names)
            raise QdqConfigError(
                f"Unknown {self._what} {_key_name(key)!r}. Registered: {sorted(names)}.{hint}"
            ) from None

    def find(self, key: K) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())

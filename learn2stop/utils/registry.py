"""Small named registries, one per extension point (tasks, policies, stage objectives)."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object map with a decorator to add to it and an error that lists the choices.

    Example:
        >>> POLICIES = Registry("policy")
        >>> @POLICIES.register("mlp")
        ... class MLP: ...
        >>> POLICIES.get("mlp").__name__
        'MLP'
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; available: {', '.join(sorted(self._entries)) or 'none'}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[T]:
        """The entries in the order they were registered (the order listings show them in)."""
        return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self):
        """The names in the order they were registered."""
        return iter(self._entries)

"""The torch stop signals by rule name: a view of the rule registry (:mod:`learn2stop.runtime.registry`), and the
one place a signal is built from its name."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable

from torch import nn

from ..runtime.registry import get_rule, list_rules
from . import policy_signals  # noqa: F401 (importing it registers the policy signals; .signals the others)
from .signals import StopSignal


class _Signals(Mapping):
    """Rule name -> its torch signal class, for every registered rule with one: a view of the rule registry
    (:mod:`learn2stop.runtime.registry`), not a second table."""

    def __getitem__(self, name: str) -> type:
        signal = get_rule(name).signal if isinstance(name, str) else None
        if signal is None:
            raise KeyError(name)
        return signal

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in list_rules() if get_rule(n).signal is not None])

    def __len__(self) -> int:
        return len(list(iter(self)))


SIGNALS: Mapping[str, type] = _Signals()


def make_signal(name: str, policy: nn.Module | None = None, key: str | Callable | None = None) -> StopSignal:
    """The stop signal called ``name`` (see :data:`SIGNALS`): a policy rule's on ``policy``, a classical
    one's on the output (``key``: which part of it). The one place a signal is built from its name."""
    if name not in SIGNALS:
        raise ValueError(f"unknown stop rule {name!r}; choose one of {', '.join(SIGNALS)}")
    cls = SIGNALS[name]
    if cls.needs_policy:
        if policy is None:
            raise ValueError(f"the {name!r} rule needs a stopping policy, but the model has none")
        return cls(policy)
    return cls(key)

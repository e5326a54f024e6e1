"""The stop rules by name, one entry per rule with its metadata: the one table the CLI's rule checks, calibration,
the frontier, export and the runtime read.

An entry says what the rule's parameter is and which values it takes, which tasks offer the rule, whether it needs
a planning policy and whether the deployed runtime runs it. The entries are plain Python (no numpy, no torch), so
the runtime reads them without torch; each implementation attaches itself to its entry, timm-style: the torch
signal (:mod:`learn2stop.core.rules`) and the numpy rule (:mod:`learn2stop.runtime.rules`).

    >>> get_rule("quantile").param_name
    'alpha'
    >>> list_rules(offered_by="classifier")
    ['confidence', 'entropy', 'patience']
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..utils.registry import Registry

#: who offers a rule: every task with a stopping policy ("policy"), tasks whose outputs are class logits
#: ("classifier"), tasks that name it among their classical signals ("task"), or every task ("every task").
OFFERED_BY = ("policy", "classifier", "task", "every task")


@dataclass
class RuleEntry:
    """One stop rule: its name, its parameter and where it can run.

    Attributes:
        name: what ``--inference.rule``, ``calibration.json`` and the manifest call it.
        param_name: what its parameter is called where users read it (``alpha``, ``tol``, ``depth``).
        param_range: what the parameter must be, in words (the error message's end).
        in_range: ``in_range(param) -> bool``, the test of a finite parameter (a calibration may also hold inf).
        offered_by: one of :data:`OFFERED_BY`.
        plans: it reads a planned q_phi (needs a policy with ``plan_step``).
        runtime: the deployed runtime runs it (its numpy rule is attached; a test checks the claim).
        signal: the torch :class:`~learn2stop.core.signals.StopSignal` class, attached by core.
        numpy_rule: the numpy :class:`~learn2stop.runtime.rules.Rule` class, attached by the runtime.
    """

    name: str
    param_name: str
    param_range: str
    in_range: Callable[[float], bool]
    offered_by: str
    plans: bool = False
    runtime: bool = False
    signal: Any = None
    numpy_rule: Any = None

    def __post_init__(self):
        if self.offered_by not in OFFERED_BY:
            raise ValueError(f"rule {self.name!r}: offered_by must be one of {', '.join(OFFERED_BY)}; got {self.offered_by!r}")

    @property
    def needs_policy(self) -> bool:
        return self.offered_by == "policy"


RULES: Registry[RuleEntry] = Registry("stop rule")


def register_rule(entry: RuleEntry) -> RuleEntry:
    """Add a rule's entry (its implementations attach to it later, with :func:`attach`)."""
    return RULES.register(entry.name)(entry)


def get_rule(name: str) -> RuleEntry:
    """The entry of rule ``name``; a KeyError lists the rules."""
    return RULES.get(name)


def list_rules(*, offered_by: str | None = None, plans: bool | None = None, runtime: bool | None = None) -> list[str]:
    """The names of the rules, in registration order, that match every filter given."""
    return [e.name for e in RULES.values() if (offered_by is None or e.offered_by == offered_by)
            and (plans is None or e.plans == plans) and (runtime is None or e.runtime == runtime)]


def attach(name: str, *, signal: Any = None, numpy_rule: Any = None) -> RuleEntry:
    """Attach an implementation to rule ``name``'s entry: its torch signal class or its numpy rule class."""
    entry = get_rule(name)
    for field, impl, had in (("signal", signal, entry.signal), ("numpy_rule", numpy_rule, entry.numpy_rule)):
        if impl is not None:
            if had is not None and had is not impl:
                raise KeyError(f"stop rule {name!r} already has a {field}")
            setattr(entry, field, impl)
    return entry


def _probability(p: float) -> bool:
    return 0 < p <= 1


def _positive(p: float) -> bool:
    return p > 0


def _whole(p: float) -> bool:
    return float(p).is_integer() and p >= 1


def _count(p: float) -> bool:
    return float(p).is_integer() and p >= 0


for _entry in (
    RuleEntry("threshold", "threshold", "in (0, 1] (a stop probability)", _probability, "policy", runtime=True),
    RuleEntry("quantile", "alpha", "in (0, 1] (alpha: the stop-time quantile)", _probability, "policy", runtime=True),
    RuleEntry("price", "price", "a finite number (the price of full depth in log-probability units; 0 = the plan's MAP)",
              math.isfinite, "policy", plans=True, runtime=True),
    RuleEntry("tolerance", "tol", "> 0 (the change between steps below which to stop)", _positive, "task", runtime=True),
    RuleEntry("confidence", "q", "in (0, 1] (a softmax probability)", _probability, "classifier", runtime=True),
    RuleEntry("entropy", "max_entropy", "> 0 (an entropy in nats)", _positive, "classifier", runtime=True),
    RuleEntry("patience", "k", "an integer >= 0 (exits in a row; 0 stops at the first exit)", _count, "classifier"),
    RuleEntry("fixed", "depth", "an integer >= 1 (the depth)", _whole, "every task", runtime=True),
):
    register_rule(_entry)

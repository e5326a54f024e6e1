"""Task helpers shared by the commands (core/task.py): a rule a run's policy cannot serve is refused naming the flag."""
from __future__ import annotations

import pytest

from learn2stop.core import StoppingModel
from learn2stop.utils.config import ConfigError

from conftest import ToyPolicy, ToyStepModel


def test_the_price_rule_needs_a_planning_policy():
    from learn2stop.core.task import check_policy_rule

    sm = StoppingModel(ToyStepModel(), ToyPolicy())
    with pytest.raises(ConfigError, match=r"--rule: the 'price' rule reads a planned q_phi, and this run's policy does not"):
        check_policy_rule("price", sm, "--rule")
    check_policy_rule("quantile", sm, "--rule")  # every policy has the per-step rules

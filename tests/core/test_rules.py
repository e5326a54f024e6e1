"""Stop rules refuse parameters outside their range at construction, naming the parameter."""
import pytest

from learn2stop.core import FixedDepth, PolicyRule, SignalRule, ToleranceRule, QuantileSignal

from test_model import sm  # noqa: F401 - the LISTA stopping model fixture


@pytest.mark.parametrize("make, message", [
    (lambda p: PolicyRule(p, threshold=float("nan")), "threshold"),
    (lambda p: PolicyRule(p, threshold=True), "threshold"),
    (lambda p: PolicyRule(p, mode="greedy"), "mode"),
    (lambda p: ToleranceRule(float("nan")), "tol"),
    (lambda p: ToleranceRule(-1.0), "tol"),
    (lambda p: ToleranceRule(float("inf")), "tol"),
    (lambda p: FixedDepth(True), "depth"),
    (lambda p: FixedDepth(0), "depth"),
    (lambda p: FixedDepth(2.5), "depth"),
    (lambda p: SignalRule(QuantileSignal(p), float("nan")), "threshold"),
])
def test_stop_rules_refuse_bad_parameters(sm, make, message):
    with pytest.raises(ValueError, match=message):
        make(sm.policy)

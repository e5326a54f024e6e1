"""The inference config: per-rule parameter ranges, and a rule that needs a policy says so."""
import pytest

from learn2stop.core import InferenceConfig
from learn2stop.utils.config import ConfigError

from test_model import sm  # noqa: F401 - the LISTA stopping model fixture


def test_inference_rule_that_needs_a_policy_says_so(sm):
    with pytest.raises(ValueError, match="needs a stopping policy"):
        InferenceConfig(rule="quantile").make_rule(None)


# ----------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("kwargs, message", [
    (dict(rule="tolerance", param=-1), "inference.param: the tolerance rule's parameter must be > 0"),
    (dict(rule="tolerance", param=0), "inference.param: the tolerance rule's parameter must be > 0"),
    (dict(rule="confidence", param=2), r"inference.param: the confidence rule's parameter must be in \(0, 1\]"),
    (dict(rule="patience", param=0.5), "inference.param: the patience rule's parameter must be an integer >= 0"),
    (dict(rule="entropy", param=-1), "inference.param: the entropy rule's parameter must be > 0"),
    (dict(param=True), "inference.param: must be a finite number; got True"),
    (dict(sampled="yes"), "inference.sampled: must be true or false"),
    (dict(use_calibrated="no"), "inference.use_calibrated: must be true or false"),
])
def test_inference_config_ranges_per_rule(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InferenceConfig(**kwargs)
    assert InferenceConfig(rule="patience", param=2).param == 2

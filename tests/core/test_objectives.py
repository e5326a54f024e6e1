"""The method and stage configs refuse a bad field at construction, naming it."""
import pytest

from learn2stop.core import MethodConfig, StageConfig
from learn2stop.utils.config import ConfigError


@pytest.mark.parametrize("kwargs, field", [
    ({"iterations": True}, "iterations"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"lr": float("nan")}, "lr"),
    ({"lr": float("inf")}, "lr"),
    ({"beta": 0.0}, "beta"),
    ({"price": -1.0}, "price"),
    ({"lr_decay_at": 0.5}, "lr_decay_at"),
    ({"eval_every": False}, "eval_every"),
    ({"objective": "stage4"}, "objective"),
    ({"variant": "magic"}, "variant"),
    ({"select": "best"}, "select"),
    ({"step_weights": (1.0, float("nan"))}, "step_weights"),
])
def test_stage_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        StageConfig(**{"objective": "stage1", **kwargs})


@pytest.mark.parametrize("kwargs, field", [
    ({"beta": float("nan")}, "method.beta"), ({"prior": "poisson"}, "method.prior"), ({"price": True}, "method.price"),
])
def test_method_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MethodConfig(**kwargs)

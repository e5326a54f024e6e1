"""Sparse recovery's config: bad values name the field; unknown presets are refused."""
import pytest

from learn2stop.tasks.sparse import preset
from learn2stop.utils.config import ConfigError


@pytest.mark.parametrize("over, field", [
    ({"stage1": {"beta": 0.0}}, "stage1.beta"),
    ({"lista": {"num_steps": 0}}, "lista.num_steps"),
    ({"problem": {"sparsity": 1.5}}, "problem.sparsity"),
    ({"problem": {"matrix": "ortho"}}, "problem.matrix"),
    ({"stage2": {"objective": "stage1"}}, "stage2.objective"),  # a changed objective takes its own variant
    ({"stage3": {"objective": "aevb"}}, "stage3.objective"),
    ({"lista": {"bogus": 1}}, "lista.bogus"),
])
def test_bad_config_values_name_the_field(over, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        preset("quick", **over)
    with pytest.raises(KeyError, match="unknown sparse preset"):
        preset("huge")

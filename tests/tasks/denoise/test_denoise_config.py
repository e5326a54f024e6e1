"""Denoising's config: bad values name the field."""
import pytest

from learn2stop.tasks.denoise.config import DataConfig, EvalConfig, DenoiseCommandConfig
from learn2stop.utils.config import ConfigError


@pytest.mark.parametrize("cls, kw, field", [
    (DataConfig, {"sigma_max": -1.0}, "data.sigma_max"),
    (DataConfig, {"sigma_set": (35.0, -5.0)}, "data.sigma_set"),
    (DataConfig, {"patch_size": 0}, "data.patch_size"),
    (DataConfig, {"val_fraction": 1.0}, "data.val_fraction"),
    (EvalConfig, {"sigmas": (-15.0,)}, "eval.sigmas"),
    (DenoiseCommandConfig, {"model": "bm3d"}, "denoise.model"),
])
def test_bad_config_values_name_the_field(cls, kw, field):
    with pytest.raises(ConfigError, match=field):
        cls(**kw)

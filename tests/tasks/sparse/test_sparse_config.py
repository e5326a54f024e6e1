"""Sparse recovery's config: bad values name the field; unknown presets are refused."""
import pytest

from learn2stop.tasks.sparse import preset
from learn2stop.utils.config import ConfigError
from learn2stop.cli import main
from learn2stop.utils.config_files import resolve
from learn2stop.utils.config_flags import leaf_fields


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


@pytest.mark.parametrize("flags, field", [
    (["--problem.m", "200000", "--problem.n", "400000"], "problem: needs about"),
    (["--classical.depths", ""], "depths"),
    (["--classical.L_grid", ""], "L_grid"),
])
def test_sparse_configs_that_would_fail_late_are_refused_first(flags, field, tmp_path, capsys):
    try:
        rc = main(["sparse", "train", "--run-dir", str(tmp_path / "r"), "--no-progress", *flags])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and field in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- a real task config
def _sparse_field(name):
    sparse = pytest.importorskip("learn2stop.tasks.sparse.config")
    if name not in {n for n, _, _ in leaf_fields(sparse.SparseConfig)}:
        pytest.skip(f"SparseConfig has no field {name} any more")
    return sparse.SparseConfig


@pytest.mark.parametrize("field, value, match", [
    ("lista.L", float("inf"), r"lista\.L: must be a finite number; got inf"),
    ("lista.rho", float("nan"), r"lista\.rho: must be a finite number; got nan"),
    ("lista.num_steps", True, r"lista\.num_steps: expected int, not a boolean"),
    ("classical.depths", 20, r"classical\.depths: expected a list"),
    ("classical.L_grid", [3.0, float("inf")], r"classical\.L_grid\[1\]: must be a finite number"),
])
def test_sparse_config_refuses_non_finite_bool_and_scalar_for_list(field, value, match):
    cls = _sparse_field(field)
    section, leaf = field.split(".")
    with pytest.raises(ConfigError, match=match):
        resolve(cls, {}, None, {section: {leaf: value}})


def test_sparse_empty_yaml_section_keeps_the_preset(tmp_path):
    sparse = pytest.importorskip("learn2stop.tasks.sparse.config")
    preset = {"lista": {"rho": 0.125, "L": 4.5}}
    (tmp_path / "c.yaml").write_text("lista:\n")
    cfg = resolve(sparse.SparseConfig, preset, str(tmp_path / "c.yaml"), {"lista": {"L": 5.0}})
    assert (cfg.lista.rho, cfg.lista.L) == (0.125, 5.0)


def test_sparse_file_value_hidden_by_a_flag_is_refused(tmp_path):
    sparse = pytest.importorskip("learn2stop.tasks.sparse.app")
    (tmp_path / "c.yaml").write_text("lista:\n  L: -3\n")
    with pytest.raises(ConfigError, match=r"^lista\.L: must be > 0; got -3\.0 \(set in config file .*c\.yaml\)") as e:
        resolve(sparse.SparseConfig, sparse.PRESETS["quick"], str(tmp_path / "c.yaml"), {"lista": {"L": 4.0}})
    assert e.value.field == "lista.L"

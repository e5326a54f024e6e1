"""Bad config inputs: every one refused before any work, with a message naming the field."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest

from learn2stop.utils.config import (ConfigError, check_fields, finite, fraction, from_dict, in_open_unit, merge, non_empty,
                                     non_negative, non_negative_int, positive, positive_int, require, to_dict)
from learn2stop.utils.config_files import MAX_BYTES, MAX_DEPTH, MAX_NODES, load_yaml, resolve
from learn2stop.utils.config_flags import leaf_fields


@dataclasses.dataclass
class Inner:
    lr: float = 1.0
    steps: int = 3
    widths: tuple[int, ...] = (4, 4)
    name: str = "adam"


@dataclasses.dataclass
class Outer:
    seed: int = 0
    flag: bool = False
    scale: Optional[float] = None
    grid: tuple[float, ...] = (0.1, 0.2)
    stage: Inner = dataclasses.field(default_factory=Inner)


PRESET = {"seed": 7, "stage": {"lr": 0.5, "steps": 9, "name": "sgd"}}


# ----------------------------------------------------------------------------- merging field by field
@pytest.mark.parametrize("section", ["stage:\n", "stage: {}\n", "stage: null\n", "stage:\nseed: 7\n"])
def test_empty_yaml_section_plus_a_flag_keeps_the_preset(tmp_path, section):
    path = tmp_path / "c.yaml"
    path.write_text(section)
    cfg = resolve(Outer, PRESET, str(path), {"stage": {"lr": 0.25}})
    assert cfg.stage == Inner(lr=0.25, steps=9, widths=(4, 4), name="sgd")
    assert cfg.seed == 7


def test_merge_treats_none_as_no_change_and_merges_recursively():
    base = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "f": 4}
    assert merge(base, {"a": None}) == base
    assert merge(base, {"a": {"c": {"e": 9}}}) == {"a": {"b": 1, "c": {"d": 2, "e": 9}}, "f": 4}
    assert merge(base, None) == base
    assert merge({"x": None}, {"x": 5}) == {"x": 5}  # a leaf set to None is a value, not a section


def test_from_dict_none_section_means_defaults_and_cli_lists_still_split():
    cfg = from_dict(Outer, {"stage": None, "grid": "0.5,0.25", "seed": "3"})
    assert cfg.stage == Inner() and cfg.grid == (0.5, 0.25) and cfg.seed == 3


def test_dotted_yaml_keys_expand_into_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage.lr: 0.125\nstage:\n  steps: 4\n")
    cfg = resolve(Outer, PRESET, str(path))
    assert (cfg.stage.lr, cfg.stage.steps, cfg.stage.name) == (0.125, 4, "sgd")


# ----------------------------------------------------------------------------- generic type checks
@pytest.mark.parametrize("data, match", [
    ({"stage": {"lr": float("inf")}}, r"^stage\.lr: must be a finite number; got inf"),
    ({"stage": {"lr": float("-inf")}}, r"^stage\.lr: must be a finite number"),
    ({"stage": {"lr": float("nan")}}, r"^stage\.lr: must be a finite number; got nan"),
    ({"stage": {"lr": "nan"}}, r"^stage\.lr: must be a finite number; got 'nan'"),
    ({"stage": {"lr": "1e999"}}, r"^stage\.lr: must be a finite number"),
    ({"scale": float("nan")}, r"^scale: must be a finite number"),
    ({"grid": [0.1, float("inf")]}, r"^grid\[1\]: must be a finite number"),
    ({"stage": {"steps": True}}, r"^stage\.steps: expected int, not a boolean"),
    ({"stage": {"lr": False}}, r"^stage\.lr: expected float, not a boolean"),
    ({"stage": {"widths": [4, True]}}, r"^stage\.widths\[1\]: expected int, not a boolean"),
    ({"stage": {"steps": 2.5}}, r"^stage\.steps: expected int; got 2\.5"),
    ({"stage": {"steps": "1e400"}}, r"^stage\.steps: expected int"),
    ({"stage": {"steps": float("inf")}}, r"^stage\.steps: expected int; got inf"),
    ({"stage": {"widths": 20}}, r"^stage\.widths: expected a list .*got 20"),
    ({"grid": 0.5}, r"^grid: expected a list"),
    ({"stage": {"widths": "4,x"}}, r"^stage\.widths\[1\]: expected int; got 'x'"),
    ({"stage": {"widths": [[4]]}}, r"^stage\.widths\[0\]: expected a single int, not a list"),
    ({"seed": [1, 2]}, r"^seed: expected a single int, not a list"),
    ({"stage": {"lr": [0.1]}}, r"^stage\.lr: expected a single float, not a list"),
    ({"stage": {"name": {"a": 1}}}, r"^stage\.name: expected a single str, not a mapping"),
    ({"flag": "maybe"}, r"^flag: expected bool; got 'maybe'"),
    ({"flag": [True]}, r"^flag: expected a single bool, not a list"),
    ({"stage": 5}, r"^stage: expected a mapping; got int"),
    ({"stage": {"lrr": 1.0}}, r"^stage\.lrr: unknown config field"),
    ({1: 2, "zzz": 3}, r"^1: unknown config field"),
])
def test_bad_values_name_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(Outer, data)


def test_python_constructed_config_can_check_its_own_fields():
    @dataclasses.dataclass
    class Checked:
        lr: float = 1.0
        steps: int = 2
        depths: tuple[int, ...] = (1,)

        def __post_init__(self):
            check_fields(self)

    assert Checked(lr=2).lr == 2  # an int is fine for a float field
    with pytest.raises(ConfigError, match=r"^lr: must be a finite number; got nan"):
        Checked(lr=math.nan)
    with pytest.raises(ConfigError, match=r"^steps: expected int, not a boolean"):
        Checked(steps=True)
    with pytest.raises(ConfigError, match=r"^depths: expected tuple.*got the string '20'"):
        Checked(depths="20")


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


# ----------------------------------------------------------------------------- YAML files
@pytest.mark.parametrize("content, match", [
    ("seed: 3  # caf\xe9\n".encode("latin-1"), r"c\.yaml is not UTF-8 text \(byte 0xe9"),
    (b"\xff\xfes\x00e\x00", r"c\.yaml is not UTF-8 text"),
    (b"seed: 3\nseed: 4\n", r"c\.yaml is not valid YAML: key 'seed' is given twice"),
    (b"- 1\n- 2\n", r"c\.yaml must hold a mapping at top level; got list"),
    (b"seed: [1, 2\n", r"c\.yaml is not valid YAML"),
    (b"stage.lr: 1\nstage:\n  lr: 2\n", r"^stage\.lr: set twice in config file .*c\.yaml"),
])
def test_bad_yaml_files_name_the_file(tmp_path, content, match):
    (tmp_path / "c.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        load_yaml(tmp_path / "c.yaml")


def test_yaml_path_that_is_a_directory_or_missing(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_yaml(tmp_path)
    with pytest.raises(ConfigError, match="config file not found"):
        resolve(Outer, {}, str(tmp_path / "none.yaml"))
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}


# ----------------------------------------------------------------------------- helpers
@pytest.mark.parametrize("check, value, match", [
    (positive_int, 0, r"^f: must be an integer >= 1; got 0"),
    (positive_int, True, r"^f: must be an integer >= 1; got True"),
    (positive_int, 2.0, r"^f: must be an integer >= 1; got 2\.0"),
    (non_negative_int, -1, r"^f: must be an integer >= 0; got -1"),
    (non_negative_int, False, r"^f: must be an integer >= 0; got False"),
    (finite, math.nan, r"^f: must be a finite number; got nan"),
    (finite, "1.0", r"^f: must be a finite number; got '1\.0'"),
    (in_open_unit, 1.0, r"^f: must be in \(0, 1\); got 1\.0"),
    (in_open_unit, 0, r"^f: must be in \(0, 1\); got 0"),
    (fraction, 0.0, r"^f: must be in \(0, 1\]; got 0\.0"),
    (fraction, 1.5, r"^f: must be in \(0, 1\]; got 1\.5"),
    (positive, math.inf, r"^f: must be > 0; got inf"),
    (positive, True, r"^f: must be > 0; got True"),
    (non_negative, -math.inf, r"^f: must be >= 0; got -inf"),
    (non_empty, (), r"^f: must list at least one value; got \(\)"),
])
def test_helpers_refuse_and_name_the_field(check, value, match):
    with pytest.raises(ConfigError, match=match):
        check(value, "f")


def test_helpers_accept_good_values():
    positive_int(1, "f"), non_negative_int(0, "f"), finite(-2.5, "f"), in_open_unit(0.5, "f")
    fraction(1.0, "f"), positive(1e-9, "f"), non_negative(0, "f"), non_empty([1], "f")
    assert to_dict(Outer())["stage"]["widths"] == [4, 4]


# ----------------------------------------------------------------------------- limits on a file, before anything is built
@pytest.mark.parametrize("text", [
    "seed: " + "[" * 5000 + "]" * 5000 + "\n",  # flow sequences 5,000 deep
    "seed: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",  # flow mappings 5,000 deep
    "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "x: 1\n",  # block mappings 200 deep
], ids=["lists", "mappings", "block"])
def test_a_file_nested_too_deep_is_refused_naming_the_file(tmp_path, text):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"^config file .*c\.yaml nests deeper than {MAX_DEPTH} levels"):
        resolve(Outer, {}, str(tmp_path / "c.yaml"))


def test_a_file_of_megabytes_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "c.yaml").write_text("seed: 3\n" + "#" * (MAX_BYTES + 1) + "\n")
    with pytest.raises(ConfigError, match=r"^config file .*c\.yaml is larger than \d+ MiB"):
        load_yaml(tmp_path / "c.yaml")


def test_aliases_that_expand_beyond_the_limit_are_refused_not_expanded(tmp_path):
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: 1" for i in range(10)) + "}"]
    lines += [f"l{n}: &l{n} {{" + ", ".join(f"k{i}: *l{n - 1}" for i in range(10)) + "}" for n in range(1, 6)]
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\n")  # 10**6 values once expanded
    with pytest.raises(ConfigError, match=rf"^config file .*c\.yaml holds more than {MAX_NODES} values"):
        load_yaml(tmp_path / "c.yaml")


@pytest.mark.parametrize("content, match", [
    ("? [1, 2]\n: 3\n", r"is not valid YAML: a key must be a name, not a sequence"),
    ("seed: " + "9" * 5000 + "\n", r"holds a value that cannot be read"),
    ("seed: !!python/object/apply:os.getcwd []\n", r"is not valid YAML: could not determine a constructor"),
], ids=["unhashable-key", "int-of-5000-digits", "python-tag"])
def test_yaml_that_pyyaml_cannot_build_safely_is_a_config_error(tmp_path, content, match):
    (tmp_path / "c.yaml").write_text(content)
    with pytest.raises(ConfigError, match=rf"^config file .*c\.yaml {match}"):
        load_yaml(tmp_path / "c.yaml")


def test_files_are_read_with_a_safe_loader_only():
    import inspect

    import yaml

    from learn2stop.utils import config_files

    assert issubclass(config_files._UniqueKeyLoader, yaml.SafeLoader)
    source = inspect.getsource(config_files)
    assert "yaml.load(" in source and "Loader=_UniqueKeyLoader" in source
    assert "yaml.unsafe_load" not in source and "FullLoader" not in source and "UnsafeLoader" not in source


# ----------------------------------------------------------------------------- a file's value is its own statement
@dataclasses.dataclass
class Rule:
    kind: str = "ratio"
    value: float = 0.5

    def __post_init__(self):
        if self.kind == "ratio":
            in_open_unit(self.value, "rule.value")
        else:
            require(self.value >= 1, "rule.value", f"a step must be >= 1; got {self.value}")


@dataclasses.dataclass
class WithRule:
    seed: int = 0
    rule: Rule = dataclasses.field(default_factory=Rule)


@pytest.mark.parametrize("text, flags, match", [
    ("stage:\n  lr: 2\n", {"stage": {"lr": 0.25}}, None),  # a valid value a flag overrides: the flag wins
    ("stage:\n  steps: x\n", {"stage": {"steps": 4}}, r"^stage\.steps: expected int; got 'x' \(set in config file"),
    ("seed: 1.5\n", {"seed": 2}, r"^seed: expected int; got 1\.5 \(set in config file .*c\.yaml\)"),
    ("stage:\n  widths: [4, true]\n", {"stage": {"widths": "3"}}, r"^stage\.widths\[1\]: expected int, not a boolean"),
])
def test_a_bad_value_in_the_file_is_refused_even_when_a_flag_overrides_it(tmp_path, text, flags, match):
    (tmp_path / "c.yaml").write_text(text)
    if match is None:
        assert resolve(Outer, {}, str(tmp_path / "c.yaml"), flags).stage.lr == 0.25
        return
    with pytest.raises(ConfigError, match=match):
        resolve(Outer, {}, str(tmp_path / "c.yaml"), flags)


def test_a_files_value_is_judged_with_the_flags_it_does_not_contradict(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rule:\n  value: 7\n")  # a step: valid once the flag says the rule counts steps
    assert resolve(WithRule, {}, str(path), {"rule": {"kind": "steps"}}).rule == Rule("steps", 7.0)
    with pytest.raises(ConfigError, match=r"^rule\.value: must be in \(0, 1\); got 7\.0 \(set in config file"):
        resolve(WithRule, {}, str(path), {"rule": {"value": 0.5}})  # the flag hides the file's value: still refused
    path.write_text("rule:\n  kind: ratio\n")
    with pytest.raises(ConfigError, match=r"^rule\.value: must be in \(0, 1\); got 7\.0$"):
        resolve(WithRule, {}, str(path), {"rule": {"value": 7}})  # the flag's own mistake: no file named


def test_sparse_file_value_hidden_by_a_flag_is_refused(tmp_path):
    sparse = pytest.importorskip("learn2stop.tasks.sparse.app")
    (tmp_path / "c.yaml").write_text("lista:\n  L: -3\n")
    with pytest.raises(ConfigError, match=r"^lista\.L: must be > 0; got -3\.0 \(set in config file .*c\.yaml\)") as e:
        resolve(sparse.SparseConfig, sparse.PRESETS["quick"], str(tmp_path / "c.yaml"), {"lista": {"L": 4.0}})
    assert e.value.field == "lista.L"


# ----------------------------------------------------------------------------- values shown short
def test_a_value_nested_thousands_deep_or_megabytes_long_gives_a_short_one_line_error():
    deep: object = 1
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(ConfigError, match=r"^stage\.name: expected a single str, not a mapping; got \{'a': \{'a': "):
        from_dict(Outer, {"stage": {"name": deep}})
    with pytest.raises(ConfigError, match=r"^seed: expected int; got 'x+\.\.\.x+'$") as e:
        from_dict(Outer, {"seed": "x" * 2 ** 20})
    assert len(str(e.value)) < 200
    with pytest.raises(ConfigError, match=r"^'': unknown config field"):
        from_dict(Outer, {"": 1})
    with pytest.raises(ConfigError, match=r"^'a\\nb': unknown config field"):
        from_dict(Outer, {"a\nb": 1})

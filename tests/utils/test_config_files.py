"""Config files and their layering (learn2stop.utils.config_files): a preset, a YAML file and flags merged field by
field; files refused naming the file (not UTF-8, duplicate keys, too deep, too large, unsafe tags) before anything
is built; a file's bad value refused even where a flag overrides it."""
from __future__ import annotations

import dataclasses

import pytest

from learn2stop.utils.config import ConfigError, in_open_unit, require
from learn2stop.utils.config_files import MAX_BYTES, MAX_DEPTH, MAX_NODES, load_yaml, resolve

from test_config import PRESET, Inner, Outer


# ----------------------------------------------------------------------------- merging field by field
@pytest.mark.parametrize("section", ["stage:\n", "stage: {}\n", "stage: null\n", "stage:\nseed: 7\n"])
def test_empty_yaml_section_plus_a_flag_keeps_the_preset(tmp_path, section):
    path = tmp_path / "c.yaml"
    path.write_text(section)
    cfg = resolve(Outer, PRESET, str(path), {"stage": {"lr": 0.25}})
    assert cfg.stage == Inner(lr=0.25, steps=9, widths=(4, 4), name="sgd")
    assert cfg.seed == 7


def test_dotted_yaml_keys_expand_into_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage.lr: 0.125\nstage:\n  steps: 4\n")
    cfg = resolve(Outer, PRESET, str(path))
    assert (cfg.stage.lr, cfg.stage.steps, cfg.stage.name) == (0.125, 4, "sgd")


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

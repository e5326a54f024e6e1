"""Property tests of the config layers on a real task's config (sparse): whatever a user writes -- a dict, a
YAML file, flag strings -- is either accepted, and then round-trips (dict, YAML file) to the same config, or
refused with a :class:`ConfigError` naming a field or the file. Never another exception."""
from __future__ import annotations

import argparse
import copy

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from learn2stop.tasks.sparse.config import PRESETS, SparseConfig  # noqa: E402
from learn2stop.utils.config import ConfigError, from_dict, merge, to_dict  # noqa: E402
from learn2stop.utils.config_files import load_yaml, resolve, save_yaml  # noqa: E402
from learn2stop.utils.config_flags import leaf_fields, overrides_from_args  # noqa: E402

LEAVES = [name for name, _, _ in leaf_fields(SparseConfig)]
SECTIONS = sorted({name.split(".")[0] for name in LEAVES if "." in name})
BASE = to_dict(SparseConfig())
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(FAST, max_examples=25)  # each example writes and parses a YAML file twice

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.text(max_size=12),
    st.sampled_from(["soft", "plan", "quantile", "threshold", "price", "stage2", "forward_kl", "1e3", "20,30", "none",
                     "true", "", "nan", "-1", "0.5", "3"]))
# values nest in lists and mappings a few levels deep, and now and then very deep
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=12)


def _deep(depth: int, list_: bool):
    node: object = 1
    for _ in range(depth):
        node = [node] if list_ else {"a": node}
    return node


values = st.one_of(values, st.builds(_deep, st.integers(100, 3000), st.booleans()))
keys = st.one_of(st.sampled_from(LEAVES), st.sampled_from(SECTIONS), st.text(max_size=10))


def _set(data: dict, dotted: str, value) -> dict:
    """``data`` with the dotted field set (its sections made as needed)."""
    *parents, leaf = dotted.split(".")
    node = data
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[leaf] = value
    return data


TYPES = {name: tp for name, tp, _ in leaf_fields(SparseConfig)}


def _plausible(name: str):
    """Values of the field's own type, in a range a user might write (so that many configs are accepted)."""
    tp = str(TYPES[name])
    if "tuple" in tp:
        return st.lists(st.integers(1, 30) if "int" in tp else st.floats(0.01, 10), max_size=3)
    if "bool" in tp:
        return st.booleans()
    if "int" in tp:
        return st.integers(0, 60)
    if "float" in tp:
        return st.one_of(st.floats(0, 1), st.floats(1, 100), *([st.none()] if "None" in tp else []))
    return st.sampled_from(sorted({"", "soft", "plan", "quantile", "adam", "constant", "ista"}))


@st.composite
def config_dicts(draw):
    """A valid config with a few fields set to plausible values, and a few (or unknown keys, or whole sections)
    set to anything."""
    data = copy.deepcopy(merge(BASE, PRESETS[draw(st.sampled_from(sorted(PRESETS)))]))
    for name in draw(st.lists(st.sampled_from(LEAVES), max_size=3)):
        data = _set(data, name, draw(_plausible(name)))
    for key, value in draw(st.lists(st.tuples(keys, values), max_size=2)):
        data = _set(data, key, value)
    return data


def _names_a_field_or_file(e: ConfigError, where: str | None = None) -> None:
    event("refused")
    text = str(e)
    assert "\n" not in text and len(text) < 2000, text[:300]
    assert e.field or (where and where in text), text


def _round_trips(cfg, tmp_path) -> None:
    event("accepted")
    assert from_dict(SparseConfig, to_dict(cfg)) == cfg
    assert to_dict(from_dict(SparseConfig, to_dict(cfg))) == to_dict(cfg)
    path = tmp_path / "saved.yaml"
    save_yaml(cfg, path)
    assert from_dict(SparseConfig, load_yaml(path)) == cfg


@FAST
@given(data=config_dicts())
def test_any_dict_is_a_config_that_round_trips_or_a_refusal_naming_a_field(tmp_path_factory, data):
    try:
        cfg = from_dict(SparseConfig, data)
    except ConfigError as e:
        _names_a_field_or_file(e)
        return
    _round_trips(cfg, tmp_path_factory.mktemp("rt"))


def _as_flag(value) -> str:
    """A value as typed after its flag: ``5,10``, ``true``, ``none``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(_as_flag, value))
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@st.composite
def flag_strings(draw, max_size: int = 3):
    """(field, text after its flag) pairs: the field's own kind of value, or any text."""
    names = draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=max_size))
    return [(n, draw(st.one_of(_plausible(n).map(_as_flag), st.text(max_size=12)))) for n in names]


@FEWER
@given(data=config_dicts(), flags=flag_strings())
def test_any_yaml_file_and_flags_give_a_config_or_a_refusal_naming_a_field_or_the_file(tmp_path_factory, data, flags):
    path = tmp_path_factory.mktemp("y") / "c.yaml"
    try:
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    except RecursionError:  # PyYAML's own writer cannot write a value this deep; write it as flow text
        path.write_text("seed: " + "[" * 3000 + "]" * 3000 + "\n")
    args = argparse.Namespace(**{f"cfg:{name}": value for name, value in flags})
    try:
        cfg = resolve(SparseConfig, PRESETS["quick"], str(path), overrides_from_args(args))
    except ConfigError as e:
        _names_a_field_or_file(e, str(path))
        return
    _round_trips(cfg, path.parent)


@FAST
@given(text=st.one_of(st.text(max_size=200),
                      st.builds(lambda a, b, c: a + b + c, st.sampled_from(["", "lista:\n  ", "seed: ", "stage1.lr: "]),
                                st.text(alphabet="[]{}:,-&*!|>?'\"#%@ \n\tabc01.", max_size=80), st.text(max_size=5))))
def test_any_text_as_a_config_file_is_read_or_refused_naming_the_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("t") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cfg = from_dict(SparseConfig, merge(BASE, load_yaml(path)))
    except ConfigError as e:
        _names_a_field_or_file(e, str(path))
        return
    _round_trips(cfg, path.parent)


@FAST
@given(flags=flag_strings(max_size=4))
def test_any_flag_strings_give_a_config_or_a_refusal_naming_the_field(tmp_path_factory, flags):
    args = argparse.Namespace(**{f"cfg:{name}": value for name, value in flags})
    try:
        cfg = resolve(SparseConfig, PRESETS["quick"], None, overrides_from_args(args))
    except ConfigError as e:
        _names_a_field_or_file(e)
        return
    _round_trips(cfg, tmp_path_factory.mktemp("f"))

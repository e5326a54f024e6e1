"""Config dataclasses (learn2stop.utils.config): sections merged field by field, values checked by type and range,
and every bad value refused before any work with a one-line message naming the field."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest

from learn2stop.utils.config import (ConfigError, check_fields, finite, fraction, from_dict, in_open_unit, merge,
                                     non_empty, non_negative, non_negative_int, positive, positive_int, to_dict)


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


def test_merge_treats_none_as_no_change_and_merges_recursively():
    base = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "f": 4}
    assert merge(base, {"a": None}) == base
    assert merge(base, {"a": {"c": {"e": 9}}}) == {"a": {"b": 1, "c": {"d": 2, "e": 9}}, "f": 4}
    assert merge(base, None) == base
    assert merge({"x": None}, {"x": 5}) == {"x": 5}  # a leaf set to None is a value, not a section


def test_from_dict_none_section_means_defaults_and_cli_lists_still_split():
    cfg = from_dict(Outer, {"stage": None, "grid": "0.5,0.25", "seed": "3"})
    assert cfg.stage == Inner() and cfg.grid == (0.5, 0.25) and cfg.seed == 3


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

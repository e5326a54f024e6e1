"""Typed dataclass configs: their values checked, and converted to and from plain dicts.

Nested dataclass fields become dotted names (``stage1.lr``). Values from a dict (YAML, CLI flags) are
converted by the field's type; each dataclass validates itself in ``__post_init__`` and a bad value raises
:class:`ConfigError` naming the field. Before any ``__post_init__`` runs, every value from a dict is checked
against its field's type: floats must be finite, booleans are not numbers, a list field needs a list (a CLI
string ``"20,30"`` is split on commas) and a scalar field a scalar. A value shown in an error is cut short
(:func:`shown`), so no input, however large or deep, makes an error message that fails or floods.

YAML files and the layers a config is resolved from are :mod:`learn2stop.utils.config_files`; CLI flags and
their help are :mod:`learn2stop.utils.config_flags`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 80, 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def shown(value: Any) -> str:
    """``repr(value)`` cut short (long strings, long or deep lists and mappings), for an error message: a value
    nested thousands deep or megabytes long must not make the message fail or fill the screen."""
    return _SHORT.repr(value)


class ConfigError(ValueError):
    """A config value or option is invalid; the message starts with the field to blame.

    ``field`` is that field (``stage1.lr``, ``--budget``) when one is, for code that reads it (a section
    prefixes its own fields, :meth:`within`); ``reason`` is the rest of the message.
    """

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason

    def within(self, prefix: str) -> "ConfigError":
        """The error seen from the enclosing config: a field named relative to section ``prefix`` ("stage1.")
        gets the prefix; one named in full ("method.beta" in section "method."), or none, is kept."""
        if self.field is None or self.field.startswith(prefix):
            return self
        return ConfigError(self.reason, prefix + self.field)


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError(message, field) (its text: f"{field}: {message}") unless ``ok``."""
    if not ok:
        raise ConfigError(message, field)


def closest(word: str, choices: typing.Iterable[str]) -> str | None:
    """The choice a mistyped ``word`` most likely meant: the one it begins, else difflib's closest match; None if none
    is close."""
    choices = [str(c) for c in choices]
    begun = [c for c in choices if c.startswith(word)]
    if len(begun) == 1:
        return begun[0]
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return match[0] if match else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value: float, field: str) -> None:
    """A finite number (not NaN, not +-inf, not a bool)."""
    require(_is_number(value) and math.isfinite(value), field, f"must be a finite number; got {shown(value)}")


def positive(value: float, field: str) -> None:
    """A finite number > 0."""
    require(_is_number(value) and math.isfinite(value) and value > 0, field, f"must be > 0; got {shown(value)}")


def non_negative(value: float, field: str) -> None:
    """A finite number >= 0."""
    require(_is_number(value) and math.isfinite(value) and value >= 0, field, f"must be >= 0; got {shown(value)}")


def int_at_least(value: int, field: str, least: int) -> None:
    """An integer >= ``least`` (a bool or a float such as 2.0 is refused)."""
    require(_is_int(value) and value >= least, field, f"must be an integer >= {least}; got {shown(value)}")


def ints_at_least(cfg: Any, *names: str, least: int = 1, prefix: str = "") -> None:
    """Each named field of ``cfg`` is an integer >= ``least``; errors name ``prefix + name``."""
    for name in names:
        int_at_least(getattr(cfg, name), prefix + name, least)


def positive_int(value: int, field: str) -> None:
    """An integer >= 1 (a bool or a float such as 2.0 is refused)."""
    int_at_least(value, field, 1)


def non_negative_int(value: int, field: str) -> None:
    """An integer >= 0 (a bool or a float is refused)."""
    int_at_least(value, field, 0)


def in_open_unit(value: float, field: str) -> None:
    """A number strictly between 0 and 1 (a probability threshold)."""
    require(_is_number(value) and 0 < value < 1, field, f"must be in (0, 1); got {shown(value)}")


def fraction(value: float, field: str) -> None:
    """A number in (0, 1] (a share of something, 1 = all of it)."""
    require(_is_number(value) and 0 < value <= 1, field, f"must be in (0, 1]; got {shown(value)}")


def non_empty(value: typing.Sized, field: str) -> None:
    """A list or tuple with at least one element (a grid, a list of depths)."""
    require(isinstance(value, (list, tuple)) and len(value) > 0, field, f"must list at least one value; got {shown(value)}")


def one_of(value: Any, choices: typing.Iterable, field: str) -> None:
    choices = list(choices)
    require(value in choices, field, f"must be one of {choices}; got {shown(value)}")


def to_dict(cfg: Any) -> dict:
    """A plain nested dict (tuples become lists) for YAML and checkpoints."""
    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v
    return conv(cfg)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, field: str) -> Any:
    """Convert a YAML or CLI value to the field's type, or raise ConfigError naming the field.

    Floats must be finite; a bool is not an int or a float; a list field takes a list, or a CLI
    string split on commas ("20,30"), never a bare number; a scalar field never takes a list or a
    mapping.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], field)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip() != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list (YAML [a, b] or a flag a,b); got {shown(value)}", field)
        elem = args[0] if args else str
        if origin is tuple and len(args) >= 2 and args[-1] is not Ellipsis:  # tuple[int, str]: fixed length
            if len(value) != len(args):
                raise ConfigError(f"expected {len(args)} values; got {len(value)}: {shown(value)}", field)
            items = [_convert(v, a, f"{field}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            items = [_convert(v, elem, f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp in (bool, int, float, str) and isinstance(value, (list, tuple, dict)):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        raise ConfigError(f"expected a single {tp.__name__}, not {kind}; got {shown(value)}", field)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ConfigError(f"expected int, not a boolean; got {shown(value)}", field)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, str) and "e" in value.lower():
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError
                return _bounded_int(int(as_float), field)
            return _bounded_int(int(value), field)
        if tp is float:
            if isinstance(value, bool):
                raise ConfigError(f"expected float, not a boolean; got {shown(value)}", field)
            out = float(value)
            if not math.isfinite(out):
                raise ConfigError(f"must be a finite number; got {shown(value)}", field)
            return out
        if tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"expected {_type_name(tp)}; got {shown(value)}", field) from None
    return value


def _bounded_int(value: int, field: str) -> int:
    """An integer that fits the 64 bits torch and numpy use; a seed must also be >= 0."""
    seed = field.rsplit(".", 1)[-1].endswith("seed")
    if seed and not 0 <= value < 2 ** 63:
        raise ConfigError(f"a seed must be an integer in [0, 2**63); got {shown(value)}", field)
    if not -2 ** 63 <= value < 2 ** 63:
        raise ConfigError(f"{shown(value)} does not fit in a 64-bit integer", field)
    return value


def check_fields(cfg: Any, prefix: str = "") -> None:
    """Check a built dataclass's values against its field types (for ``__post_init__``).

    The same generic rules as loading from a dict (finite floats, no bool for a number, lists for
    list fields, scalars for scalar fields), for configs built directly in Python, e.g.
    ``LISTAConfig(L=float("inf"))``. An int is accepted for a float field.

    Example:
        >>> @dataclasses.dataclass
        ... class C:
        ...     lr: float = 1e-3
        ...     def __post_init__(self):
        ...         check_fields(self)
        >>> C(lr=float("nan"))
        Traceback (most recent call last):
        ...
        learn2stop.utils.config.ConfigError: lr: must be a finite number; got nan
    """
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, tp, name = getattr(cfg, f.name), hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            continue  # a nested config checked itself when it was built
        if tp is float and _is_int(value):
            value = float(value)
        if isinstance(value, str) and (tp in (int, float, bool) or typing.get_origin(tp) in (tuple, list)):
            raise ConfigError(f"expected {_type_name(tp)}; got the string {shown(value)}", name)
        _convert(value, tp, name)


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict; unknown keys and bad values name the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping; got {type(data).__name__}", prefix.rstrip(".") or "config")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in data if k not in names), key=str)
    if unknown:
        guess = closest(unknown[0], names) if isinstance(unknown[0], str) else None
        hint = f"; did you mean {guess!r}?" if guess else ""
        key = unknown[0] if isinstance(unknown[0], str) and unknown[0].isidentifier() else shown(unknown[0])
        raise ConfigError(f"unknown config field{hint} (known: {', '.join(sorted(names))})", f"{prefix}{key}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if value is None:  # an empty YAML section: keep the defaults
                continue
            kwargs[name] = from_dict(tp, value, prefix=path + ".")
        else:
            kwargs[name] = _convert(value, tp, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.within(prefix) from None


def merge(base: dict, update: dict | None) -> dict:
    """Recursive dict merge, field by field; ``update`` wins.

    A section set to None in ``update`` (an empty YAML section) changes nothing, and a nested dict
    updates only the fields it names, so an empty section plus a flag keeps the other values.
    """
    out = dict(base)
    for k, v in (update or {}).items():
        if isinstance(out.get(k), dict) and (v is None or isinstance(v, dict)):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


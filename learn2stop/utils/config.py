"""Typed dataclass configs as the one source for Python, YAML and CLI flags.

Nested dataclass fields become dotted flags (``--stage1.lr 1e-3``) and dotted YAML keys. Values
are converted by the field's type; each dataclass validates itself in ``__post_init__`` and a
bad value raises :class:`ConfigError` naming the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError(f"{field}: {message}") unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}: {message}")


def positive(value: float, field: str) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, field, f"must be > 0; got {value!r}")


def non_negative(value: float, field: str) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, field, f"must be >= 0; got {value!r}")


def one_of(value: Any, choices: typing.Iterable, field: str) -> None:
    choices = list(choices)
    require(value in choices, field, f"must be one of {choices}; got {value!r}")


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


def _convert(value: Any, tp: Any, field: str) -> Any:
    """Convert a YAML or CLI value to the field's type, or raise ConfigError naming the field."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], field)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip() != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field}: expected a list; got {value!r}")
        elem = args[0] if args else str
        items = [_convert(v, elem, field) for v in value]
        return tuple(items) if origin is tuple else items
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
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, bool):
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}: expected {getattr(tp, '__name__', tp)}; got {value!r}") from None
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict; unknown keys and bad values name the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping; got {type(data).__name__}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown config field (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, prefix=path + ".")
        else:
            kwargs[name] = _convert(value, tp, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None


def merge(base: dict, update: dict) -> dict:
    """Recursive dict merge; ``update`` wins."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file; a missing or malformed file raises ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def save_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, type, default) of every leaf field of a nested dataclass."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(leaf_fields(tp, prefix + f.name + "."))
        else:
            out.append((prefix + f.name, tp, f.default))
    return out


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--dotted.name`` flag per leaf field; only flags given on the command line override."""
    group = parser.add_argument_group("config fields (override preset and --config)")
    for name, tp, _ in leaf_fields(cls):
        group.add_argument(f"--{name}", dest=f"cfg:{name}", default=argparse.SUPPRESS, metavar=_metavar(tp))


def overrides_from_args(args: argparse.Namespace) -> dict:
    flat = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:")}
    return unflatten(flat)


def _metavar(tp: Any) -> str:
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    return name.upper()


def resolve(cls: type, preset: dict | None = None, yaml_path: str | None = None, overrides: dict | None = None) -> Any:
    """Defaults <- preset <- YAML file <- CLI overrides, then validate by constructing ``cls``."""
    data = to_dict(cls())
    for layer in (preset or {}, load_yaml(yaml_path) if yaml_path else {}, overrides or {}):
        data = merge(data, layer)
    return from_dict(cls, data)

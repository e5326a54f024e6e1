"""Typed dataclass configs as the one source for Python, YAML and CLI flags.

Nested dataclass fields become dotted flags (``--stage1.lr 1e-3``) and dotted YAML keys. Values
are converted by the field's type; each dataclass validates itself in ``__post_init__`` and a
bad value raises :class:`ConfigError` naming the field. A field's docstring (the string right under
it) is its flag's ``--help``.

Layers merge field by field (defaults <- preset <- YAML <- flags): an empty section (``stage1:``
with nothing under it, or ``{}``) changes nothing. Before any ``__post_init__`` runs, every value
from a dict is checked against its field's type: floats must be finite, booleans are not numbers,
a list field needs a list (a CLI string ``"20,30"`` is split on commas) and a scalar field a scalar.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml


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
    require(_is_number(value) and math.isfinite(value), field, f"must be a finite number; got {value!r}")


def positive(value: float, field: str) -> None:
    """A finite number > 0."""
    require(_is_number(value) and math.isfinite(value) and value > 0, field, f"must be > 0; got {value!r}")


def non_negative(value: float, field: str) -> None:
    """A finite number >= 0."""
    require(_is_number(value) and math.isfinite(value) and value >= 0, field, f"must be >= 0; got {value!r}")


def int_at_least(value: int, field: str, least: int) -> None:
    """An integer >= ``least`` (a bool or a float such as 2.0 is refused)."""
    require(_is_int(value) and value >= least, field, f"must be an integer >= {least}; got {value!r}")


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
    require(_is_number(value) and 0 < value < 1, field, f"must be in (0, 1); got {value!r}")


def fraction(value: float, field: str) -> None:
    """A number in (0, 1] (a share of something, 1 = all of it)."""
    require(_is_number(value) and 0 < value <= 1, field, f"must be in (0, 1]; got {value!r}")


def non_empty(value: typing.Sized, field: str) -> None:
    """A list or tuple with at least one element (a grid, a list of depths)."""
    require(isinstance(value, (list, tuple)) and len(value) > 0, field, f"must list at least one value; got {value!r}")


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
            raise ConfigError(f"expected a list (YAML [a, b] or a flag a,b); got {value!r}", field)
        elem = args[0] if args else str
        if origin is tuple and len(args) >= 2 and args[-1] is not Ellipsis:  # tuple[int, str]: fixed length
            if len(value) != len(args):
                raise ConfigError(f"expected {len(args)} values; got {len(value)}: {value!r}", field)
            items = [_convert(v, a, f"{field}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            items = [_convert(v, elem, f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp in (bool, int, float, str) and isinstance(value, (list, tuple, dict)):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        raise ConfigError(f"expected a single {tp.__name__}, not {kind}; got {value!r}", field)
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
                raise ConfigError(f"expected int, not a boolean; got {value!r}", field)
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
                raise ConfigError(f"expected float, not a boolean; got {value!r}", field)
            out = float(value)
            if not math.isfinite(out):
                raise ConfigError(f"must be a finite number; got {value!r}", field)
            return out
        if tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"expected {_type_name(tp)}; got {value!r}", field) from None
    return value


def _bounded_int(value: int, field: str) -> int:
    """An integer that fits the 64 bits torch and numpy use; a seed must also be >= 0."""
    seed = field.rsplit(".", 1)[-1].endswith("seed")
    if seed and not 0 <= value < 2 ** 63:
        raise ConfigError(f"a seed must be an integer in [0, 2**63); got {value}", field)
    if not -2 ** 63 <= value < 2 ** 63:
        raise ConfigError(f"{value} does not fit in a 64-bit integer", field)
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
            raise ConfigError(f"expected {_type_name(tp)}; got the string {value!r}", name)
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
        raise ConfigError(f"unknown config field{hint} (known: {', '.join(sorted(names))})", f"{prefix}{unknown[0]}")
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _expand_dotted(data: dict, where: str, prefix: str = "") -> dict:
    """{"stage1.lr": 1, "seed": 0} -> {"stage1": {"lr": 1}, "seed": 0}; a field set twice is an error."""
    out: dict = {}
    for key, value in data.items():
        parts = key.split(".") if isinstance(key, str) else [key]
        if isinstance(value, dict):
            value = _expand_dotted(value, where, prefix + ".".join(map(str, parts)) + ".")
        for p in reversed(parts[1:]):
            value = {p: value}
        _add_unique(out, parts[0], value, where, prefix)
    return out


def _add_unique(node: dict, key: Any, value: Any, where: str, prefix: str) -> None:
    if key not in node:
        node[key] = value
    elif isinstance(node[key], dict) and isinstance(value, dict):
        for k, v in value.items():
            _add_unique(node[key], k, v, where, f"{prefix}{key}.")
    else:
        raise ConfigError(f"set twice in {where}", f"{prefix}{key}")


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file; a missing, unreadable, non-UTF-8 or malformed file raises ConfigError naming it.

    Dotted keys (``stage1.lr: 1e-3``) are expanded into sections; a key given twice is an error.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if path.exists() and not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file (a device, pipe or socket); give a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                          f"at offset {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level; got {type(data).__name__}")
    return _expand_dotted(data, f"config file {path}")


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write a config (dataclass or dict) as YAML, atomically: a kill never leaves half a file."""
    from .report import write_text_atomic

    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right under the field, as Sphinx and IDEs read it),
    folded to one line: the help of its flag. Inherited fields keep their base class's docstring."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.lru_cache(maxsize=None)
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (a frozen app, a class made in a REPL): flags without help
        return {}
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    return {node.target.id: " ".join(after.value.value.split())
            for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def _leaves(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, Any, str]]:
    """(dotted name, type, default, docstring) of every leaf field of a nested dataclass."""
    hints, docs = _hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, prefix + f.name + ".")
        else:
            yield prefix + f.name, tp, f.default, docs.get(f.name, "")


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, type, default) of every leaf field of a nested dataclass."""
    return [(name, tp, default) for name, tp, default, _ in _leaves(cls, prefix)]


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, values: dict | None = None) -> None:
    """One ``--section.field`` flag per leaf field, in one group per section, its help the field's docstring and
    the value it has in ``values`` (a resolved config as a dict, e.g. a preset's; default: ``cls()``'s). Only the
    flags given on the command line override (:func:`overrides_from_args`)."""
    values = to_dict(cls()) if values is None else values
    hints, docs, groups = _hints(cls), field_docs(cls), {}
    for name, tp, _, doc in _leaves(cls):
        section = name.split(".")[0] if "." in name else ""
        if section not in groups:
            about = docs.get(section) or _class_summary(hints[section]) if section else (
                "one flag per config field, shown at its value under the preset; a YAML file (--config) or "
                "--SECTION.FIELD V sets it")
            groups[section] = parser.add_argument_group(f"--{section}.*" if section else "config fields",
                                                        about.replace("%", "%%") or None)
        value = values
        for part in name.split("."):
            value = value[part]
        doc = re.sub(r":\w+:`~?(?:[\w]+\.)*([\w]+)`", r"\1", doc).replace("``", "")  # reST markup, for a terminal
        help_ = f"{doc} (default: {_cli_value(value)})" if doc else f"(default: {_cli_value(value)})"
        groups[section].add_argument(f"--{name}", dest=f"cfg:{name}", default=argparse.SUPPRESS, metavar=_metavar(tp),
                                     help=help_.replace("%", "%%"))


def _class_summary(cls: type) -> str:
    """The first line of a class's own docstring ("" for the signature a dataclass writes in its place)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc).split("\n")[0]


def overrides_from_args(args: argparse.Namespace) -> dict:
    """The config fields given as flags, as a nested dict (the last layer of :func:`resolve`)."""
    return unflatten({k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:")})


def _metavar(tp: Any) -> str:
    """INT, FLOAT, STR, BOOL; a list ``INT,...``; an optional value its type (``none`` unsets it)."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(tp) in (tuple, list):
        return f"{_metavar(args[0]) if args else 'STR'},..."
    if args:
        return _metavar(args[0])
    return getattr(tp, "__name__", str(tp)).upper()


def _cli_value(value: Any) -> str:
    """A value as it is typed on the command line: ``5,10``, ``true``, ``none``, ``""``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(_cli_value, value)) or '"" (empty)'
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    return str(value) if value != "" else '""'


def load_run_config(cls: type, run_dir: str | Path) -> Any:
    """The config a run was trained with, from its ``config.yaml``."""
    return from_dict(cls, load_yaml(Path(run_dir) / "config.yaml"))


def resolve(cls: type, preset: dict | None = None, yaml_path: str | None = None, overrides: dict | None = None) -> Any:
    """Defaults <- preset <- YAML file <- CLI overrides, merged field by field (:func:`merge_layers`), then validated
    by building ``cls``."""
    return from_dict(cls, merge_layers(cls, preset, yaml_path, overrides))


def merge_layers(cls: type, preset: dict | None = None, yaml_path: str | None = None,
                 overrides: dict | None = None) -> dict:
    """Defaults <- preset <- YAML file <- CLI overrides as one nested dict, not validated yet.

    A field that follows another (a section's ``follows`` class attribute: a stage's ``variant`` follows its
    ``objective``) goes back to its default when a layer sets the field it follows and not it:
    ``--stage1.objective stage2`` takes stage2's default variant, not the one the preset gave stage1.
    """
    data = to_dict(cls())
    for layer in (preset or {}, load_yaml(yaml_path) if yaml_path else {}, overrides or {}):
        data = merge(data, layer)
        _reset_followers(cls, data, layer)
    return data


def _reset_followers(cls: type, data: dict, layer: Any) -> None:
    if not isinstance(layer, dict):
        return
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(layer.get(f.name), dict) and isinstance(data.get(f.name), dict):
            _reset_followers(tp, data[f.name], layer[f.name])
    for follower, leader in getattr(cls, "follows", {}).items():
        if leader in layer and follower not in layer:
            data[follower] = next(f.default for f in dataclasses.fields(cls) if f.name == follower)


def preset_config(cls: type, presets: dict[str, dict], name: str, task: str, **overrides: Any) -> Any:
    """The config ``cls`` of preset ``name`` (a partial dict over the defaults), with nested overrides (dicts)."""
    if name not in presets:
        raise KeyError(f"unknown {task} preset {name!r}; available: {', '.join(presets)}")
    return resolve(cls, presets[name], None, overrides)

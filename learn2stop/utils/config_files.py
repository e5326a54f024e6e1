"""YAML config files, read within limits, and the layers a config is resolved from.

A config file is read only after the checks that need no parsing (a regular file, at most :data:`MAX_BYTES`,
UTF-8 text), then with PyYAML's ``SafeLoader`` (no tag builds a Python object; a key given twice is an
error). Before anything is built, its event stream (read flat, without recursion) must nest at most
:data:`MAX_DEPTH` deep and hold at most :data:`MAX_NODES` values, an alias counted at the full size of what it
repeats (so a "billion laughs" file is refused, not expanded). Each refusal is one :class:`ConfigError` line
naming the file.

Layers merge field by field (defaults <- preset <- YAML file <- flags): an empty section (``stage1:`` with
nothing under it, or ``{}``) changes nothing. A file is the user's statement, so each value it sets must be
valid even where a flag overrides it (:func:`merge_layers`).
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, from_dict, merge, shown, to_dict
from .paths import name_problem, shown_path


class ConfigFileError(ConfigError):
    """A config file that cannot be read, or a value in it that is refused; the message names the file."""


MAX_BYTES = 4 * 2 ** 20  # a config is kilobytes; a file of megabytes is not a config
MAX_DEPTH = 32  # a config nests sections a few levels deep
MAX_NODES = 100_000  # values in a file, aliases expanded


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, typing.Hashable):
            raise yaml.constructor.ConstructorError(None, None, f"a key must be a name, not a {key_node.id}",
                                                    key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _check_shape(text: str, where: str) -> None:
    """Refuse YAML nested deeper than MAX_DEPTH or holding more than MAX_NODES values (aliases expanded), from
    its event stream: nothing is built, and nothing recurses, however deep the file."""
    open_: list[list] = []  # per open collection: [values counted when it opened, its height, its anchor]
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (values, height) of what it names
    count = 0

    def add(values: int, height: int) -> None:
        nonlocal count
        count += values
        if count > MAX_NODES:
            raise ConfigFileError(f"{where} holds more than {MAX_NODES} values (aliases expanded); a config holds far fewer")
        if len(open_) + height > MAX_DEPTH:
            raise ConfigFileError(f"{where} nests deeper than {MAX_DEPTH} levels; a config nests sections a few levels deep")
        if open_:
            open_[-1][1] = max(open_[-1][1], height + 1)

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            add(1, 0)
            open_.append([count - 1, 0, event.anchor])
        elif isinstance(event, yaml.CollectionEndEvent):
            start, height, anchor = open_.pop()
            if open_:
                open_[-1][1] = max(open_[-1][1], height + 1)
            if anchor is not None:
                anchors[anchor] = (count - start, height)
        elif isinstance(event, yaml.ScalarEvent):
            add(1, 0)
            if event.anchor is not None:
                anchors[event.anchor] = (1, 0)
        elif isinstance(event, yaml.AliasEvent):
            add(*anchors.get(event.anchor, (1, 0)))


def _read_text(path: Path) -> str:
    """The file's text, refused (naming it) unless it is a regular, readable UTF-8 file of at most MAX_BYTES."""
    problem = name_problem(path)  # first: a stat of such a path raises
    if problem is not None:
        raise ConfigFileError(f"config file {shown_path(path)} cannot be read: {problem}")
    if path.is_dir():
        raise ConfigFileError(f"config file {path} is a directory, not a YAML file")
    if path.exists() and not path.is_file():
        raise ConfigFileError(f"config file {path} is not a regular file (a device, pipe or socket); give a YAML file")
    if not path.is_file():
        raise ConfigFileError(f"config file not found: {path}")
    too_big = ConfigFileError(f"config file {path} is larger than {MAX_BYTES // 2 ** 20} MiB; a config is a few kilobytes")
    try:
        if path.stat().st_size > MAX_BYTES:
            raise too_big
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # the size a stat gave may be wrong (a file growing, a special file system)
        if len(data) > MAX_BYTES:
            raise too_big
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                          f"at offset {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file within the limits above; a missing, unreadable, too large, too deep, non-UTF-8 or
    malformed file raises ConfigError naming it.

    Dotted keys (``stage1.lr: 1e-3``) are expanded into sections; a key given twice is an error.
    """
    path = Path(path)
    text = _read_text(path)
    where = f"config file {path}"
    try:
        _check_shape(text, where)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain values only
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # a value PyYAML's safe constructors cannot build (an integer of 5,000 digits)
        if isinstance(e, ConfigFileError):
            raise
        raise ConfigFileError(f"{where} holds a value that cannot be read: {' '.join(str(e).split())[:200]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{where} must hold a mapping at top level; got {type(data).__name__}")
    return _expand_dotted(data, where)


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
        raise ConfigFileError(f"set twice in {where}", f"{prefix}{key}")


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write a config (dataclass or dict) as YAML, atomically: a kill never leaves half a file."""
    from .report import write_text_atomic

    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def load_run_config(cls: type, run_dir: str | Path) -> Any:
    """The config a run was trained with, from its ``config.yaml``."""
    return from_dict(cls, load_yaml(Path(run_dir) / "config.yaml"))


def resolve(cls: type, preset: dict | None = None, yaml_path: str | None = None, overrides: dict | None = None) -> Any:
    """Defaults <- preset <- YAML file <- CLI overrides, merged field by field (:func:`merge_layers`), then validated
    by building ``cls``."""
    return from_dict(cls, merge_layers(cls, preset, yaml_path, overrides))


def merge_layers(cls: type, preset: dict | None = None, yaml_path: str | None = None,
                 overrides: dict | None = None) -> dict:
    """Defaults <- preset <- YAML file <- CLI overrides as one nested dict, not built yet; a value the file sets is
    checked already (:func:`check_file_values`), since no later build sees it where a flag overrides it.

    A field that follows another (a section's ``follows`` class attribute: a stage's ``variant`` follows its
    ``objective``) goes back to its default when a layer sets the field it follows and not it:
    ``--stage1.objective stage2`` takes stage2's default variant, not the one the preset gave stage1.
    """
    data = _add_layer(cls, to_dict(cls()), preset or {})
    file_layer = load_yaml(yaml_path) if yaml_path else {}
    data = _add_layer(cls, data, file_layer)
    data = _add_layer(cls, data, overrides or {})
    if file_layer:
        check_file_values(cls, data, file_layer, yaml_path)
    return data


def _add_layer(cls: type, data: dict, layer: dict) -> dict:
    data = merge(data, layer)
    _reset_followers(cls, data, layer)
    return data


def check_file_values(cls: type, data: dict, file_layer: dict, path: str | Path) -> None:
    """Refuse a value the config file sets that is invalid, even where a flag overrides it: the file is the user's
    statement, and a wrong value in it would be a trap the day the flag is dropped.

    Each value is judged in the config being resolved (``data``: all layers merged), with the file's values put
    back where the flags overrode them. An error on a field the file does not set is left to the final build.

    Raises:
        ConfigError: naming the field and the file.
    """
    as_stated = _add_layer(cls, data, file_layer)
    try:
        from_dict(cls, as_stated)
    except ConfigError as e:
        if e.field is not None and _sets(file_layer, e.field):
            raise ConfigFileError(f"{e.reason} (set in config file {path})", e.field) from None


def _sets(layer: dict, field: str) -> bool:
    """Whether a layer sets the dotted ``field`` (``grid[1]``: its element; ``stage1``: a whole section)."""
    node: Any = layer
    for part in field.split("[", 1)[0].split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _reset_followers(cls: type, data: dict, layer: Any) -> None:
    if not isinstance(layer, dict):
        return
    hints = typing.get_type_hints(cls)
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

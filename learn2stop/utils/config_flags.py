"""CLI flags for a typed dataclass config: one ``--section.field`` flag per leaf field, its help the field's
docstring (the string right under it) and its value under the preset."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from typing import Any

from .config import to_dict


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
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
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
    hints, docs, groups = typing.get_type_hints(cls), field_docs(cls), {}
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
        flags = [f"--{name}"]
        if "." not in name and "_" in name and f"--{name.replace('_', '-')}" not in parser._option_string_actions:
            flags.append(f"--{name.replace('_', '-')}")  # a top-level field also as --max-new-tokens
        groups[section].add_argument(*flags, dest=f"cfg:{name}", default=argparse.SUPPRESS, metavar=_metavar(tp),
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


"""One configuration per run directory: the fields its results depend on, hashed into ``fingerprint.json``.

A run's ``fingerprint.json`` holds those fields, their SHA-256 and the run format the run was written in; a
command asking for other settings is refused, naming up to five differing fields with both values, and a run
of another format is refused naming both formats. A fingerprint is written once, after the checks passed, and
never overwritten. Every refusal is a :class:`~learn2stop.utils.rundir.RunDirError` with a one-line message.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .rundir import RunDirError

FINGERPRINT_FILE = "fingerprint.json"
MAX_DIFFS_SHOWN = 5


def _plain(value: Any, where: str) -> Any:
    """A canonical plain-JSON copy: tuples -> lists, paths -> str, numpy/torch scalars -> numbers."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"fingerprint field {where or '<root>'} is {value}; only finite numbers can be compared")
        return float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist):
        return _plain(value.tolist(), where)
    raise TypeError(f"fingerprint field {where or '<root>'} has type {type(value).__name__}; "
                    f"use plain values (numbers, strings, lists, dicts)")


def fingerprint(data: dict) -> str:
    """SHA-256 (hex) of the canonical JSON of a nested dict of plain values.

    Key order does not matter; tuples equal lists; 1 and 1.0 differ (configs convert types first).

    Example:
        >>> fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": (1, 2), "a": 1})
        True
    """
    text = json.dumps(_plain(data, ""), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()  # a field one side of a diff does not have


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and (data or not prefix):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def diff_fields(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) for every leaf that differs, sorted by field.

    A field present on one side only has :data:`ABSENT` on the other; lists compare whole.

    Example:
        >>> diff_fields({"problem": {"sparsity": 0.1, "m": 250}}, {"problem": {"sparsity": 0.2, "m": 250}})
        [('problem.sparsity', 0.1, 0.2)]
    """
    a, b = _flatten(_plain(old, "")), _flatten(_plain(new, ""))
    return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b)) if a.get(k, ABSENT) != b.get(k, ABSENT)]


def _parent(fields: dict, name: str) -> tuple[dict, str]:
    """The dict holding the dotted field ``name`` of a nested dict, and the field's own key."""
    *parents, leaf = name.split(".")
    for p in parents:
        fields = fields[p]
    return fields, leaf


def keep_trained_values(fields: dict, stored: dict | None, names: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """Set each dotted field of ``names`` in ``fields`` to its value in ``stored`` (the run's fingerprint), so the
    check passes over it; returns (field, stored value, value asked) for each that differed. A field missing on
    either side is left alone.

    Example:
        >>> f = {"data": {"path": "/new"}}
        >>> keep_trained_values(f, {"data": {"path": "/old"}}, ("data.path",)), f
        ([('data.path', '/old', '/new')], {'data': {'path': '/old'}})
    """
    changed = [(k, old, new) for k, old, new in diff_fields(stored or {}, fields)
               if k in names and old is not ABSENT and new is not ABSENT]
    for name, old, _ in changed:
        parent, leaf = _parent(fields, name)
        parent[leaf] = old
    return changed


def read_fingerprint(run_dir: str | os.PathLike) -> dict | None:
    """The fields stored in ``<run_dir>/fingerprint.json``, or None if there is none yet.

    Raises:
        RunDirError: the file is corrupt or edited, or the run was written in another run format
            (:data:`~learn2stop.utils.formats.RUN_FORMAT`): one line naming both formats.
    """
    from .formats import RUN_FORMAT, format_refusal

    path = Path(run_dir) / FINGERPRINT_FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        made, fields, digest = stored.get("format", 0), stored["fields"], stored["sha256"]
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise RunDirError(f"{path} is unreadable or corrupt ({type(e).__name__}); "
                          f"the run's configuration cannot be checked: use a new --run-dir") from None
    if made != RUN_FORMAT:
        raise RunDirError(format_refusal(f"run directory {run_dir}", made))
    if not isinstance(fields, dict) or fingerprint(fields) != digest:
        raise RunDirError(f"{path} was edited or is corrupt (its hash does not match its fields); use a new --run-dir")
    return fields


def _show(value: Any) -> str:
    return repr(value) if value is ABSENT else json.dumps(value)


def check_fingerprint(run_dir: str | os.PathLike, data: dict, command: str = "") -> bool:
    """Compare ``data`` with the run's stored fingerprint; True if it matches, False if none is stored.

    Raises:
        RunDirError: the run was made under other settings; the message lists up to 5 differing
            fields with their old and new values. Or it was written in another run format.
    """
    stored = read_fingerprint(run_dir)
    if stored is None:
        return False
    diffs = diff_fields(stored, data)
    if not diffs:
        return True
    shown = diffs[:MAX_DIFFS_SHOWN]
    old = ", ".join(f"{k}={_show(o)}" for k, o, _ in shown)
    new = ", ".join(f"{k}={_show(n)}" for k, _, n in shown)
    more = f" (and {len(diffs) - len(shown)} more field(s))" if len(diffs) > len(shown) else ""
    who = f"this '{command}' command" if command else "this command"
    raise RunDirError(f"run directory {run_dir} was trained with {old}; {who} asks for {new}{more}; "
                      f"use a new --run-dir, or the settings it was trained with")


def fingerprint_task(run_dir: str | os.PathLike) -> str | None:
    """The task recorded in ``<run_dir>/fingerprint.json`` (None: no file, or a run of a config no task registered)."""
    if read_fingerprint(run_dir) is None:
        return None
    task = json.loads((Path(run_dir) / FINGERPRINT_FILE).read_text(encoding="utf-8")).get("task")
    return task if isinstance(task, str) else None


def write_fingerprint(run_dir: str | os.PathLike, data: dict, task: str | None = None) -> Path:
    """Store ``data`` and its hash in ``<run_dir>/fingerprint.json``, once, after the checks passed.

    Writing the same fields again changes nothing; different fields raise as
    :func:`check_fingerprint` does (a fingerprint is never overwritten).
    """
    from .formats import RUN_FORMAT
    from .report import write_text_atomic

    path = Path(run_dir) / FINGERPRINT_FILE
    if check_fingerprint(run_dir, data):
        return path
    record = {"format": RUN_FORMAT, "sha256": fingerprint(data), "fields": _plain(data, ""),
              "written": _dt.datetime.now().isoformat(timespec="seconds")}
    if task:
        record["task"] = task  # outside the hashed fields: "this run belongs to task maml"
    text = json.dumps(record, indent=2, allow_nan=False)
    return write_text_atomic(path, text + "\n")



__all__ = ["ABSENT", "FINGERPRINT_FILE", "check_fingerprint", "diff_fields", "fingerprint", "fingerprint_task",
           "keep_trained_values", "read_fingerprint", "write_fingerprint"]

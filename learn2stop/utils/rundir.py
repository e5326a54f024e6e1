"""A run directory that cannot lie: checked paths, one writer at a time, one configuration per run.

A run directory holds one training run: its config, checkpoints, metrics and tables. Every command
that reads or writes one goes through these pieces, in this order::

    run_dir = prepare_run_dir(args.run_dir, create=(command == "train"))  # one-line path errors
    with RunLock(run_dir, command):                                       # or RunLock(..., shared=True) to read
        clean_stale_temp_files(run_dir)                                   # utils.checkpoint, writers only
        if not resume:
            move_aside(run_dir)                                           # the old run, kept apart
        check_fingerprint(run_dir, fp, command)                           # refuses another configuration
        ...checks pass: write_fingerprint(run_dir, fp), then config.yaml, then work...

Guarantees: a second writer is refused while the first runs (and told who holds the lock); a
reader is refused while a writer runs; a stale lock file left by a killed process blocks nothing
(``flock`` locks die with their process); results in a run directory all come from the
configuration in its ``fingerprint.json``, which also records the run format the run was written in (a
run of another format is refused, naming both); ``--no-resume`` never mixes the old run's files with the
new run's. Every error is a :class:`RunDirError` with a one-line message.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: RunLock is a no-op (documented there)
    fcntl = None

LOCK_FILE = ".lock"
FINGERPRINT_FILE = "fingerprint.json"
PREVIOUS_PREFIX = "previous-"
MAX_DIFFS_SHOWN = 5


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message is one line and says what to do."""


# ----------------------------------------------------------------------------- paths
def prepare_run_dir(path: str | os.PathLike, create: bool, writable: bool = True) -> Path:
    """Check (and with ``create`` make) a run directory; returns it as a Path.

    Args:
        path: the run directory.
        create: make it (and its parents) if absent, as ``train`` does; with False a missing
            directory is an error and nothing is created.
        writable: it must be writable (commands that write tables or checkpoints into it).

    Raises:
        RunDirError: the path is a file, sits under a file, does not exist (``create=False``),
            cannot be created, or is not writable.
    """
    path = Path(path).expanduser()
    try:
        return _prepare(path, create, writable)
    except PermissionError:
        raise RunDirError(f"run directory {path} cannot be reached: permission denied on a parent folder") from None


def _prepare(path: Path, create: bool, writable: bool) -> Path:
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file, not a folder; choose another --run-dir")
    if not path.exists():
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise RunDirError(f"run directory {path} cannot exist: {blocker} is a file, not a folder")
        if not create:
            raise RunDirError(f"run directory {path} does not exist; run the 'train' command first")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create run directory {path}: {_reason(e)}") from None
    if not os.access(path, os.R_OK | os.X_OK):
        raise RunDirError(f"run directory {path} is not readable (permission denied)")
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path} is not writable ({_fs_reason(path)}); "
                          f"choose another --run-dir or copy it somewhere writable")
    return path


def _reason(e: OSError) -> str:
    return {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device"}.get(e.errno, e.strerror or str(e))


def _fs_reason(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except (OSError, AttributeError):
        pass
    return "permission denied"


# ----------------------------------------------------------------------------- the lock
class RunLock:
    """An advisory lock on ``<run_dir>/.lock``: one writer, or any number of readers.

    A writer (``shared=False``) takes an exclusive ``flock`` without waiting and writes its pid,
    host, command and start time into the lock file; a second writer, or a reader, is then refused
    with a :class:`RunDirError` naming the holder. A reader (``shared=True``) takes a shared lock
    and writes nothing, so readers never block each other. ``flock`` locks belong to an open file
    and vanish when their process dies, so a lock file left by ``kill -9`` blocks nothing. Locks are
    per open file: two RunLock objects on one directory conflict even inside one process. In a
    distributed run only rank 0 takes it. A reader that cannot create the lock file (a folder it
    may not write) reads without one. Without ``fcntl`` (not POSIX) the lock does nothing.

    Example:
        >>> with RunLock(run_dir, "train"):  # doctest: +SKIP
        ...     train(...)
    """

    def __init__(self, run_dir: str | os.PathLike, command: str = "", shared: bool = False):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.command, self.shared = command, shared
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None or fcntl is None:
            return self
        fd = self._open()
        if fd is None:  # a reader in a folder it cannot write: nobody with our rights writes there
            return self
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"cannot lock run directory {self.run_dir}: {_reason(e)}") from None
            raise RunDirError(self._refusal()) from None
        if not self.shared:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                    "since": _dt.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if not self.shared:
                os.ftruncate(fd, 0)  # no holder any more; a killed writer's stale text blocks nothing anyway
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            if not self.shared:
                raise RunDirError(f"cannot lock run directory {self.run_dir}: {_reason(e)}") from None
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError:
            return None

    def _holder(self) -> str:
        """'pid 123 on host (command 'train', since 2025-01-01T10:00:00)' from the lock file."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict) or not info.get("pid"):
            return "another process"
        details = [f"command '{info['command']}'"] if info.get("command") else []
        details += [f"since {info['since']}"] if info.get("since") else []
        host = f" on {info['host']}" if info.get("host") else ""
        return f"pid {info['pid']}{host}" + (f" ({', '.join(details)})" if details else "")

    def _refusal(self) -> str:
        if self.shared:
            return (f"run directory {self.run_dir} is being written by {self._holder()}; "
                    f"wait for it to finish or copy the folder")
        if self._readers_only():
            return (f"run directory {self.run_dir} is being read by another command (e.g. evaluate); "
                    f"wait for it to finish")
        return (f"run directory {self.run_dir} is in use by {self._holder()}; "
                f"wait for it to finish or use another --run-dir")

    def _readers_only(self) -> bool:
        """True if the lock we could not take exclusively is held shared (by readers)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- fingerprints
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


# ----------------------------------------------------------------------------- starting afresh
def move_aside(run_dir: str | os.PathLike) -> Path | None:
    """Move the previous run's files into ``<run_dir>/previous-<timestamp>/``; returns that folder.

    For ``--no-resume`` on an existing run: everything in the run directory (checkpoints, metrics,
    tables, config, fingerprint) except the lock file and earlier ``previous-*`` folders moves, so
    the new run starts empty and never picks up an old ``*_best.pt``. Returns None (and creates
    nothing) when there is nothing to move. Call it while holding the writer :class:`RunLock`, and
    before opening any file in the run directory.
    """
    run_dir = Path(run_dir)
    entries = sorted(p for p in run_dir.iterdir() if p.name != LOCK_FILE and not p.name.startswith(PREVIOUS_PREFIX))
    if not entries:
        return None
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    dest, k = run_dir / f"{PREVIOUS_PREFIX}{stamp}", 1
    while dest.exists():
        dest, k = run_dir / f"{PREVIOUS_PREFIX}{stamp}-{k}", k + 1
    try:
        dest.mkdir()
        for p in entries:
            os.replace(p, dest / p.name)
    except OSError as e:
        raise RunDirError(f"cannot move the previous run in {run_dir} aside: {_reason(e)}") from None
    return dest


def truncate_metrics(path: str | os.PathLike, stage: str, iteration: int) -> int:
    """Drop the lines of ``stage`` after ``iteration`` from a ``metrics.jsonl``; returns how many went.

    On resume from a checkpoint at ``iteration`` the lines logged after it (before the kill) are
    logged again, so they go first: no duplicated lines. A torn last line (killed mid-write) goes
    too. Other lines, other stages' included, are kept byte for byte. Atomic.
    """
    from .report import write_text_atomic

    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept, dropped = [], 0
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # a torn last line
                dropped += 1
                continue
            kept.append(line)
            continue
        it = rec.get("iteration") if isinstance(rec, dict) else None
        if isinstance(rec, dict) and rec.get("stage") == stage and isinstance(it, (int, float)) and it > iteration:
            dropped += 1
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        write_text_atomic(path, "".join(kept))
    return dropped


__all__ = ["ABSENT", "FINGERPRINT_FILE", "LOCK_FILE", "RunDirError", "RunLock", "check_fingerprint",
           "diff_fields", "keep_trained_values",
           "fingerprint", "fingerprint_task", "move_aside", "prepare_run_dir", "read_fingerprint", "truncate_metrics", "write_fingerprint"]

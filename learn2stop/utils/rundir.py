"""A run directory that cannot lie: checked paths, one writer at a time, one configuration per run.

A run directory holds one training run: its config, checkpoints, metrics and tables. Every command
that reads or writes one goes through these pieces (this module's paths and fresh starts, the lock of
:mod:`~learn2stop.utils.runlock`, the fingerprint of :mod:`~learn2stop.utils.fingerprint`), in this order::

    run_dir = prepare_run_dir(args.run_dir, create=(command == "train"))  # one-line path errors
    with RunLock(run_dir, command):                                       # or RunLock(..., shared=True) to read
        clean_stale_temp_files(run_dir)                                   # utils.checkpoint, writers only
        if not resume:
            move_aside(run_dir)                                           # the old run, kept apart
        check_fingerprint(run_dir, fp, command)                           # refuses another configuration
        ...checks pass: write_fingerprint(run_dir, fp), then config.yaml, then work...

Guarantees: a path the file system cannot hold by name is refused before anything is touched; a second writer is refused while the first runs (and told who holds the lock); a
reader is refused while a writer runs; a stale lock file left by a killed process blocks nothing
(``flock`` locks die with their process); results in a run directory all come from the
configuration in its ``fingerprint.json``, which also records the run format the run was written in (a
run of another format is refused, naming both); ``--no-resume`` never mixes the old run's files with the
new run's. Every error is a :class:`RunDirError` with a one-line message.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
from pathlib import Path

from .paths import name_problem, shown_path

LOCK_FILE = ".lock"
PREVIOUS_PREFIX = "previous-"


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
        RunDirError: the path is longer than the file system holds (:func:`check_run_dir_name`), is a file,
            sits under a file, does not exist (``create=False``), cannot be created, or is not writable.
    """
    path = Path(check_run_dir_name(path)).expanduser()
    try:
        return _prepare(path, create, writable)
    except PermissionError:
        raise RunDirError(f"run directory {path} cannot be reached: permission denied on a parent folder") from None
    except OSError as e:  # a folder on the way that cannot be looked into
        raise RunDirError(f"run directory {path} cannot be reached: {os_reason(e)}") from None


def check_run_dir_name(path: str | os.PathLike, arg: str = "--run-dir") -> str | os.PathLike:
    """``path`` itself if the file system can hold it by name (:func:`~learn2stop.utils.paths.name_problem`), before
    anything stats it: a name too long would fail there with a bare ``OSError``.

    Raises:
        RunDirError: naming ``arg``, the path (cut short) and the limit.
    """
    problem = name_problem(path)
    if problem is not None:
        raise RunDirError(f"{arg}: run directory {shown_path(path)} cannot be used: {problem}; choose a shorter one")
    return path


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
            raise RunDirError(f"cannot create run directory {path}: {os_reason(e)}") from None
    if not os.access(path, os.R_OK | os.X_OK):
        raise RunDirError(f"run directory {path} is not readable (permission denied)")
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path} is not writable ({_fs_reason(path)}); "
                          f"choose another --run-dir or copy it somewhere writable")
    return path


def os_reason(e: OSError) -> str:
    """A short, path-free reason for an OS error on a run directory."""
    return {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device"}.get(e.errno, e.strerror or str(e))


def _fs_reason(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except (OSError, AttributeError):
        pass
    return "permission denied"


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
        raise RunDirError(f"cannot move the previous run in {run_dir} aside: {os_reason(e)}") from None
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



__all__ = ["LOCK_FILE", "RunDirError", "check_run_dir_name", "move_aside", "prepare_run_dir", "truncate_metrics"]

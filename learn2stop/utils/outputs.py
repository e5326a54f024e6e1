"""Where a command writes what the user named: checked before any work, and never onto what the user made.

Every command that writes a file or a folder the user names (``export --out``, ``classify predict
--predict.output``, ``denoise denoise --denoise.output``) checks it here before it loads a model or reads
data, and a bad one is refused with one line naming the user's argument, the path and why:

- the path is not one of the command's inputs (the same file after resolving symlinks and hard links);
- it is not a record of a run directory (``config.yaml``, ``fingerprint.json``, ``metrics.jsonl``,
  ``checkpoints/``, ``calibration.json``, ``deployment.json``, ... of the command's run directory or of any
  folder holding a ``fingerprint.json``);
- an existing file is replaced only if the command says it is one of its own earlier outputs, and an
  existing non-empty folder only if it is a complete earlier output of ours (the command's check: for an
  export, every file its manifest lists, with a matching checksum, and nothing else);
- its name is valid (no part, and not the whole, longer than the file system holds: :mod:`~learn2stop.utils.paths`)
  and the nearest existing folder above it takes new files (tried, not guessed from
  permission bits: root passes those on a read-only or immutable folder and on ``/proc``).

What is replaced is kept beside the new output (:func:`previous_path`: ``calibration.previous.json``,
``D.previous/``), and an older ``.previous`` is itself replaced only if it is ours. Writes stay atomic:
a temporary sibling renamed into place (:mod:`learn2stop.utils.checkpoint`), and an error while writing
names the user's path, never the hidden temporary one.

Example:
    >>> path = check_output_file("preds.json", "--predict.output", inputs=["img.png"])  # doctest: +SKIP
    >>> with writing("--predict.output", path):                                          # doctest: +SKIP
    ...     write_json(result, path)
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .config import ConfigError
from .paths import name_problem, shown_path

#: the names of a run directory's records (files and folders its commands read; see utils.rundir and utils.fingerprint)
RUN_RECORDS = frozenset({".lock", "config.yaml", "fingerprint.json", "metrics.jsonl", "training_summary.json",
                         "calibration.json", "calibration.previous.json", "deployment.json", "checkpoints"})
#: record names by prefix: ``config.<command>.yaml`` of a reading command, ``previous-<stamp>/`` of --no-resume
RUN_RECORD_PREFIXES = ("config.", "previous-")
RUN_MARKER = "fingerprint.json"  # a folder holding one is a run directory
PREVIOUS_SUFFIX = ".previous"

#: says why an existing output is not one of ours (None: it is, and may be replaced)
Ours = Callable[[Path], "str | None"]


class OutputError(ConfigError):
    """An output the user named that cannot be written: one line naming the argument, the path and why."""


def previous_path(path: str | os.PathLike) -> Path:
    """Where a replaced output is kept: ``calibration.json`` -> ``calibration.previous.json``, ``D`` -> ``D.previous``."""
    path = Path(path)
    return path.with_name(f"{path.stem}{PREVIOUS_SUFFIX}{path.suffix}" if path.suffix else f"{path.name}{PREVIOUS_SUFFIX}")


def reason(e: OSError) -> str:
    """A short, path-free reason for an OS error (what the user can act on)."""
    return {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted (an immutable or protected folder)",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device",
            errno.EDQUOT: "disk quota exceeded", errno.ENAMETOOLONG: "file name too long",
            errno.ENOENT: "this file system takes no new files", errno.ENOTDIR: "a part of the path is a file"}.get(
        e.errno, e.strerror or type(e).__name__)


@contextlib.contextmanager
def writing(arg: str, path: str | os.PathLike) -> Iterator[None]:
    """Turn an OS error while writing ``path`` into an :class:`OutputError` naming ``arg`` and ``path``
    (an atomic write fails on its hidden temporary file; the user gave ``path``)."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{arg}: cannot write {path}: {reason(e)}") from None


def _absolute(path: str | os.PathLike) -> Path:
    """``path`` made absolute with its folder resolved (symlinks, ``..``); the last part kept as given
    unless it is itself a symlink (then its target: the file that would be written)."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    if p.is_symlink():
        return Path(os.path.realpath(p))
    return Path(os.path.realpath(p.parent)) / p.name


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (or cannot be looked at): compare the resolved paths
        return os.path.realpath(a) == os.path.realpath(b)


def run_record(path: str | os.PathLike, run_dirs: Iterable[str | os.PathLike] = ()) -> tuple[Path, str] | None:
    """(run directory, record name) if ``path`` is a run directory's record or lies inside one, else None.

    A run directory is one of ``run_dirs`` or any folder above ``path`` holding a ``fingerprint.json``.
    """
    p = _absolute(path)
    runs = {Path(os.path.realpath(Path(r).expanduser())) for r in run_dirs}
    for parent in p.parents:
        if parent in runs or (parent / RUN_MARKER).is_file():
            first = p.relative_to(parent).parts[0]
            if first in RUN_RECORDS or first.startswith(RUN_RECORD_PREFIXES):
                return parent, first
    return None


def json_output(*keys: str, rows: bool = False) -> Ours:
    """An :data:`Ours` check for a JSON output of a command: an object holding ``keys`` (``rows``: a list of
    such objects, e.g. one per image). Anything else (an image, the user's notes) is not ours."""
    def ours(path: Path) -> str | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return "not JSON"
        items = data if rows and isinstance(data, list) and data else [data]
        if not all(isinstance(d, dict) and all(k in d for k in keys) for d in items):
            return f"JSON without {' and '.join(repr(k) for k in keys)}{' in every row' if rows else ''}"
        return None

    return ours


def _check_place(path: str | os.PathLike, arg: str, run_dirs: Iterable[str | os.PathLike]) -> Path:
    """The checks every output shares: a valid name, not a run record, a parent that takes new files."""
    try:
        return _place(path, arg, run_dirs)
    except OSError as e:  # a folder on the way that cannot be looked into
        raise OutputError(f"{arg}: {path} cannot be reached: {reason(e)}") from None


def _place(path: str | os.PathLike, arg: str, run_dirs: Iterable[str | os.PathLike]) -> Path:
    text = os.fspath(path) if path is not None else ""
    if not text or "\0" in text:
        raise OutputError(f"{arg}: give a path to write to; got {text!r}")
    problem = name_problem(text)  # first: a stat of such a path raises
    if problem is not None:
        raise OutputError(f"{arg}: {shown_path(text)} cannot be written: {problem}")
    p = _absolute(text)
    if not p.name or p.name in (".", ".."):
        raise OutputError(f"{arg}: {text} names no file or folder; give a name")
    record = run_record(p, run_dirs)
    if record is not None:
        run, name = record
        raise OutputError(f"{arg}: {text} is the record {name!r} of run directory {run}; nothing of a run is "
                          "overwritten: give a path outside its records")
    above = next(a for a in [p.parent, *p.parent.parents] if a.exists() or a == a.parent)
    if not above.is_dir():
        raise OutputError(f"{arg}: {text} cannot be written: {above} is a file, not a folder")
    try:  # a real try: permission bits say nothing for root, an immutable folder or /proc
        os.rmdir(tempfile.mkdtemp(prefix=".learn2stop-probe-", dir=above))
    except OSError as e:
        raise OutputError(f"{arg}: {text} cannot be written: {reason(e)} in {above}") from None
    return p


def check_output_file(path: str | os.PathLike, arg: str, *, inputs: Iterable[str | os.PathLike] = (),
                      run_dirs: Iterable[str | os.PathLike] = (), ours: Ours | None = None) -> Path:
    """Check, before any work, that a command may write the file ``path``; returns it absolute.

    Args:
        path: the file the user named (or the command's default).
        arg: the user's argument, named in every error (``--predict.output``).
        inputs: the files the command reads; ``path`` must be none of them.
        run_dirs: the run directories the command reads (their records are refused; any folder with a
            ``fingerprint.json`` counts too).
        ours: for an existing file, None if it is one of the command's own earlier outputs (it may be
            replaced) or why not; without it any existing file that passes the other checks may be replaced.
    Raises:
        OutputError: one line naming ``arg``, the path and why.
    """
    p = _check_place(path, arg, run_dirs)
    for f in inputs:
        if _same_file(p, Path(f)):
            raise OutputError(f"{arg}: {path} is the input {f}; give another file name: an input is never overwritten")
    if p.is_dir():
        raise OutputError(f"{arg}: {path} is a folder; give a file name")
    if p.exists() and ours is not None:
        why = ours(p)
        if why is not None:
            raise OutputError(f"{arg}: {path} exists and is not an earlier output of this command ({why}); "
                              "give a new file name: nothing there is overwritten")
    return p


def check_output_folder(path: str | os.PathLike, arg: str, ours: Ours, *, run_dirs: Iterable[str | os.PathLike] = (),
                        what: str = "output") -> Path:
    """Check, before any work, that a command may write the folder ``path`` whole (replacing an earlier one).

    ``path`` may be new, an empty folder, or a complete earlier output of ours (``ours(path)`` is None); that
    one is kept at :func:`previous_path` when replaced, so an older one there must be ours (or empty) too.
    ``what`` names the output in errors ("export"). Returns ``path`` absolute.

    Raises:
        OutputError: one line naming ``arg``, the path and why; nothing is written.
    """
    p = _check_place(path, arg, run_dirs)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{arg}: {path} exists and is a file; give a new folder or an earlier {what}")
    if p.is_dir() and any(p.iterdir()):
        why = ours(p)
        if why is not None:
            raise OutputError(f"{arg}: {path} exists and is not an earlier {what} ({why}); give a new folder: "
                              "nothing there is overwritten")
        _check_previous(previous_path(p), arg, ours, what)
    return p


def _check_previous(prev: Path, arg: str, ours: Ours, what: str) -> None:
    problem = name_problem(prev)
    if problem is not None:
        raise OutputError(f"{arg}: the earlier {what} cannot be kept beside the new one as {shown_path(prev)}: "
                          f"{problem}; give a shorter name")
    if not prev.exists() and not prev.is_symlink():
        return
    if prev.is_symlink() or not prev.is_dir():
        why = "a file" if not prev.is_symlink() else "a symlink"
    elif not any(prev.iterdir()):
        return
    else:
        why = ours(prev)
    if why is not None:
        raise OutputError(f"{arg}: the earlier {what} would be kept in {prev}, which holds something else ({why}); "
                          "move it away first")


def replace_folder(tmp: Path, out: Path, ours: Ours, arg: str = "out", what: str = "output") -> Path | None:
    """Move the finished folder ``tmp`` (a sibling of ``out``) to ``out``; returns where an earlier one is kept.

    A new or empty ``out`` is replaced in one rename. A complete earlier output (checked again here: it may
    have changed since the command's first check) moves to :func:`previous_path` first (an older one there,
    if ours, goes). Raises :class:`OutputError` naming ``out`` and leaves ``out`` as it was otherwise.
    """
    with writing(arg, out):
        if not out.exists():
            os.rename(tmp, out)
            return None
        if out.is_dir() and not any(out.iterdir()):
            os.replace(tmp, out)  # rename(2) replaces an empty folder in one step
            return None
        why = ours(out) if out.is_dir() else "a file"
        if why is not None:
            raise OutputError(f"{arg}: {out} is not a complete earlier {what} any more ({why}); nothing was replaced, "
                              f"give a new folder")
        prev = previous_path(out)
        _check_previous(prev, arg, ours, what)
        trash = None
        if prev.exists():
            trash = out.parent / f".{prev.name}.old-{os.getpid()}"
            os.rename(prev, trash)
        os.rename(out, prev)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(prev, out)
            if trash is not None:
                os.rename(trash, prev)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    return prev


def keep_previous_file(path: Path, ours: Ours, arg: str) -> Path | None:
    """Before ``path`` is replaced: copy it (atomically) to :func:`previous_path`; returns that path, or None
    when there is no ``path``. An older copy there is replaced only if ``ours`` accepts it."""
    from .checkpoint import atomic_write

    if not path.is_file():
        return None
    prev = previous_path(path)
    check_previous_file(path, ours, arg)
    data = path.read_bytes()
    with writing(arg, prev):
        atomic_write(prev, lambda f: f.write(data), public=True)
    return prev


def check_previous_file(path: Path, ours: Ours, arg: str) -> None:
    """Refuse (before any work) to replace ``path`` when its kept copy's place holds something not ours."""
    prev = previous_path(path)
    if not path.is_file() or not (prev.exists() or prev.is_symlink()):
        return
    why = "a folder" if prev.is_dir() else "a symlink" if prev.is_symlink() else ours(prev)
    if why is not None:
        raise OutputError(f"{arg}: {path} would be kept in {prev} before it is replaced, and that holds something "
                          f"else ({why}); move it away first")


__all__ = ["OutputError", "PREVIOUS_SUFFIX", "RUN_RECORDS", "check_output_file", "check_output_folder",
           "check_previous_file", "json_output", "keep_previous_file", "previous_path", "reason", "replace_folder", "run_record",
           "writing"]

"""Atomic, code-free checkpoints.

A checkpoint is a plain dict of tensors and primitives written with ``torch.save`` to a temporary
file in the same folder, flushed to disk, then renamed over the target (``os.replace`` is atomic),
so a kill mid-write leaves the previous checkpoint intact. Loading uses ``weights_only=True``:
nothing in the file is executed.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from .formats import RUN_FORMAT, format_refusal

FORMAT = "learn2stop-checkpoint"
VERSION = RUN_FORMAT  # a checkpoint's ``version``: the run format (:data:`~learn2stop.utils.formats.RUN_FORMAT`)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or not a learn2stop checkpoint."""


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask both sets and returns)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write(path: str | os.PathLike, write, public: bool = False) -> Path:
    """Write a file through ``write(binary file)`` into a temporary file beside it, fsync, then rename.

    The temporary file is ``.<name>.<random>.tmp`` (what :func:`clean_stale_temp_files` removes);
    ``os.replace`` is atomic, so a kill mid-write leaves the previous file intact. ``public``: give the
    file the usual 0666-less-umask permissions instead of ``mkstemp``'s private 0600.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name")
    blocker = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise NotADirectoryError(f"cannot write {path}: {blocker} is a file, not a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if public:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``payload`` atomically to ``path``; returns the path."""
    data = {"format": FORMAT, "version": VERSION, **payload}
    return atomic_write(path, lambda f: torch.save(data, f))


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, without executing code from it.

    Raises:
        CheckpointError: naming the file, if it is missing, truncated/corrupt, or of another format.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or not loadable safely: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a learn2stop checkpoint")
    if data.get("version", 0) != VERSION:
        raise CheckpointError(format_refusal(f"checkpoint {path}", data.get("version", 0)))
    return data


# ``.<name>.<random>.tmp``: the temporary files of save_checkpoint and report.write_text_atomic
_TEMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")


def clean_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files a killed write left under ``folder`` (recursively); returns them.

    :func:`save_checkpoint` and atomic JSON/text writes go through ``.<name>.<random>.tmp`` in the
    target's folder; a ``kill -9`` mid-write leaves one behind (the target itself is intact).
    Call this at the start of a run, while holding the run's writer lock, so that no live
    process's temporary file is removed. Symbolic links are not followed.
    """
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath) / name
            if _TEMP_NAME.match(name) and path.is_file() and not path.is_symlink():
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path)
    return sorted(removed)

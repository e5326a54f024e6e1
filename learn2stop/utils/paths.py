"""Path names the file system can hold, checked by name before any work.

A path whose one part is longer than the file system's ``NAME_MAX`` bytes, or whose whole is longer than its
``PATH_MAX``, fails at the first ``stat`` with ``OSError: File name too long`` -- deep inside a command, after
the model was built. :func:`name_problem` says so from the name alone, with the limits the file system
reports (``os.pathconf``) where it reports them, and the usual ones (255 and 4096 bytes) elsewhere.

Example:
    >>> name_problem("/tmp/" + "x" * 300)
    "the name 'xxxxxxxxxxxxxxxxxxxx...' is 300 bytes; this file system holds names of at most 255"
    >>> name_problem("/tmp/run") is None
    True
"""
from __future__ import annotations

import os
from pathlib import Path

NAME_MAX = 255  # bytes in one name: Linux, macOS and Windows file systems alike
PATH_MAX = 4096  # bytes in a whole path (Linux)


def _limit(folder: Path, name: str, default: int) -> int:
    """The file system's limit ``name`` at an existing ``folder``; ``default`` where it does not say."""
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):  # not POSIX, or a name this system does not know
        return default
    return value if isinstance(value, int) and value > 0 else default


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def name_problem(path: str | os.PathLike) -> str | None:
    """Why the file system cannot hold ``path`` by name (one part, or the whole made absolute, too long), or None.

    Only names are looked at: each part is measured against the ``NAME_MAX`` of the deepest existing folder above
    it, and the absolute path against that folder's ``PATH_MAX``. Whether the path can be created or written is
    the caller's next check.
    """
    absolute = os.path.abspath(os.path.expanduser(os.fspath(path)))
    parts = Path(absolute).parts
    above = Path(parts[0])
    path_max = _limit(above, "PC_PATH_MAX", PATH_MAX)
    size = len(os.fsencode(absolute))
    if size >= path_max:
        return f"the path is {size} bytes; this file system holds paths of at most {path_max - 1}"
    name_max, exists = _limit(above, "PC_NAME_MAX", NAME_MAX), True
    for part in parts[1:]:
        length = len(os.fsencode(part))
        if length > name_max:
            name = part if len(part) <= 24 else part[:20] + "..."
            return f"the name {name!r} is {length} bytes; this file system holds names of at most {name_max}"
        if exists and _is_dir(above / part):  # a folder that exists: the limits of the file system it is on
            above = above / part
            name_max = _limit(above, "PC_NAME_MAX", NAME_MAX)
        else:
            exists = False
    return None


def shown_path(path: str | os.PathLike, width: int = 80) -> str:
    """``path`` as text for a one-line error: a long one cut in the middle."""
    text = os.fspath(path)
    return text if len(text) <= width else f"{text[:width // 2 - 2]}...{text[-(width // 2 - 1):]}"


__all__ = ["NAME_MAX", "PATH_MAX", "name_problem", "shown_path"]

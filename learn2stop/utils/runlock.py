"""One writer at a time in a run directory, or any number of readers: an advisory ``flock`` on its ``.lock``."""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
from pathlib import Path

from .rundir import LOCK_FILE, RunDirError, os_reason

try:
    import fcntl
except ImportError:  # not POSIX: RunLock is a no-op (documented there)
    fcntl = None


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
                raise RunDirError(f"cannot lock run directory {self.run_dir}: {os_reason(e)}") from None
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
                raise RunDirError(f"cannot lock run directory {self.run_dir}: {os_reason(e)}") from None
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError:
            return None

    def _holder(self) -> str:
        """'pid 123 on host (command 'train', since <ISO time>)' from the lock file."""
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



__all__ = ["RunLock"]

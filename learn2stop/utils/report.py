"""Result tables (markdown), strict JSON and figures (PNG), written atomically into a run directory."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A GitHub markdown table; floats get ``digits`` decimals, None/NaN print as '-'."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v, digits) for v in row) + " |")
    return "\n".join(lines)


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


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and ``os.replace``.

    A kill mid-write leaves the previous file (or none), never half a file; the temporary file is
    named ``.<name>.<random>.tmp`` in the same folder, the pattern that
    :func:`learn2stop.utils.checkpoint.clean_stale_temp_files` removes. The file gets the usual
    permissions (0666 less the umask), not ``mkstemp``'s private 0600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def to_strict_json(data: Any) -> Any:
    """``data`` with only strict-JSON values: NaN and +-inf become None, recursively.

    NumPy and torch scalars and arrays become Python numbers and lists, tuples become lists and
    paths strings; anything else is left for ``json`` to accept or refuse.
    """
    if isinstance(data, bool) or data is None or isinstance(data, (int, str)):
        return data
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {(k if isinstance(k, str) else str(k)): to_strict_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [to_strict_json(v) for v in data]
    if isinstance(data, os.PathLike):
        return os.fspath(data)
    if hasattr(data, "tolist") and callable(data.tolist):  # numpy / torch scalars and arrays
        return to_strict_json(data.tolist())
    return data


def json_text(data: Any, indent: int | None = 2) -> str:
    """Strict JSON text of ``data`` (see :func:`to_strict_json`); never writes NaN or Infinity."""
    return json.dumps(to_strict_json(data), indent=indent, sort_keys=False, allow_nan=False)


def write_json(data: Any, path: str | Path) -> None:
    """Write ``data`` as strict JSON (NaN/inf become null), atomically."""
    write_text_atomic(path, json_text(data) + "\n")


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one strict-JSON line (e.g. to ``metrics.jsonl``), flushed to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json_text(record, indent=None) + "\n")
        f.flush()
        os.fsync(f.fileno())


def new_figure(*args, **kwargs):
    """A matplotlib figure on the headless Agg backend (never needs a screen)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)

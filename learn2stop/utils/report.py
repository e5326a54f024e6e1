"""Result tables (markdown), strict JSON and figures (PNG), written atomically into a run directory."""
from __future__ import annotations

import json
import math
import os
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


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`learn2stop.utils.checkpoint.atomic_write`).

    A kill mid-write leaves the previous file (or none), never half a file; the file gets the usual
    permissions (0666 less the umask), not ``mkstemp``'s private 0600.
    """
    from .checkpoint import atomic_write

    return atomic_write(path, lambda f: f.write(text.encode("utf-8")), public=True)


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


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a file written by :func:`append_jsonl` ([] if there is none); a torn last line
    (a kill mid-append) is skipped, any other bad line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
    return out


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

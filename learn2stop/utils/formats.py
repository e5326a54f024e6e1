"""The run format: one number for everything a run writes and reads back.

``fingerprint.json``, checkpoints, ``calibration.json`` and ``deployment.json`` record it. It is raised whenever what
is written changes meaning, and a run or file of another format is refused with one line naming both formats: there
are no readers of older runs, no defaults kept to read them.
"""
from __future__ import annotations

from typing import Any

#: the run format this library writes and reads
RUN_FORMAT = 2


def format_refusal(what: str, made: Any) -> str:
    """The one-line refusal of a run or file written in another run format than :data:`RUN_FORMAT` (``made``: the one
    it records; 0 or None: none recorded)."""
    known = made not in (None, 0)
    return (f"{what} was written by learn2stop run format {made if known else '0 (none recorded)'}; "
            f"this learn2stop reads format {RUN_FORMAT}: re-run it (train into a new --run-dir)")

"""A calibrated rule (:class:`Calibration`: what was asked, what was chosen, what it gave) and the run's
``calibration.json`` that keeps it: written atomically with the run format, read back field by field."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..runtime.registry import get_rule
from ..utils.config import ConfigError, require
from .signal_registry import SIGNALS, make_signal


CALIBRATION_FILE = "calibration.json"


@dataclass
class Calibration:
    """A calibrated rule: what was asked, what was chosen, and what it gave on the calibration data."""

    rule: str
    param: float
    threshold: float
    target: dict
    calibration: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)
    #: how the rule was chosen among others (``calibrate --fastest``: each candidate's speed and test result)
    chosen_by: dict = field(default_factory=dict)

    def make_rule(self, policy=None, key=None):
        return make_signal(self.rule, policy, key).rule(self.threshold)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["chosen_by"]:
            del d["chosen_by"]
        for k in ("param", "threshold"):
            d[k] = d[k] if math.isfinite(d[k]) else None  # strict JSON: never stop early
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> "Calibration":
        """A calibration from its JSON form; a bad field raises ConfigError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object; got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        missing = sorted({"rule", "threshold", "target"} - set(d))
        if unknown or missing:
            raise ConfigError(f"{where}: " + (f"unknown field(s) {', '.join(map(str, unknown))}" if unknown else
                                              f"missing field(s) {', '.join(missing)}"))
        d = dict(d)
        require(d["rule"] in SIGNALS, f"{where}: rule", f"must be one of {list(SIGNALS)}; got {d['rule']!r}")
        for k in ("threshold", "param"):
            v = d.get(k)
            if v is None:  # strict JSON's null: never stop early
                d[k] = math.inf
                continue
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), f"{where}: {k}",
                    f"must be a number (or null: never stop early); got {v!r}")
            d[k] = float(v)
        if "param" not in d:
            d["param"] = SIGNALS[d["rule"]].to_param(d["threshold"])
        if math.isfinite(d["param"]):
            check_param(d["rule"], d["param"], f"{where}: param")
        for k in ("target", "calibration", "test", "chosen_by"):
            require(isinstance(d.get(k, {}), dict), f"{where}: {k}", f"must be a JSON object; got {d.get(k)!r}")
        return cls(**d)


def check_param(rule: str, param: float, field: str) -> None:
    """Refuse a finite parameter outside the rule's range (its registry entry's ``in_range``), naming ``field``; a
    calibration may also hold inf (never stop early)."""
    entry = get_rule(rule)
    require(entry.in_range(param), field, f"the {rule} rule's parameter must be {entry.param_range}; got {param!r}")


# ----------------------------------------------------------------------------- persistence


def calibration_mismatch(path: Path) -> str | None:
    """Why ``path`` is not a calibration of ours (None: it is one, of this run format, field by field)."""
    try:
        read_calibration(path)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ConfigError is a ValueError
        return str(e) if isinstance(e, ConfigError) else "not valid JSON"
    return None


def check_calibration_replace(run_dir: str | Path) -> None:
    """Refuse, before any work, a calibration whose earlier one could not be kept (``calibration.previous.json``
    holds something not ours): :func:`save_calibration` never drops a calibration unseen."""
    from ..utils.outputs import check_previous_file

    check_previous_file(Path(run_dir) / CALIBRATION_FILE, calibration_mismatch, "calibration")


def save_calibration(cal: Calibration, run_dir: str | Path) -> Path:
    """Write ``cal`` as the run's ``calibration.json`` (atomic, with the run format); one it replaces is kept in
    ``calibration.previous.json`` first (an older one there only replaced if it is a calibration too)."""
    from ..utils.formats import RUN_FORMAT
    from ..utils.outputs import keep_previous_file
    from ..utils.report import write_json

    path = Path(run_dir) / CALIBRATION_FILE
    keep_previous_file(path, calibration_mismatch, "calibration")
    write_json({"format": RUN_FORMAT, **cal.to_dict()}, path)
    return path


def read_calibration(path: Path) -> Calibration:
    """A calibration file, checked: its run format first (a file of another one is not read field by field), then
    field by field."""
    from ..utils.formats import RUN_FORMAT, format_refusal

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a valid calibration file ({e}); calibrate again or delete it") from None
    if isinstance(data, dict):
        if data.get("format", 0) != RUN_FORMAT:
            raise ConfigError(format_refusal(str(path), data.get("format", 0)))
        data = {k: v for k, v in data.items() if k != "format"}
    try:
        return Calibration.from_dict(data, where=str(path))
    except ConfigError as e:
        raise ConfigError(f"{e}; calibrate again or delete the file") from None


def load_calibration(run_dir: str | Path) -> Calibration | None:
    """The run's ``calibration.json``, checked (:func:`read_calibration`; None if there is none)."""
    path = Path(run_dir) / CALIBRATION_FILE
    return read_calibration(path) if path.is_file() else None

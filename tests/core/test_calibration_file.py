"""calibration.json: every bad field, format and shape refused naming the file and the field."""
from __future__ import annotations

import json
import math

import pytest

from learn2stop.core.calibration_file import Calibration, load_calibration
from learn2stop.utils.config import ConfigError
from learn2stop.utils.formats import RUN_FORMAT


@pytest.mark.parametrize("content, message", [
    ({"rule": "bogus", "threshold": 0.5, "target": {}}, r"calibration\.json: rule: must be one of"),
    ({"rule": "quantile", "param": 0.5, "threshold": float("nan"), "target": {}}, r"calibration\.json: threshold: must be a number"),
    ({"rule": "quantile", "threshold": 0.5}, r"calibration\.json: missing field\(s\) target"),
    ({"rule": "quantile", "threshold": 0.5, "target": {}, "extra": 1}, r"calibration\.json: unknown field\(s\) extra"),
    ([1, 2], r"calibration\.json: expected a JSON object"),
    ({"rule": "patience", "param": 0.5, "threshold": 0.5, "target": {}}, r"patience rule's parameter must be an integer"),
    ({"format": None, "rule": "quantile", "threshold": 0.5, "target": {}},
     r"calibration\.json was written by learn2stop run format 0 \(none recorded\); this learn2stop reads format \d+: re-run"),
    ({"format": RUN_FORMAT + 1, "rule": "quantile", "threshold": 0.5, "target": {}},
     rf"calibration\.json was written by learn2stop run format {RUN_FORMAT + 1}; this learn2stop reads format {RUN_FORMAT}"),
])
def test_a_bad_calibration_file_is_named(content, message, tmp_path):
    if isinstance(content, dict) and "format" not in content:
        content = {"format": RUN_FORMAT, **content}
    elif isinstance(content, dict) and content["format"] is None:
        content = {k: v for k, v in content.items() if k != "format"}  # as written before the format was recorded
    (tmp_path / "calibration.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=message):
        load_calibration(tmp_path)
    (tmp_path / "calibration.json").write_text('{"rule": ')
    with pytest.raises(ConfigError, match=r"calibration\.json is not a valid calibration file"):
        load_calibration(tmp_path)
    good = {"rule": "quantile", "param": None, "threshold": None, "target": {"kind": "budget"}}
    assert math.isinf(Calibration.from_dict(good).threshold)  # null: never stop early

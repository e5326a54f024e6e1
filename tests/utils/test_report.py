"""Writes of JSON and text (learn2stop.utils.report): strict JSON, atomic writes, torn lines read back, and output
paths that are folders or under a file refused naming the path."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from learn2stop.utils.report import append_jsonl, write_json, write_text_atomic


def test_an_output_path_that_is_a_folder_or_under_a_file_is_named(tmp_path):
    from learn2stop.tasks.denoise.images import ImageDataError, save_image
    from learn2stop.utils.report import write_json

    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(IsADirectoryError, match=r"cannot write .* it is a folder; give a file name"):
        write_json({"a": 1}, tmp_path)
    with pytest.raises(NotADirectoryError, match=r"cannot write .*file\.png/out\.json: .*file\.png is a file, not a folder"):
        write_json({"a": 1}, tmp_path / "file.png" / "out.json")
    with pytest.raises(ImageDataError, match=r"cannot save .*file\.png/a\.png: .*file\.png is a file, not a folder"):
        save_image(np.zeros((4, 4)), tmp_path / "file.png" / "a.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.png"]


# ----------------------------------------------------------------------------- strict JSON and atomic writes
def _strict_loads(text):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_write_json_is_strict_json(tmp_path):
    data = {"nan": math.nan, "inf": math.inf, "np": np.float32("-inf"), "np_ok": np.float64(2.5),
            "torch": torch.tensor(float("nan")), "vec": torch.tensor([1.0, math.inf]), "arr": np.array([np.nan, 1]),
            "nested": [{"x": (math.nan, 1)}], "int": np.int64(3), "path": tmp_path}
    write_json(data, tmp_path / "r.json")
    back = _strict_loads((tmp_path / "r.json").read_text())
    assert back == {"nan": None, "inf": None, "np": None, "np_ok": 2.5, "torch": None, "vec": [1.0, None],
                    "arr": [None, 1.0], "nested": [{"x": [None, 1]}], "int": 3, "path": str(tmp_path)}
    append_jsonl(tmp_path / "m.jsonl", {"stage": "s", "loss": math.nan})
    assert _strict_loads((tmp_path / "m.jsonl").read_text()) == {"stage": "s", "loss": None}
    with pytest.raises(ValueError, match="non-strict JSON constant NaN"):
        _strict_loads('{"a": NaN}')  # the checker itself does refuse


def test_atomic_writes_leave_no_temp_and_normal_permissions(tmp_path):
    write_text_atomic(tmp_path / "t.md", "| a |\n")
    write_json({"a": 1}, tmp_path / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "t.md"]
    assert (tmp_path / "r.json").stat().st_mode & 0o044  # readable by others (mkstemp would give 0600)


def test_read_jsonl_skips_a_torn_last_line_and_names_a_bad_middle_line(tmp_path):
    from learn2stop.utils.report import append_jsonl, read_jsonl

    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, {"stage": "baseline", "iteration": 1})
    append_jsonl(path, {"stage": "baseline", "iteration": 2})
    with open(path, "a") as f:
        f.write('{"stage": "base')  # killed mid-append
    assert [r["iteration"] for r in read_jsonl(path)] == [1, 2]
    with open(path, "a") as f:
        f.write('\n{"stage": "stage1"}\n')
    with pytest.raises(ValueError, match="line 3 is not JSON"):
        read_jsonl(path)

"""A run's fingerprint (learn2stop.utils.fingerprint): canonical, written once, its run format checked, and a changed
or corrupt one refused listing the fields."""
from __future__ import annotations

import json
import math

import pytest

from learn2stop.utils.formats import RUN_FORMAT
from learn2stop.utils.fingerprint import (ABSENT, check_fingerprint, diff_fields, fingerprint, fingerprint_task,
                                          read_fingerprint, write_fingerprint)
from learn2stop.utils.rundir import RunDirError


# ----------------------------------------------------------------------------- fingerprints
FP = {"problem": {"sparsity": 0.1, "matrix_seed": 0, "m": 250}, "lista": {"num_steps": 16}, "data": "synthetic"}


def test_fingerprint_is_canonical():
    assert fingerprint({"b": (1, 2), "a": {"y": 1, "x": 2}}) == fingerprint({"a": {"x": 2, "y": 1}, "b": [1, 2]})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert len(fingerprint(FP)) == 64


def test_fingerprint_refuses_a_changed_problem_listing_the_fields(tmp_path):
    assert check_fingerprint(tmp_path, FP, "train") is False  # a fresh run: nothing stored yet
    write_fingerprint(tmp_path, FP)
    assert check_fingerprint(tmp_path, FP, "evaluate") is True
    changed = {**FP, "problem": {**FP["problem"], "sparsity": 0.2, "matrix_seed": 3}}
    with pytest.raises(RunDirError, match=r"was trained with problem\.matrix_seed=0, problem\.sparsity=0\.1; "
                                          r"this 'evaluate' command asks for problem\.matrix_seed=3, "
                                          r"problem\.sparsity=0\.2; use a new --run-dir"):
        check_fingerprint(tmp_path, changed, "evaluate")


def test_fingerprint_mismatch_shows_five_fields_then_a_count(tmp_path):
    write_fingerprint(tmp_path, {f"f{i}": i for i in range(8)})
    with pytest.raises(RunDirError, match=r"f4=40; use|and 3 more field\(s\)") as e:
        check_fingerprint(tmp_path, {f"f{i}": 10 * i + 1 for i in range(8)}, "frontier")
    assert "f5" not in str(e.value) and "(and 3 more field(s))" in str(e.value)


def test_a_run_of_another_run_format_is_refused_in_one_line_naming_both_formats(tmp_path):
    """fingerprint.json records the run format; a run with none recorded, or another one, is refused by every reader
    of the fingerprint with one line naming the format it was written in and the one this library reads."""

    write_fingerprint(tmp_path, FP)
    stored = json.loads((tmp_path / "fingerprint.json").read_text())
    assert stored["format"] == RUN_FORMAT and read_fingerprint(tmp_path) == FP
    del stored["format"]  # as every run written before the format was recorded
    (tmp_path / "fingerprint.json").write_text(json.dumps(stored))
    want = (f"run directory {tmp_path} was written by learn2stop run format 0 (none recorded); this learn2stop reads "
            f"format {RUN_FORMAT}: re-run it")
    for read in (read_fingerprint, lambda d: check_fingerprint(d, FP), fingerprint_task):
        with pytest.raises(RunDirError) as e:
            read(tmp_path)
        assert str(e.value).startswith(want) and "\n" not in str(e.value)
    stored["format"] = RUN_FORMAT + 1
    (tmp_path / "fingerprint.json").write_text(json.dumps(stored))
    with pytest.raises(RunDirError, match=rf"written by learn2stop run format {RUN_FORMAT + 1}; this learn2stop reads "
                                          rf"format {RUN_FORMAT}: re-run it"):
        read_fingerprint(tmp_path)


def test_fingerprint_is_written_once_and_never_overwritten(tmp_path):
    write_fingerprint(tmp_path, FP)
    write_fingerprint(tmp_path, dict(FP))  # the same: no change
    with pytest.raises(RunDirError, match=r"was trained with data=\"synthetic\"; this command asks for data=\"bsd68\""):
        write_fingerprint(tmp_path, {**FP, "data": "bsd68"})
    assert read_fingerprint(tmp_path) == FP


def test_edited_or_corrupt_fingerprint_file(tmp_path):
    write_fingerprint(tmp_path, FP)
    stored = json.loads((tmp_path / "fingerprint.json").read_text())
    stored["fields"]["problem"]["sparsity"] = 0.2
    (tmp_path / "fingerprint.json").write_text(json.dumps(stored))
    with pytest.raises(RunDirError, match="fingerprint.json was edited or is corrupt"):
        check_fingerprint(tmp_path, FP)
    (tmp_path / "fingerprint.json").write_text("{not json")
    with pytest.raises(RunDirError, match="fingerprint.json is unreadable or corrupt"):
        check_fingerprint(tmp_path, FP)


def test_diff_fields_and_non_finite_fingerprint_values():
    assert diff_fields({"a": {"b": 1, "c": [1, 2]}}, {"a": {"b": 1, "c": (1, 3), "d": 0}}) == [
        ("a.c", [1, 2], [1, 3]), ("a.d", ABSENT, 0)]
    with pytest.raises(ValueError, match=r"fingerprint field lista\.L is inf"):
        fingerprint({"lista": {"L": math.inf}})

"""The run directory (learn2stop.utils.rundir): path errors named before anything is made, and a run started afresh
or resumed keeping the old one apart."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from learn2stop.utils import rundir
from learn2stop.utils.rundir import RunDirError, move_aside, prepare_run_dir, truncate_metrics
from learn2stop.utils.runlock import RunLock


IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# ----------------------------------------------------------------------------- paths
def test_run_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=r"run directory .*/f is a file, not a folder"):
        prepare_run_dir(tmp_path / "f", create=True)


def test_run_dir_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=r"run directory .*/f/a/b cannot exist: .*/f is a file"):
        prepare_run_dir(tmp_path / "f" / "a" / "b", create=True)


def test_missing_run_dir_for_a_reader_creates_nothing(tmp_path):
    with pytest.raises(RunDirError, match=r"run directory .*/run does not exist; run the 'train' command first"):
        prepare_run_dir(tmp_path / "a" / "run", create=False)
    assert list(tmp_path.iterdir()) == []
    assert prepare_run_dir(tmp_path / "a" / "run", create=True).is_dir()


def _deny_writes(monkeypatch, tmp_path, folder):
    """Make ``folder`` unwritable: chmod for a normal user; root ignores modes, so fake os.access."""
    if IS_ROOT:
        real = os.access
        monkeypatch.setattr(rundir.os, "access",
                            lambda p, mode: False if (mode & os.W_OK and Path(p) == folder) else real(p, mode))
    else:
        folder.chmod(0o555)


def test_read_only_run_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    _deny_writes(monkeypatch, tmp_path, run)
    try:
        with pytest.raises(RunDirError, match=r"run directory .*/run is not writable \((permission denied|read-only)"):
            prepare_run_dir(run, create=False)
        assert prepare_run_dir(run, create=False, writable=False) == run  # a read-only reader is fine
    finally:
        run.chmod(0o755)


def test_run_dir_that_cannot_be_created(tmp_path, monkeypatch):
    parent = tmp_path / "locked"
    parent.mkdir()
    if IS_ROOT:  # root may create anywhere: simulate the refusal mkdir would give a user
        def denied(self, *a, **k):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "mkdir", denied)
    else:
        parent.chmod(0o555)
    try:
        with pytest.raises(RunDirError, match=r"cannot create run directory .*/locked/run: permission denied"):
            prepare_run_dir(parent / "run", create=True)
    finally:
        parent.chmod(0o755)


@pytest.mark.parametrize("name", ["x" * 300, "/".join(["d" * 200] * 25)], ids=["a-name", "the-whole-path"])
def test_a_run_dir_too_long_for_the_file_system_is_refused_by_name_before_anything(tmp_path, name):
    with pytest.raises(RunDirError, match=r"^--run-dir: run directory .{10,90} cannot be used: the (name '.*' is 300 "
                                          r"bytes; this file system holds names|path is \d+ bytes; this file system "
                                          r"holds paths) of at most \d+; choose a shorter one$"):
        prepare_run_dir(tmp_path / name, create=True)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- starting afresh and resuming
def test_move_aside_keeps_the_old_run_apart(tmp_path):
    assert move_aside(tmp_path) is None and list(tmp_path.iterdir()) == []
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "stage1_best.pt").write_text("old")
    for name in ("metrics.jsonl", "table1.md", "fingerprint.json", "config.yaml"):
        (tmp_path / name).write_text("old")
    with RunLock(tmp_path, "train"):
        old = move_aside(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", old.name]
        assert old.name.startswith("previous-") and (old / "checkpoints" / "stage1_best.pt").read_text() == "old"
        (tmp_path / "metrics.jsonl").write_text("new")
        again = move_aside(tmp_path)
    assert again != old and (again / "metrics.jsonl").read_text() == "new" and old.is_dir()


def test_truncate_metrics_removes_lines_beyond_the_resumed_iteration(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert truncate_metrics(path, "stage1", 10) == 0  # no file yet
    lines = [{"stage": "baseline", "iteration": 30}, {"stage": "stage1", "iteration": 10},
             {"stage": "stage1", "iteration": 20}, {"stage": "stage1", "iteration": 30, "val": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"stage": "stage1", "itera')  # torn last line
    assert truncate_metrics(path, "stage1", 10) == 3
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:2]
    assert truncate_metrics(path, "stage1", 10) == 0



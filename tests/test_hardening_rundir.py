"""The run directory: path errors, the writer lock, fingerprints, starting afresh, strict JSON, leftovers."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from learn2stop.utils import rundir
from learn2stop.utils.checkpoint import clean_stale_temp_files, load_checkpoint, save_checkpoint
from learn2stop.utils.formats import RUN_FORMAT
from learn2stop.utils.report import append_jsonl, write_json, write_text_atomic
from learn2stop.utils.fingerprint import (ABSENT, check_fingerprint, diff_fields, fingerprint, fingerprint_task,
                                          read_fingerprint, write_fingerprint)
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


# ----------------------------------------------------------------------------- the lock
def test_second_writer_in_the_same_process_is_refused_and_told_who(tmp_path):
    with RunLock(tmp_path, "train") as first:
        assert first.held
        info = json.loads((tmp_path / ".lock").read_text())
        assert info["pid"] == os.getpid() and info["command"] == "train"
        with pytest.raises(RunDirError, match=rf"is in use by pid {os.getpid()} on .*\(command 'train', since "):
            RunLock(tmp_path, "calibrate").acquire()
    with RunLock(tmp_path, "train"):  # released on exit
        pass


def test_reader_refused_while_a_writer_runs_and_readers_share(tmp_path):
    with RunLock(tmp_path, "train"):
        with pytest.raises(RunDirError, match=rf"is being written by pid {os.getpid()}.*wait for it to finish or copy"):
            RunLock(tmp_path, "evaluate", shared=True).acquire()
    with RunLock(tmp_path, "evaluate", shared=True), RunLock(tmp_path, "frontier", shared=True):
        with pytest.raises(RunDirError, match="is being read by another command"):
            RunLock(tmp_path, "train").acquire()


HOLDER = """
import sys, time
from learn2stop.utils.runlock import RunLock
lock = RunLock(sys.argv[1], "train").acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_held_by_another_process_then_freed_by_kill_9(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"in use by pid {proc.pid} .*command 'train'"):
            RunLock(tmp_path, "train").acquire()
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == proc.pid  # a stale lock file...
    with RunLock(tmp_path, "train"):  # ...blocks nothing: flock died with its process
        pass


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


def test_a_checkpoint_of_another_run_format_is_refused_in_one_line_naming_both_formats(tmp_path):
    """A checkpoint records the run format; one with none, or another, is refused naming both (no reader of older
    checkpoints guesses what they meant)."""
    from learn2stop.utils.checkpoint import CheckpointError

    path = tmp_path / "stage1.pt"
    save_checkpoint({"weights": {"w": torch.ones(2)}}, path)
    assert load_checkpoint(path)["version"] == RUN_FORMAT
    for made, shown in ((None, "0 (none recorded)"), (RUN_FORMAT - 1, str(RUN_FORMAT - 1)), (RUN_FORMAT + 1, str(RUN_FORMAT + 1))):
        data = {"format": "learn2stop-checkpoint", "weights": {"w": torch.ones(2)}}
        if made is not None:
            data["version"] = made
        torch.save(data, path)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        assert str(e.value) == (f"checkpoint {path} was written by learn2stop run format {shown}; this learn2stop reads "
                                f"format {RUN_FORMAT}: re-run it (train into a new --run-dir)")


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


def test_clean_stale_temp_files_removes_only_leftovers(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    save_checkpoint({"x": torch.zeros(2)}, ckpt / "stage1.pt")
    monkeypatch.setattr(os, "unlink", lambda p: None)  # a kill -9 mid-write: no cleanup runs
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"x": torch.ones(2)}, ckpt / "stage1.pt")
    monkeypatch.undo()
    (tmp_path / ".results.json.abc123.tmp").write_text("{")
    (tmp_path / ".keep").write_text("not ours")
    (tmp_path / "notes.tmp").write_text("not ours")
    removed = clean_stale_temp_files(tmp_path)
    assert len(removed) == 2 and all(p.name.endswith(".tmp") and p.name.startswith(".") for p in removed)
    assert sorted(p.name for p in ckpt.iterdir()) == ["stage1.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keep", "checkpoints", "notes.tmp"]
    torch.testing.assert_close(load_checkpoint(ckpt / "stage1.pt")["x"], torch.zeros(2))
    assert clean_stale_temp_files(tmp_path / "absent") == []


def test_kill_9_mid_training_then_resume_is_bit_identical(tmp_path):
    """A real SIGKILL at two points, then resume: same weights as an uninterrupted run, no temp files,
    no duplicated metric lines, and the lock of the killed process does not block."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import torch

    from tests.test_cli import TINY

    args = [a if a != "12" else "60" for a in TINY] + ["--run_aevb", "false", "--run_stage3", "false", "--no-progress",
                                                       "--threads", "1"]

    def train(run, kill_when=None):
        """Train; with ``kill_when`` (a checkpoint file), SIGKILL the process a moment after it appears."""
        cmd = [sys.executable, "-m", "learn2stop", "sparse", "train", "--run-dir", str(run), *args]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kill_when is None:
            assert p.wait(timeout=300) == 0, p.stderr.read().decode()
            return True
        while not (run / "checkpoints" / kill_when).exists() and p.poll() is None:
            time.sleep(0.01)
        time.sleep(0.3)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            return False
        return True

    clean, killed = tmp_path / "clean", tmp_path / "killed"
    train(clean)
    kills = [train(killed, kill_when=f) for f in ("baseline.pt", "stage1.pt")]  # mid-baseline, mid-Stage I
    assert kills.count(False) >= 1, "the process finished before it could be killed: make the run longer"
    train(killed)
    a = torch.load(clean / "checkpoints" / "stage2.pt", weights_only=True)["weights"]
    b = torch.load(killed / "checkpoints" / "stage2.pt", weights_only=True)["weights"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert not list(killed.rglob("*.tmp"))
    lines = [json.loads(l) for l in (killed / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["stage"], r["iteration"]) for r in lines]
    assert len(keys) == len(set(keys))
    assert keys == [(r["stage"], r["iteration"]) for r in
                    (json.loads(l) for l in (clean / "metrics.jsonl").read_text().splitlines())]


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


def test_a_reading_command_finds_moved_data_a_training_command_does_not(tmp_path, capsys):
    """location_fields (where the data lies) may differ for a reading command on a trained run, said in the log;
    a training command, and any other field, are still refused."""
    from dataclasses import dataclass, field

    from learn2stop.tasks.base import RunContext

    @dataclass
    class Data:
        path: str = "/old/place"
        size: int = 32

    @dataclass
    class Cfg:
        location_fields = ("data.path",)  # a class attribute, not a field (no annotation)
        data: Data = field(default_factory=Data)

    run = RunContext(run_dir=tmp_path / "run", progress=False)
    run.prepare(Cfg(), "train")
    (tmp_path / "run" / "checkpoints").mkdir()
    torch.save({}, tmp_path / "run" / "checkpoints" / "stage1.pt")
    run.close()
    moved = Cfg(data=Data(path="/new/place"))
    reader = RunContext(run_dir=tmp_path / "run", progress=False)
    reader.prepare(moved, "evaluate")
    reader.close()
    assert "data.path: reading '/new/place' (the run was trained on '/old/place')" in capsys.readouterr().out
    for cfg, command in ((moved, "train"), (Cfg(data=Data(size=64)), "evaluate")):
        refused = RunContext(run_dir=tmp_path / "run", progress=False)
        with pytest.raises(RunDirError, match="was trained with data"):
            refused.prepare(cfg, command)
        refused.close()  # as the command line does after a refusal


def test_a_field_the_fingerprint_lacks_is_refused_at_its_default_too(tmp_path):
    """A run's fingerprint holds every field its library had; a config with a field it lacks is another
    configuration, refused naming the field even at the field's default (no field is guessed for an older run:
    those are refused by their run format). A run of another run format is refused by every command, in one line."""
    from dataclasses import dataclass, field

    from learn2stop.tasks.base import RunContext

    @dataclass
    class Stage:
        lr: float = 0.1
        ema: float = 0.0

    @dataclass
    class Cfg:
        stage: Stage = field(default_factory=Stage)

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({}, run_dir / "checkpoints" / "stage1.pt")
    write_fingerprint(run_dir, {"stage": {"lr": 0.1}})
    for command in ("train", "evaluate"):
        refused = RunContext(run_dir=run_dir, progress=False)
        with pytest.raises(RunDirError, match=r"was trained with stage\.ema=<absent>; .* asks for stage\.ema=0\.0"):
            refused.prepare(Cfg(), command)
        refused.close()
    stored = json.loads((run_dir / "fingerprint.json").read_text())
    del stored["format"]
    (run_dir / "fingerprint.json").write_text(json.dumps(stored))
    for command in ("train", "evaluate"):
        refused = RunContext(run_dir=run_dir, progress=False)
        with pytest.raises(RunDirError, match=r"^run directory .* was written by learn2stop run format 0 \(none recorded\); "
                                              r"this learn2stop reads format \d+: re-run it"):
            refused.prepare(Cfg(), command)
        refused.close()
    stored["format"] = RUN_FORMAT
    (run_dir / "fingerprint.json").write_text(json.dumps(stored))
    assert read_fingerprint(run_dir) == {"stage": {"lr": 0.1}}  # never rewritten

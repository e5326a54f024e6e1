"""The run directory's writer lock (learn2stop.utils.runlock): one writer, shared readers, each refusal naming who
holds it; a lock dies with its process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from learn2stop.utils.rundir import RunDirError
from learn2stop.utils.runlock import RunLock


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

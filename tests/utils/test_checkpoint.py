"""Checkpoints (learn2stop.utils.checkpoint): another run format refused naming both, and the temp files a killed
write leaves removed, nothing else."""
from __future__ import annotations

import os

import pytest
import torch

from learn2stop.utils.checkpoint import clean_stale_temp_files, load_checkpoint, save_checkpoint
from learn2stop.utils.formats import RUN_FORMAT


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

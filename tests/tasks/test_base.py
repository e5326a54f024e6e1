"""The tasks' shared command layer (tasks/base.py): command options typed and checked once when made, and the run
context's fingerprint checks on a run directory."""
from __future__ import annotations

import json
import re

import pytest
import torch

from learn2stop.utils.config import ConfigError
from learn2stop.utils.formats import RUN_FORMAT
from learn2stop.utils.fingerprint import read_fingerprint, write_fingerprint
from learn2stop.utils.rundir import RunDirError


@pytest.mark.parametrize("kwargs, message", [
    ({"command": "evaluate", "budget": 0.5}, "--budget: only the 'calibrate' command(s) read it"),
    ({"command": "train", "backend": "torch"}, "--backend: only the 'evaluate' and 'frontier' command(s)"),
    ({"command": "calibrate"}, "give exactly one target"),
    ({"command": "calibrate", "budget": 1.5}, "--budget: the budget is a fraction of full depth in (0, 1]"),
    ({"command": "calibrate", "epsilon": -0.1}, "--epsilon: the allowed loss of quality must be"),
    ({"command": "evaluate", "backend": "torch,onnxruntime"}, "--backend: evaluate runs on one backend"),
    ({"command": "frontier", "backend": "tensorrt"}, "tensorrt"),
])
def test_command_options_are_typed_and_checked_once_when_made(kwargs, message):
    from learn2stop.tasks.base import CommandOptions

    with pytest.raises(ValueError, match=re.escape(message)):  # a ConfigError, or the backends' BackendError
        CommandOptions(**kwargs)


def test_a_calibration_target_is_one_of_budget_or_risk():
    from learn2stop.core.calibration import CalibrationTarget
    from learn2stop.tasks.base import CommandOptions

    assert CommandOptions(command="calibrate", epsilon=0.2).target == CalibrationTarget(epsilon=0.2)
    assert CalibrationTarget(epsilon=0.2).risk_level == 0.1 and CalibrationTarget(epsilon=0.2, delta=0.05).risk_level == 0.05
    assert CommandOptions(command="frontier", backend="onnxruntime,torch").backends == ("onnxruntime", "torch")
    assert CommandOptions().backends == ("torch",)
    with pytest.raises(ConfigError, match="the risk level goes with --epsilon"):
        CalibrationTarget(budget=0.5, delta=0.1)


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

"""Bad input, round two: options a command would ignore, rules a task lacks, parameters out of range,
calibrators and trainers given the wrong arguments, run directories of another task or without a
fingerprint, refused commands that must leave nothing behind, and data that must be refused by name."""
from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

from learn2stop.cli import main
from learn2stop.core import InferenceConfig, StageConfig, StagedTrainer, StoppingModel
from learn2stop.core.calibration import calibrate_budget
from learn2stop.core.calibration_file import Calibration, load_calibration
from learn2stop.core.inference import active_rule
from learn2stop.core.risk_control import calibrate_risk
from learn2stop.utils.config import ConfigError
from learn2stop.utils.formats import RUN_FORMAT

from conftest import ToyPolicy, ToyStepModel, ToyTask
from test_cli import TINY as SPARSE_TINY

SPARSE = [*SPARSE_TINY, "--run_aevb", "false", "--run_stage3", "false", "--no-progress", "--threads", "1"]


def run_cli(args, capsys):
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


# ----------------------------------------------------------------------------- refused before any folder exists
@pytest.mark.parametrize("args, message", [
    (["sparse", "calibrate", "--budget", "0.5", "--delta", "0.2"], "--delta: the risk level goes with --epsilon"),
    (["sparse", "calibrate", "--epsilon", "0.1", "--delta", "7"], "--delta: the risk level must be in (0, 1)"),
    (["sparse", "calibrate"], "give exactly one target"),
    (["sparse", "calibrate", "--budget", "0.5", "--epsilon", "0.1"], "give exactly one target"),
    (["sparse", "frontier", "--budget", "5"], "--budget: only the 'calibrate' command(s) read it; 'frontier' would ignore it"),
    (["sparse", "frontier", "--epsilon", "-1"], "--epsilon: only the 'calibrate'"),
    (["sparse", "train", "--budget", "0.5"], "--budget: only the 'calibrate'"),
    (["sparse", "evaluate", "--no-resume"], "--no-resume: only the 'train' and 'reproduce' command(s) read it"),
    (["sparse", "calibrate", "--budget", "0.5", "--no-speed"], "--no-speed: only the 'frontier'"),
    (["sparse", "calibrate", "--budget", "0.5", "--rule", "bogus"],
     "--rule: 'bogus' is not a stop rule; rules of task sparse: "),
    (["sparse", "calibrate", "--budget", "0.5", "--rule", "confidence"],
     "--rule: the 'confidence' rule reads class probabilities, and this task's outputs have no classes"),
    (["classify", "calibrate", "--budget", "0.5", "--rule", "tolerance"],
     "--rule: this task has no 'tolerance' rule; rules of task classify: "),
    (["maml", "evaluate", "--inference.rule", "entropy"], "this task's outputs have no classes; rules of task maml"),
    (["denoise", "evaluate", "--inference.rule", "patience"], "this task's outputs have no classes; rules of task denoise"),
    (["sparse", "evaluate", "--inference.rule", "tolerance", "--inference.param", "-1"],
     "inference.param: the tolerance rule's parameter must be > 0"),
    (["classify", "evaluate", "--inference.rule", "patience", "--inference.param", "0.5"],
     "inference.param: the patience rule's parameter must be an integer >= 0"),
    (["classify", "evaluate", "--inference.rule", "confidence", "--inference.param", "2"],
     "inference.param: the confidence rule's parameter must be in (0, 1]"),
    (["sparse", "train", "--method.beta", "-1"], "error: method.beta: must be > 0"),
    (["sparse", "train", "--problem.matrix_seed", "99999999999999999999999"],
     "problem.matrix_seed: a seed must be an integer in [0, 2**63)"),
    (["sparse", "train", "--problem.matrix_seed", "-5"], "problem.matrix_seed: a seed must be an integer in [0, 2**63)"),
    (["sparse", "train", "--stage1.iterations", "1e30"], "stage1.iterations: 1000000000000000019884624838656 does not fit"),
    (["sparse", "train", "--stage1.objective", "stage2"], "stage1.objective: must be 'stage1'"),
    (["sparse", "train", "--config", "/dev/null"], "config file /dev/null is not a regular file"),
    (["classify", "train", "--data.kind", "synthetic", "--data.synthetic_classes", "1"],
     "data.synthetic_classes: must be an integer >= 2"),
    (["maml", "train", "--data.source", "omniglot_npz", "--model.network", "conv4", "--data.n_way", "1"],
     "data.n_way: a few-shot task needs at least 2 classes"),
])
def test_refused_before_any_folder_is_made_naming_the_flag(args, message, tmp_path, capsys):
    run = tmp_path / "new" / "run"
    rc, err = run_cli([*args, "--run-dir", str(run), "--no-progress"], capsys)
    assert rc == 2 and message in err, err
    assert "method.method" not in err
    assert not (tmp_path / "new").exists()


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


def test_a_refused_data_load_leaves_no_new_folder(tmp_path, capsys):
    rc, err = run_cli(["denoise", "train", "--run-dir", str(tmp_path / "a" / "b" / "run"), "--no-progress",
                       "--data.train_dir", str(tmp_path / "missing")], capsys)
    assert rc == 2 and "missing" in err
    assert list(tmp_path.iterdir()) == []  # no .lock, config.yaml or fingerprint.json, no empty parents


# ----------------------------------------------------------------------------- a trained run
@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hardening") / "sparse"
    assert main(["sparse", "train", "--run-dir", str(run), *SPARSE]) == 0
    return run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def test_checkpoints_without_a_fingerprint_are_refused(sparse_run, tmp_path, capsys):
    run = _copy(sparse_run, tmp_path)
    (run / "fingerprint.json").unlink()
    for cmd in (["evaluate"], ["train", "--problem.sparsity", "0.3"]):
        rc, err = run_cli(["sparse", *cmd, "--run-dir", str(run), *SPARSE], capsys)
        assert rc == 2 and "has checkpoints but no fingerprint.json" in err
    assert not (run / "fingerprint.json").exists()


def test_a_run_of_another_task_is_named(sparse_run, tmp_path, capsys):
    run = _copy(sparse_run, tmp_path)
    rc, err = run_cli(["maml", "evaluate", "--run-dir", str(run), "--no-progress"], capsys)
    assert rc == 2 and "belongs to task sparse; use 'learn2stop sparse evaluate'" in err
    record = json.loads((run / "fingerprint.json").read_text())
    assert record.pop("task") == "sparse"  # no owner is guessed: without the record, the settings differ
    (run / "fingerprint.json").write_text(json.dumps(record))
    rc, err = run_cli(["denoise", "calibrate", "--budget", "0.5", "--run-dir", str(run), "--no-progress"], capsys)
    assert rc == 2 and "was trained with" in err and "belongs to task" not in err


def test_a_run_of_another_run_format_is_refused_by_every_command_in_one_line(sparse_run, tmp_path, capsys):
    """A run written before the run format was recorded (or in another one) is refused, training or reading, with
    one line naming the format it was made with and the one this library reads; nothing is written into it."""
    run = _copy(sparse_run, tmp_path)
    record = json.loads((run / "fingerprint.json").read_text())
    del record["format"]
    (run / "fingerprint.json").write_text(json.dumps(record))
    before = sorted(p.name for p in run.iterdir())
    for command in (["evaluate"], ["train"], ["calibrate", "--budget", "0.5"]):
        rc, err = run_cli(["sparse", *command, "--run-dir", str(run), *SPARSE], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, (command, err)
        assert (f"run directory {run} was written by learn2stop run format 0 (none recorded); this learn2stop reads "
                f"format {RUN_FORMAT}: re-run it") in lines[0]
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_refused_reader_writes_no_config_record(sparse_run, tmp_path, capsys):
    run = _copy(sparse_run, tmp_path)
    (run / "checkpoints" / "stage2.pt").unlink()
    before = sorted(p.name for p in run.iterdir())
    rc, err = run_cli(["sparse", "frontier", "--no-speed", "--run-dir", str(run), *SPARSE], capsys)
    assert rc == 2 and "no finished stage 'stage2'" in err
    assert sorted(p.name for p in run.iterdir()) == before  # no config.frontier.yaml
    (run / "calibration.json").write_text(json.dumps({"format": RUN_FORMAT, "rule": "quantile", "param": 7, "threshold": 7,
                                                      "target": {}}))
    shutil.copy(sparse_run / "checkpoints" / "stage2.pt", run / "checkpoints" / "stage2.pt")
    rc, err = run_cli(["sparse", "evaluate", "--run-dir", str(run), *SPARSE], capsys)
    assert rc == 2 and "calibration.json: param: the quantile rule's parameter must be in (0, 1]" in err and "got 7.0" in err
    assert not (run / "config.evaluate.yaml").exists()


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


# ----------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("kwargs, message", [
    (dict(rule="tolerance", param=-1), "inference.param: the tolerance rule's parameter must be > 0"),
    (dict(rule="tolerance", param=0), "inference.param: the tolerance rule's parameter must be > 0"),
    (dict(rule="confidence", param=2), r"inference.param: the confidence rule's parameter must be in \(0, 1\]"),
    (dict(rule="patience", param=0.5), "inference.param: the patience rule's parameter must be an integer >= 0"),
    (dict(rule="entropy", param=-1), "inference.param: the entropy rule's parameter must be > 0"),
    (dict(param=True), "inference.param: must be a finite number; got True"),
    (dict(sampled="yes"), "inference.sampled: must be true or false"),
    (dict(use_calibrated="no"), "inference.use_calibrated: must be true or false"),
])
def test_inference_config_ranges_per_rule(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InferenceConfig(**kwargs)
    assert InferenceConfig(rule="patience", param=2).param == 2


S, C = torch.rand(20, 4), torch.arange(1, 6) / 5.0
L = torch.rand(20, 5)


@pytest.mark.parametrize("call, error, message", [
    (lambda: calibrate_budget(torch.full((20, 4), float("nan")), C, 0.5, "quantile"), ValueError, r"scores: 80 NaN"),
    (lambda: calibrate_budget(S, C[:3], 0.5, "quantile"), ValueError, r"costs: expected a \(5,\) tensor"),
    (lambda: calibrate_budget(torch.zeros(0, 4), C, 0.5, "quantile"), ValueError, r"scores: expected a \(N, T-1\)"),
    (lambda: calibrate_budget(torch.rand(4), C, 0.5, "quantile"), ValueError, r"scores: expected a \(N, T-1\)"),
    (lambda: calibrate_budget([[0.1]], C, 0.5, "quantile"), TypeError, "scores: expected a"),
    (lambda: calibrate_budget(S, torch.tensor([0.2, float("nan"), 0.6, 0.8, 1.0]), 0.5, "quantile"), ValueError, "costs: NaN"),
    (lambda: calibrate_budget(S, C, 0.5, "bogus"), ValueError, "signal_name: must be one of"),
    (lambda: calibrate_risk(S, torch.full((20, 5), float("nan")), 0.1, 0.1, "quantile"), ValueError, "risk_losses: 100 NaN"),
    (lambda: calibrate_risk(torch.full((20, 4), float("nan")), L, 0.1, 0.1, "quantile"), ValueError, "scores: 80 NaN"),
    (lambda: calibrate_risk(S, torch.rand(7, 5), 0.1, 0.1, "quantile"), ValueError, r"risk_losses: expected \(20, 5\)"),
    (lambda: calibrate_risk(S, L, 0.1, 0.1, "quantile", loss_range=(1, 1)), ValueError, "loss_range: expected two"),
    (lambda: active_rule("quantile", None), TypeError, "inference: expected an InferenceConfig"),
    (lambda: active_rule(None, None), TypeError, "inference: expected an InferenceConfig"),
])
def test_calibrators_check_their_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name", ["../escaped", "", "a/b", "/abs", ".", "..", "x\0y", 3])
def test_a_stage_name_must_be_a_plain_name(name, tmp_path):
    trainer = StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="stage name: must be a plain name"):
        trainer.fit(name, StageConfig(objective="stage1", beta=0.1, iterations=2, batch_size=4))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "run"]  # nothing written anywhere


def test_fit_and_train_refuse_a_dict_for_their_config(tmp_path):
    trainer = StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), tmp_path / "run", progress=False)
    for bad in ({"objective": "stage1"}, None):
        with pytest.raises(TypeError, match="the stage config must be a StageConfig"):
            trainer.fit("stage1", bad)
    from learn2stop.tasks.classify import commands as classify_app
    from learn2stop.tasks.denoise import app as denoise_app
    from learn2stop.tasks.maml import commands as maml_app
    from learn2stop.tasks.sparse import app as sparse_app

    for app in (sparse_app, maml_app, classify_app, denoise_app):
        for command in (app.train, app.evaluate):
            with pytest.raises(TypeError, match="cfg: expected the task's config dataclass"):
                command({"seed": 0}, tmp_path / "run-of-a-dict")
    assert not (tmp_path / "run-of-a-dict").exists()


def test_a_resume_that_cannot_write_keeps_metrics(tmp_path, monkeypatch):
    from learn2stop.core import stage_checkpoints as trainer_module

    run = tmp_path / "run"
    cfg = StageConfig(objective="stage1", beta=0.1, iterations=4, batch_size=4, eval_every=2, checkpoint_every=2)
    StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), run, progress=False).fit("stage1", cfg)
    metrics = (run / "metrics.jsonl").read_text()
    assert metrics.count("\n") == 2
    longer = StageConfig(objective="stage1", beta=0.1, iterations=6, batch_size=4, eval_every=2, checkpoint_every=2)
    ck = torch.load(run / "checkpoints" / "stage1.pt", weights_only=True)  # make it an unfinished stage at 2
    ck.update(completed=False, iteration=2, stage_config=__import__("learn2stop").utils.config.to_dict(longer.inherit()))
    torch.save(ck, run / "checkpoints" / "stage1.pt")

    def read_only(*args, **kwargs):  # what mkstemp meets on a read-only checkpoints/ (root ignores modes)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(trainer_module.tempfile, "mkstemp", read_only)
    with pytest.raises(OSError, match=r"cannot write checkpoints to .*checkpoints \(Permission denied\)"):
        StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), run, progress=False).fit("stage1", longer)
    assert (run / "metrics.jsonl").read_text() == metrics  # the line after iteration 2 is still there


# ----------------------------------------------------------------------------- data
def test_truncated_omniglot_npz_and_image_size_are_named(tmp_path):
    from learn2stop.tasks.maml.classes import DataError
    from learn2stop.tasks.maml.config import DataConfig
    from learn2stop.tasks.maml.data import Data
    from learn2stop.tasks.maml.omniglot import load_omniglot_npz
    from test_hardening_data import GOOD_BG, GOOD_EV, write_npz

    root = write_npz(tmp_path / "o", GOOD_BG, GOOD_EV)
    data = (root / "background.npz").read_bytes()
    (root / "background.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"background\.npz is corrupt, truncated or lacks the arrays"):
        load_omniglot_npz(root, "train")
    root = write_npz(tmp_path / "p", GOOD_BG, GOOD_EV)
    with pytest.raises(DataError, match=r"the \.npz images are 28x28, but data\.image_size is 32"):
        Data(DataConfig(source="omniglot_npz", path=str(root), n_way=2, image_size=32))


def test_a_one_class_dataset_is_refused(tmp_path):
    from learn2stop.tasks.classify.data import ImageDataError, load_dataset

    np.savez(tmp_path / "cifar10_subset.npz", train_images=np.zeros((6, 3, 32, 32), np.uint8),
             train_labels=np.zeros(6, np.int64), test_images=np.zeros((2, 3, 32, 32), np.uint8),
             test_labels=np.zeros(2, np.int64))
    with pytest.raises(ImageDataError, match=r"the training images hold 1 class\(es\) \(airplane\); a classifier needs"):
        load_dataset("cifar_subset_npz", tmp_path)


def test_the_price_rule_needs_a_planning_policy():
    from learn2stop.core.task import check_policy_rule

    sm = StoppingModel(ToyStepModel(), ToyPolicy())
    with pytest.raises(ConfigError, match=r"--rule: the 'price' rule reads a planned q_phi, and this run's policy does not"):
        check_policy_rule("price", sm, "--rule")
    check_policy_rule("quantile", sm, "--rule")  # every policy has the per-step rules


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

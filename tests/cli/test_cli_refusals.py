"""Bad input on the command line: refused with exit status 2 and one message naming the flag, the field or the file,
before any folder is made and leaving a run's record untouched."""
import json
import shutil

import pytest

from learn2stop.cli import main
from learn2stop.utils.formats import RUN_FORMAT

from conftest import TINY as SPARSE_TINY


@pytest.mark.parametrize("args, message", [
    (["sparse", "calibrate", "--budget", "0"], "--budget"),
    (["sparse", "calibrate", "--budget", "1.01"], "--budget"),
    (["sparse", "calibrate", "--epsilon", "-0.1"], "--epsilon"),
    (["sparse", "calibrate", "--epsilon", "0.1", "--delta", "1"], "--delta"),
    (["sparse", "calibrate", "--epsilon", "0.1", "--delta", "0"], "--delta"),
    (["sparse", "calibrate"], "exactly one target"),
    (["sparse", "calibrate", "--budget", "0.5", "--epsilon", "0.1"], "exactly one target"),
    (["sparse", "frontier"], "run the 'train' command"),
    (["sparse", "evaluate"], "does not exist"),
    (["sparse", "train", "--inference.rule", "quantile", "--inference.param", "2"], "inference.param"),
    (["sparse", "train", "--inference.rule", "magic"], "inference.rule"),
    (["sparse", "train", "--method.price", "nan"], "method.price"),
    (["sparse", "train", "--method.beta", "-1"], "method.beta"),
    (["sparse", "train", "--lista.num_steps", "1"], "lista.num_steps"),
])
def test_cli_bad_input_exits_2_with_the_flag_named(args, message, tmp_path, capsys):
    run = tmp_path / "run"
    if args[1] == "calibrate" and "exactly one target" in message:
        run.mkdir()
    try:
        rc = main([*args, "--run-dir", str(run), "--no-progress"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if args[1] in ("frontier", "evaluate"):
        assert not run.exists() or not any(run.iterdir())  # a refused reader creates nothing


def test_the_run_directory_is_a_file_or_under_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    for run in (f, f / "sub"):
        assert main(["sparse", "train", "--run-dir", str(run), "--no-progress"]) == 2
        assert str(f) in capsys.readouterr().err


def test_a_refused_command_leaves_the_runs_record_untouched(tmp_path, capsys):
    from conftest import TINY

    run = tmp_path / "run"
    flags = [*TINY, "--run_aevb", "false", "--run_stage3", "false", "--no-progress"]
    assert main(["sparse", "train", "--run-dir", str(run), *flags]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["sparse", "train", "--run-dir", str(run), *flags, "--problem.matrix_seed", "7"]) == 2
    assert "problem.matrix_seed" in capsys.readouterr().err
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert {k: v for k, v in before.items() if k != ".lock"} == after


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

"""The learn2stop command: an end-to-end tiny reproduction, resume, and clear errors."""
import json

import pytest

from learn2stop.cli import main

from conftest import TINY


def test_reproduce_end_to_end_writes_tables_figures_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["sparse", "reproduce", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    out = capsys.readouterr().out
    assert "Table 1" in out and "LISTA-stop (T<=5)" in out and "FISTA (T=10)" in out
    for f in ("config.yaml", "table1.md", "table2.md", "results.json", "metrics.jsonl",
              "fig4_stop_distribution.png", "fig4_convergence.png", "checkpoints/stage2.pt"):
        assert (run / f).is_file(), f
    res = json.loads((run / "results.json").read_text())
    assert set(res["rows"]) >= {"ISTA (T=5)", "FISTA (T=10)", "LISTA (T=5)", "Stage I+II", "AEVB", "Stage I+II+III"}
    assert 1 <= res["depth"]["Stage I+II"]["mean"] <= 5
    # every rule calibrated to keep LISTA's quality, timed beside LISTA at full depth: does the deployed rule pay?
    in_time = json.loads((run / "in_time.json").read_text())
    rows = {r["rule"]: r for r in in_time["rows"]}
    assert list(rows) == ["baseline", "price", "tolerance", "fixed"]
    assert in_time["batch_sizes"] == [1, 90]  # the speed batch capped at the 90 test problems
    assert in_time["passes"] == {"1": 9, "90": 3}  # batch 1 jitters: three times the passes
    assert rows["baseline"]["speedup"] == {"1": 1.0, "90": 1.0} and rows["baseline"]["mean_steps"] == 5
    # deployed: the fastest at the served batch (1) among the certified rules and the baseline, up to a timing tie
    from learn2stop.core.timing import SPEED_TIE_CAP, SPEED_TIE_FLOOR

    deployed = in_time["deployed"]
    timed = {r: row["samples_per_s"]["1"] for r, row in rows.items() if row.get("samples_per_s", {}).get("1")}
    # the tie is the measured spread of the passes at the served batch, clamped to [floor, cap]
    spread = max(row["spread"]["1"] for row in rows.values() if "1" in row.get("spread", {}))
    assert in_time["tie"] == pytest.approx(min(SPEED_TIE_CAP, max(SPEED_TIE_FLOOR, spread)))
    # candidates: the baseline, and the rules that run fewer steps (on validation) measured no slower than it
    def can_win(r, n, cost):
        return r == "baseline" or (rows[r][cost] < 1 and rows[r]["samples_per_s"][n] >= rows["baseline"]["samples_per_s"][n])
    eligible = {r: v for r, v in timed.items() if can_win(r, "1", "val_mean_cost")}
    assert deployed in eligible and timed[deployed] >= (1 - in_time["tie"]) * max(eligible.values())
    if deployed == "baseline":
        assert not (run / "calibration.json").exists() and (run / "deployment.json").is_file()
        assert json.loads((run / "deployment.json").read_text())["tie"] == in_time["tie"]
    else:
        cal = json.loads((run / "calibration.json").read_text())
        assert cal["rule"] == deployed and rows[deployed]["param"] == pytest.approx(cal["param"])
        assert cal["target"]["tie"] == in_time["tie"]
    for n, rule in in_time["fastest"].items():  # the fastest candidate, with no tie
        assert rows[rule]["samples_per_s"][n] == max(row["samples_per_s"][n] for r, row in rows.items()
                                                     if row.get("samples_per_s") and can_win(r, n, "mean_cost"))
    assert "## In time" in (run / "in_time.md").read_text() and "## In time" in out
    # the one record of what the run serves, as every serving and evaluating command reads it
    from learn2stop.core.deployment import load_deployment
    from learn2stop.tasks.sparse.app import APP
    from learn2stop.tasks.sparse.config import SparseConfig
    from learn2stop.utils.config_files import resolve

    cfg = resolve(SparseConfig, yaml_path=str(run / "config.yaml"))
    dep = load_deployment(APP, cfg, run)
    assert dep.tie == in_time["tie"] and dep.kind == ("baseline" if deployed == "baseline" else "fastest")
    assert dep.stage == ("baseline" if deployed == "baseline" else "stage2") and dep.model.num_steps == 5
    if deployed != "baseline":
        assert dep.rule == deployed and dep.calibrated and dep.serve_batch == 1 and dep.description.startswith("calibrated")
    assert res["rule"] == load_deployment(APP, cfg, run, stage="stage2").description  # evaluate ran the stop model
    # a second run resumes: every stage is found finished, nothing retrains
    mtime = (run / "checkpoints" / "stage1.pt").stat().st_mtime
    trained_config = (run / "config.yaml").read_text()
    assert main(["sparse", "evaluate", "--run-dir", str(run), "--no-progress", "--inference.param", "0.7", *TINY]) == 0
    assert (run / "config.yaml").read_text() == trained_config  # evaluation never rewrites the training record
    assert "param: 0.7" in (run / "config.evaluate.yaml").read_text()
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    assert (run / "checkpoints" / "stage1.pt").stat().st_mtime == mtime


@pytest.mark.parametrize("args, message", [
    (["sparse", "train", "--preset", "huge"], "unknown preset 'huge'"),
    (["sparse", "train", "--stage1.beta", "0"], "stage1.beta: must be > 0"),
    (["sparse", "train", "--lista.num_steps", "0"], "lista.num_steps"),
    (["sparse", "train", "--stage1.iterations", "ten"], "stage1.iterations: expected int"),
    (["sparse", "train", "--config", "/nonexistent.yaml"], "config file not found"),
])
def test_bad_arguments_exit_with_a_named_error(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_task_and_missing_checkpoint(tmp_path, capsys):
    assert main(["nosuchtask", "train"]) == 2
    assert "unknown task 'nosuchtask'" in capsys.readouterr().err
    assert main(["sparse", "evaluate", "--run-dir", str(tmp_path / "missing"), *TINY]) == 2
    err = capsys.readouterr().err
    assert "does not exist; run the 'train' command first" in err
    assert not (tmp_path / "missing").exists()  # a reader creates nothing
    (tmp_path / "empty").mkdir()
    assert main(["sparse", "evaluate", "--run-dir", str(tmp_path / "empty"), *TINY]) == 2
    err = capsys.readouterr().err
    assert "checkpoint not found" in err and "baseline.pt" in err


def test_yaml_config_and_print_config(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage1:\n  beta: 0.5\nlista:\n  num_steps: 7\n")
    assert main(["sparse", "train", "--config", str(cfg), "--lista.num_steps", "9", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "num_steps: 9" in out and "beta: 0.5" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage1: [oops\n")
    with pytest.raises(SystemExit):
        main(["sparse", "train", "--config", str(bad)])
    assert "not valid YAML" in capsys.readouterr().err


def test_paper_cpu_preset_trains_equal_budget_lista_and_reports_training_curves(tmp_path, capsys):
    """paper-cpu's extra pieces on a tiny problem: LISTA trained on for Stage I's iterations (an equal
    budget), AEVB from LISTA's weights, each cell beside the paper's, NMSE against training time."""
    from learn2stop.tasks.sparse import preset
    from learn2stop.tasks.sparse.app import APP
    from learn2stop.tasks.sparse.config import equal_budget_config

    cfg = preset("paper-cpu")
    stages = {s.name: s for s in APP.stages(cfg)}
    assert stages["lista_equal"].init_from == "baseline" and stages["aevb"].init_from == "baseline"
    eq = equal_budget_config(cfg)
    assert (eq.objective, eq.select) == ("deep_supervision", "last")
    assert (eq.iterations, eq.batch_size, eq.lr, eq.lr_schedule) == (cfg.stage1.iterations, cfg.stage1.batch_size,
                                                                     cfg.stage1.lr, cfg.stage1.lr_schedule)
    run = tmp_path / "run"
    assert main(["sparse", "reproduce", "--preset", "paper-cpu", "--run-dir", str(run), "--no-progress", *TINY,
                 "--stage1.iterations", "18"]) == 0
    res = json.loads((run / "results.json").read_text())
    assert "LISTA (T=5), equal budget" in res["rows"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in records if r["stage"] == "lista_equal") == 18  # Stage I's iterations
    curves = res["training_curve"]
    n_base = sum(r["stage"] == "baseline" for r in records)
    assert len(curves["LISTA"]) == n_base + sum(r["stage"] == "lista_equal" for r in records)
    assert len(curves["LISTA-stop"]) == n_base + sum(r["stage"] in ("stage1", "stage2", "stage3") for r in records)
    for pts in curves.values():
        times = [t for t, _ in pts]
        assert times == sorted(times) and all(v == v and v < 0 for _, v in pts)  # cumulative seconds; finite dB
    assert curves["LISTA"][n_base - 1] == curves["LISTA-stop"][n_base - 1]  # the baseline is shared
    assert (run / "training_curve.png").is_file()
    table1 = (run / "table1.md").read_text()
    assert "(-17.53)" in table1 and "(-16.53)" in table1 and "equal budget" in table1  # LISTA's paper cells, mixed and SNR 20


# ----------------------------------------------------------------------------- the command as a new user meets it
def _run(args, capsys):
    """(exit code, stdout, stderr) of the command, whether it returns or exits (argparse's --help and errors)."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_and_short_top_level_help(capsys):
    import learn2stop
    from learn2stop.cli import COMMANDS
    from learn2stop.tasks.base import list_tasks

    assert _run(["--version"], capsys)[:2] == (0, f"learn2stop {learn2stop.__version__}\n")
    rc, out, _ = _run(["--help"], capsys)
    assert rc == 0 and len(out.splitlines()) <= 30  # the tasks and the commands, one line each
    lines = out.splitlines()
    for name in [*list_tasks(), *COMMANDS, "list"]:
        assert sum(line.split()[:1] == [name] for line in lines) >= 1, name
    assert "learn2stop <task> <command> --help" in out


def test_task_help_is_short_and_points_at_the_command_help(capsys):
    rc, out, _ = _run(["sparse", "--help"], capsys)
    assert rc == 0 and len(out.splitlines()) <= 30
    for command in ("train", "evaluate", "reproduce", "calibrate", "frontier", "export"):
        assert any(line.split()[:1] == [command] for line in out.splitlines()), command
    assert "--preset P" in out and "--run-dir DIR" in out and "stage1" in out
    assert "learn2stop sparse <command> --help" in out
    assert "--stage1.lr FLOAT" not in out and "--problem.m" not in out  # the field flags: the command's help


def test_command_help_gives_each_flag_its_field_docstring_and_the_presets_value(capsys):
    rc, out, _ = _run(["sparse", "train", "--help"], capsys)
    assert rc == 0
    text = " ".join(out.split())
    assert "--stage1.lr FLOAT Learning rate (the peak, with a schedule). (default: 0.001)" in text  # quick: 2e-3 / 2
    assert "--lista.num_steps INT T: the unrolled LISTA steps" in text and "(default: 16)" in text
    assert "--classical.depths INT,..." in text and "(default: 20,100)" in text  # typed as the flag takes it
    assert "--no-resume" in text and "--budget" not in text  # only the options train reads
    rc, out, _ = _run(["sparse", "train", "--preset", "paper", "--help"], capsys)
    assert "--stage1.lr FLOAT Learning rate (the peak, with a schedule). (default: 0.0001)" in " ".join(out.split())
    rc, out, _ = _run(["sparse", "calibrate", "--help"], capsys)
    assert "--budget B" in out and "--no-resume" not in out


@pytest.mark.parametrize("task", ["sparse", "maml", "denoise", "classify"])
def test_every_config_field_of_every_task_has_help(task):
    from learn2stop.tasks.base import get_task
    from learn2stop.utils.config_flags import _leaves

    undocumented = [name for name, _, _, doc in _leaves(get_task(task).config_class) if not doc]
    assert undocumented == []


@pytest.mark.parametrize("args, message", [
    (["spars", "reproduce"], "learn2stop: error: unknown task 'spars'; did you mean 'sparse'?"),
    (["--versoin"], "learn2stop: error: unknown flag --versoin; did you mean --version?"),
    (["sparse", "reproduc"], "learn2stop sparse: error: unknown command 'reproduc' for task 'sparse'; did you mean 'reproduce'?"),
    (["sparse", "train", "--stage1.lrr", "1e-3"], "learn2stop sparse train: error: unknown flag --stage1.lrr; did you mean --stage1.lr?"),
    (["sparse", "train", "--stage1.lrr=1e-3"], "unknown flag --stage1.lrr; did you mean --stage1.lr?"),
    (["sparse", "train", "--stage1.iter", "5", "--print-config"],  # a prefix is no flag: it stops working once shared
     "unknown flag --stage1.iter; did you mean --stage1.iterations?"),
    (["sparse", "train", "--preset", "quik"], "preset: unknown preset 'quik' for task 'sparse'; did you mean 'quick'?"),
    (["sparse", "train", "--stage1.lr", "fast"], "learn2stop sparse train: error: stage1.lr: expected float; got 'fast'"),
])
def test_mistakes_get_one_or_two_lines_and_the_nearest_name(args, message, capsys):
    rc, out, err = _run(args, capsys)
    assert rc == 2 and message in err, err
    assert len(err.splitlines()) <= 2 and "usage:" not in err


def test_an_unknown_yaml_key_names_the_nearest_field(tmp_path):
    from learn2stop.tasks.sparse.config import SparseConfig
    from learn2stop.utils.config import ConfigError
    from learn2stop.utils.config_files import resolve

    (tmp_path / "c.yaml").write_text("stage1:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^stage1\.lrr: unknown config field; did you mean 'lr'\?") as e:
        resolve(SparseConfig, {}, str(tmp_path / "c.yaml"))
    assert e.value.field == "stage1.lrr"


def test_config_errors_carry_the_field_they_blame():
    from learn2stop.tasks.sparse.config import SparseConfig
    from learn2stop.utils.config import ConfigError
    from learn2stop.utils.config_files import resolve

    with pytest.raises(ConfigError) as e:
        resolve(SparseConfig, {}, None, {"stage1": {"beta": 0}})
    assert (e.value.field, str(e.value)) == ("stage1.beta", "stage1.beta: must be > 0; got 0.0")
    # a changed objective takes its own default variant: the stage's objective check names the objective
    with pytest.raises(ConfigError) as e:
        resolve(SparseConfig, {"stage1": {"variant": "marginal"}}, None, {"stage1": {"objective": "stage2"}})
    assert e.value.field == "stage1.objective" and "must be 'stage1'" in str(e.value)


def test_a_changed_objective_takes_its_default_variant_unless_the_layer_gives_one():
    import dataclasses

    from learn2stop.core import StageConfig
    from learn2stop.core.objectives import stage_field
    from learn2stop.utils.config import ConfigError
    from learn2stop.utils.config_files import resolve

    @dataclasses.dataclass
    class Free:
        stage: StageConfig = stage_field(objective="stage1", variant="marginal")

    assert resolve(Free, None, None, {"stage": {"objective": "stage2"}}).stage.variant == "forward_kl"
    assert resolve(Free, None, None, {"stage": {"objective": "stage2", "variant": "map"}}).stage.variant == "map"
    assert resolve(Free, {"stage": {"variant": "sampled"}}).stage.variant == "sampled"
    with pytest.raises(ConfigError, match=r"^stage\.variant: must be one of"):  # the variant asked for is checked
        resolve(Free, None, None, {"stage": {"objective": "stage2", "variant": "marginal"}})


def test_the_rule_is_checked_once_on_the_config_the_command_runs(tmp_path, capsys):
    """MAML's patience rule exists with a kept answer (model.policy_posterior, as in its quick preset): a check on the
    defaults (no kept answer) refused it."""
    args = ["maml", "evaluate", "--model.policy_posterior", "true", "--inference.rule", "patience",
            "--inference.param", "2"]
    rc, out, err = _run([*args, "--print-config"], capsys)
    assert rc == 0 and "rule: patience" in out, err
    rc, _, err = _run([*args, "--model.policy_posterior", "false", "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 2 and "inference.rule: the 'patience' rule reads class probabilities" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--run-dir", "--config"])
def test_a_path_too_long_for_the_file_system_is_one_line_naming_the_flag_before_any_work(tmp_path, capsys, flag):
    long = tmp_path / ("p" * 300)
    with pytest.raises(SystemExit) as e:
        main(["sparse", "train", flag, str(long), "--run-dir" if flag == "--config" else "--no-progress",
              *([str(tmp_path / "run")] if flag == "--config" else []), *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"learn2stop sparse train: error: {flag}: ") and "is 300 bytes" in err[0], err
    assert len(err) <= 2 and "Traceback" not in "".join(err)
    assert list(tmp_path.iterdir()) == []  # refused before any work: no run directory


def test_a_bad_value_in_the_config_file_is_refused_even_under_a_flag(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("lista:\n  L: -3\n")
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["sparse", "train", "--config", str(tmp_path / "c.yaml"), "--lista.L", "4", "--run-dir", str(run),
              "--no-progress", *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: lista.L: must be > 0; got -3.0 (set in config file" in err and "c.yaml" in err, err
    assert not run.exists()


def test_a_config_file_nested_too_deep_is_one_line_naming_the_flag(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("seed: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SystemExit) as e:
        main(["sparse", "train", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"),
              "--no-progress", *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --config: config file" in err and "nests deeper than" in err, err
    assert not (tmp_path / "run").exists()


def test_kill_9_mid_training_then_resume_is_bit_identical(tmp_path):
    """A real SIGKILL at two points, then resume: same weights as an uninterrupted run, no temp files,
    no duplicated metric lines, and the lock of the killed process does not block."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import torch

    from conftest import TINY

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

"""The learn2stop command: an end-to-end tiny reproduction, resume, and clear errors."""
import json

import pytest

from learn2stop.cli import main

TINY = [
    "--problem.m", "13", "--problem.n", "27", "--problem.sparsity", "0.2",
    "--problem.test_per_snr", "30", "--problem.val_per_snr", "20",
    "--lista.num_steps", "5", "--classical.depths", "5,10", "--classical.L_grid", "3,5",
    "--classical.rho_grid", "0.05,0.1", "--classical.tune_samples", "50",
    "--policy.sketch_dim", "4",
    *[a for s in ("baseline", "stage1", "stage2", "stage3", "aevb")
      for a in (f"--{s}.iterations", "12", f"--{s}.batch_size", "32", f"--{s}.eval_every", "6", f"--{s}.checkpoint_every", "6")],
]


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
    in_time, cal = json.loads((run / "in_time.json").read_text()), json.loads((run / "calibration.json").read_text())
    rows = {r["rule"]: r for r in in_time["rows"]}
    assert list(rows) == ["baseline", "price", "tolerance", "fixed"] and in_time["deployed"] == cal["rule"] == "price"
    assert in_time["batch_sizes"] == [1, 90]  # the speed batch capped at the 90 test problems
    assert in_time["passes"] == {"1": 9, "90": 3}  # batch 1 jitters: three times the passes
    assert rows["baseline"]["speedup"] == {"1": 1.0, "90": 1.0} and rows["baseline"]["mean_steps"] == 5
    assert rows["price"]["param"] == pytest.approx(cal["param"])  # the deployed rule, the same threshold
    for n, rule in in_time["fastest"].items():
        assert rows[rule]["samples_per_s"][n] == max(r["samples_per_s"][n] for r in rows.values() if r.get("samples_per_s"))
    assert "## In time" in (run / "in_time.md").read_text() and "## In time" in out
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
    from learn2stop.tasks.sparse.app import APP, equal_budget_config

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

"""The benchmark scripts run end to end on tiny configs (their smoke modes): a broken script fails here,
not in front of a user. runtime_speed and streaming have their own tests; device_check, the GPU script, is run
with no time left (every step skipped, the archive still written)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import shared_data

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_run_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sparse_tables_tiny(tmp_path, capsys):
    results = _load("sparse_tables").main(["--preset", "quick", "--tiny", "--run-dir", str(tmp_path / "run")])
    assert "LISTA (T=5)" in results["rows"] and "Stage I+II" in results["rows"]
    assert "wall-clock for the whole pipeline" in capsys.readouterr().out


def test_classify_cifar_tiny(tmp_path, capsys):
    fr = _load("classify_cifar").main(["--preset", "quick", "--tiny", "--run-dir", str(tmp_path / "run")])
    assert {"policy", "confidence", "sdn_confidence"} <= set(fr["curves"]) and fr["num_steps"] == 6
    assert "training" in capsys.readouterr().out


def test_denoise_bsd68_tiny(tmp_path, capsys):
    root = shared_data("denoising")
    assert _load("denoise_bsd68").main(["--budget", "tiny", "--data-root", str(root), "--run-dir", str(tmp_path / "run"),
                                        "--no-bm3d", "--no-progress", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "run" / "benchmark.json").read_text())
    assert summary["budget"] == "tiny" and summary["summary"] and "1" in {str(k) for k in summary["ms_per_image"]}
    assert "ms per image at batch 1" in capsys.readouterr().out


def test_maml_omniglot_tiny_memory(tmp_path, capsys):
    data = shared_data("omniglot")
    assert _load("maml_omniglot").main(["--budget", "tiny", "--data", str(data), "--run-dir", str(tmp_path / "run"),
                                        "--memory-only", "--no-progress"]) == 0
    assert "ratio stop / MAML" in capsys.readouterr().out


def test_exit_costs_tiny(capsys):
    shares = _load("exit_costs").main(["--tiny", "--batches", "1,4", "--repeats", "1", "--threads", "1"])
    assert set(shares) == {"FLOPs", "time @1", "ms @1", "time @4", "ms @4"}
    for key in ("FLOPs", "time @1", "time @4"):
        assert shares[key][-1] == pytest.approx(1.0) and shares[key] == sorted(shares[key])
    assert "| exit | FLOPs |" in capsys.readouterr().out


def test_loop_modes_tiny(capsys):
    """Every loop mode stops where the synchronising loop does (the script checks it) and prints each ratio."""
    table = _load("loop_modes").main(["--tiny", "--batches", "1,4", "--modes", "sync,1,2", "--repeats", "1"])
    assert set(table) == {"full depth", "policy 0.5", "confidence 0.5"}
    assert set(table["policy 0.5"]) == {f"{m} @{b}" for b in (1, 4) for m in ("sync", "compact_every=1", "compact_every=2")}
    assert all(v > 0 for row in table.values() for v in row.values())
    assert "(1.00x)" in capsys.readouterr().out


def test_device_check_out_of_time(tmp_path):
    """With no time left every step is skipped, said in the log, and the results archive is still written."""
    assert _load("device_check").main(["--out", str(tmp_path / "out"), "--data", str(tmp_path), "--seconds", "0",
                                       "--device", "cpu", "--work", str(tmp_path / "work")]) == 0
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "== env: skipped" in log and "== reproduce-cifar: skipped" in log
    _load("device_check").main(["--out", str(tmp_path / "out"), "--data", str(tmp_path), "--seconds", "0", "--device", "cpu",
                                "--work", str(tmp_path / "work"), "--skip", "pytest,reproduce"])
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "== pytest-gpu: skipped (--skip)" in log and "== reproduce-cifar: skipped (--skip)" in log
    assert (tmp_path / "out" / "results.tar.gz").is_file()


def test_sparse_planner_cost_tiny(capsys):
    """Two planners side by side (one plan, two plans): their parts and their rollouts, deployed, with their plans
    replayed and with the same stop times given, are timed at both batch sizes."""
    rows = _load("sparse_planner_cost").main(["--tiny"])
    assert set(rows) == {1, 32}
    for best in rows.values():
        assert {"one LISTA step", "one plan: features", "one plan: first plan",
                "two plans: second plan", "two plans: deployed price rule",
                "one plan: its stop times given (free plan)", "stop model, fixed 3 steps",
                "two plans: its plans replayed (the same sorts, no features or MLP)",
                "LISTA-4, full depth"} <= set(best) and all(v > 0 for v in best.values())
        assert "one plan: second plan" not in best
    assert "| in LISTA steps |" in capsys.readouterr().out


def test_device_check_pack_and_unpack(tmp_path):
    """A run trained on the device comes back in parts and is rebuilt here: finished stages without optimizer
    state, the run's small files beside them; an unfinished stage stays behind."""
    import tarfile

    import torch

    from learn2stop.utils.checkpoint import load_checkpoint, save_checkpoint

    dc = _load("device_check")
    run = tmp_path / "work" / "sparse-paper-cpu"
    w = {"model.W": torch.randn(40, 30, generator=torch.Generator().manual_seed(0))}
    save_checkpoint({"stage": "baseline", "completed": True, "weights": w, "optimizer": {"state": {}}}, run / "checkpoints" / "baseline.pt")
    save_checkpoint({"stage": "stage2", "completed": True, "weights": {k: v * 2 for k, v in w.items()}}, run / "checkpoints" / "stage2.pt")
    save_checkpoint({"stage": "stage1", "completed": False, "weights": w}, run / "checkpoints" / "stage1.pt")
    (run / "fingerprint.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    parts = dc.pack_checkpoints(run, ["baseline", "stage1", "stage2"], out / "sparse-paper-cpu.ckpt", part_bytes=2000)
    assert len(parts) > 3 and all(p.stat().st_size <= 2000 for p in parts)
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        tar.add(run / "fingerprint.json", arcname="sparse-paper-cpu/fingerprint.json")
    (runs,) = dc.unpack(out, tmp_path / "back")
    assert sorted(p.name for p in (runs / "checkpoints").iterdir()) == ["baseline.pt", "stage2.pt"]
    assert (runs / "fingerprint.json").is_file()
    base, stop = (load_checkpoint(runs / "checkpoints" / f"{s}.pt") for s in ("baseline", "stage2"))
    assert "optimizer" not in base and base["completed"] and torch.equal(base["weights"]["model.W"], w["model.W"])
    assert torch.equal(stop["weights"]["model.W"], 2 * w["model.W"])
    assert dc.main(["--unpack", str(out), "--into", str(tmp_path / "again")]) == 0


def test_maml_sinusoid_bound_tiny(capsys):
    """The Bayes-stop bound on random-weight quick models: the sinusoids are recovered from their clean query points,
    and each oracle is at or below every rule on the MSE it picks by (the least of each task's curve)."""
    r = _load("maml_sinusoid_bound").main(["--tiny"])
    assert r["largest_residual"] < 1e-4
    rows = r["rows"]
    table, expected = rows["oracle on the 20 query labels (the table's)"], rows["oracle on the expected MSE (any rule)"]
    for name, (observed_mse, expected_mse, _) in rows.items():
        assert table[0] <= observed_mse + 1e-9 and expected[1] <= expected_mse + 1e-9, name
    assert set(r["curves"]) == {"policy, quantile", "policy, threshold", "Bayes stop, priced", "fixed depth",
                                "posterior estimate, priced (after all T steps)"}  # the tiny policy has the estimate
    assert "nearest step to the posterior estimate, after all T steps" in rows
    assert sum(k.startswith("best step so far by the posterior estimate") for k in rows) == 2
    assert "Bayes stop (support only)" in capsys.readouterr().out


def test_keep_best_answers_with_the_best_step_once_patience_runs_out():
    keep_best = _load("maml_sinusoid_bound").keep_best
    distance = torch.tensor([[5.0, 3.0, 4.0, 4.5, 1.0, 2.0],   # 3 at step 2, then two steps worse: stop at 4
                             [5.0, 4.0, 3.0, 2.0, 1.0, 0.5],   # always better: runs to T, answers T
                             [1.0, 0.99, 0.98, 2.0, 2.0, 2.0]])  # gains under a 5 % margin do not count
    answered, ran = keep_best(distance, patience=2, margin=0.0)
    assert answered.tolist() == [2, 6, 3] and ran.tolist() == [4, 6, 5]
    answered, ran = keep_best(distance, patience=2, margin=0.05)
    assert answered.tolist()[2] == 1 and ran.tolist()[2] == 3

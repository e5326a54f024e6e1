"""The benchmark scripts run end to end on tiny configs (their smoke modes): a broken script fails here,
not in front of a user. runtime_speed and streaming have their own tests; sparse_schedule_sweep is a GPU
sweep whose smallest run takes minutes on this CPU, so it is only imported (test_benchmarks.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import shared_data

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


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

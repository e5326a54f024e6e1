"""The maml CLI application: config validation, a tiny end-to-end run, resume, data errors."""
import json

import numpy as np
import pytest

from conftest import shared_data
from learn2stop.cli import main
from learn2stop.tasks import get_task
from learn2stop.tasks.maml.app import PRESETS, MAMLConfig
from learn2stop.utils.config import ConfigError, resolve

TINY = ["--maml.iterations", "4", "--stage1.iterations", "4", "--stage2.iterations", "4", "--maml.batch_size", "3",
        "--stage1.batch_size", "3", "--stage2.batch_size", "3", "--eval.tasks", "12", "--eval.val_tasks", "6",
        "--eval.chunk", "6", "--no-progress"]


def test_registered_with_presets():
    spec = get_task("maml")
    assert set(spec.commands) == {"train", "evaluate", "reproduce"}
    for name, preset in PRESETS.items():
        resolve(MAMLConfig, preset)  # every preset is a valid config


@pytest.mark.parametrize("override, field", [
    ({"data": {"k_min": 3, "k_max": 2}}, "data.k_max"),
    ({"data": {"k_min": 0}}, "data.k_min"),
    ({"data": {"source": "cifar"}}, "data.source"),
    ({"model": {"inner_lr": -1.0}}, "model.inner_lr"),
    ({"model": {"network": "mlp"}}, "model.network"),
    ({"stage1": {"objective": "stage2", "variant": "map"}}, "stage1.objective"),
    ({"eval": {"tasks": 0}}, "eval.tasks"),
    ({"eval": {"mode": "greedy"}}, "eval.mode"),
    ({"stage1": {"lr": -1.0}}, "stage1.lr"),
])
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve(MAMLConfig, PRESETS["paper"], overrides=override)


def test_quick_preset_end_to_end_and_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["maml", "reproduce", "--preset", "quick", "--run-dir", str(run_dir), "--model.inner_steps", "3"] + TINY) == 0
    result = json.loads((run_dir / "results.json").read_text())
    assert result["tasks"] == 12 and len(result["per_step"]["maml"]) == 3
    assert set(result["rows"]) >= {"MAML (3 steps)", "MAML-stop (learned stop)"}
    assert result["inner_steps_computed"]["maml_stop"] <= result["inner_steps_computed"]["maml"]
    assert (run_dir / "stop_by_shot.png").stat().st_size > 1000 and "95% CI" in (run_dir / "results.md").read_text()
    mtime = (run_dir / "stop" / "checkpoints" / "stage1.pt").stat().st_mtime
    capsys.readouterr()
    assert main(["maml", "evaluate", "--preset", "quick", "--run-dir", str(run_dir), "--model.inner_steps", "3"] + TINY) == 0
    assert main(["maml", "train", "--preset", "quick", "--run-dir", str(run_dir), "--model.inner_steps", "3"] + TINY) == 0
    assert (run_dir / "stop" / "checkpoints" / "stage1.pt").stat().st_mtime == mtime  # finished stages are skipped
    assert "MAML-stop (learned stop)" in capsys.readouterr().out


def test_omniglot_npz_run_on_generated_data(tmp_path):
    root = tmp_path / "omni"
    root.mkdir()
    rng = np.random.default_rng(0)
    for part, n in (("background", 12), ("evaluation", 8)):
        np.savez_compressed(root / f"{part}.npz", images=rng.integers(0, 256, (n, 6, 28, 28), dtype=np.uint8),
                            char_id=np.arange(n), alphabet=np.array([f"A{part}"] * n),
                            character=np.array([f"character{i:02d}" for i in range(n)]))
    args = ["maml", "reproduce", "--preset", "paper", "--data.path", str(root), "--data.n_way", "3", "--data.k_max", "3",
            "--model.hidden", "4", "--model.inner_steps", "2", "--eval.per_step", "false", "--eval.mode", "sample",
            "--run-dir", str(tmp_path / "run")] + TINY
    assert main(args) == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["tasks"] == 12 and set(result["rows"]) == {"MAML (2 steps)", "MAML-stop (learned stop)"}
    assert 0 <= result["rows"]["MAML (2 steps)"]["mean"] <= 100


def test_missing_or_unfit_data_is_a_clear_error(tmp_path, capsys):
    assert main(["maml", "train", "--preset", "paper", "--data.path", str(tmp_path / "nowhere"),
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2
    assert "Omniglot folder not found" in capsys.readouterr().err
    assert main(["maml", "train", "--preset", "omniglot-folders", "--data.path", str(tmp_path),
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2
    assert "images_background/ is missing" in capsys.readouterr().err
    assert main(["maml", "evaluate", "--preset", "quick", "--run-dir", str(tmp_path / "empty")] + TINY) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_paper_preset_checks_real_omniglot(tmp_path, capsys):
    """20-way 1-5 shot with rotations fits the real split; 20-way 20-shot + 1 query does not (20 drawings)."""
    path = str(shared_data("omniglot"))
    from learn2stop.tasks.maml.app import Data

    data = Data(resolve(MAMLConfig, PRESETS["paper"], overrides={"data": {"path": path}}).data)
    assert data.split["train"].num_classes == 4400 and data.split["test"].num_classes == 1692
    assert main(["maml", "train", "--preset", "paper", "--data.path", path, "--data.k_max", "20",
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2
    assert "fewer than k2 + query = 20 + 1 = 21" in capsys.readouterr().err

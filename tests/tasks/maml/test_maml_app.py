"""The maml CLI application: config validation, a tiny end-to-end run, resume, calibrate and frontier, data errors."""
import json
import math

import numpy as np
import pytest

from conftest import shared_data
from learn2stop.cli import main
from learn2stop.tasks import get_task
from learn2stop.tasks.maml.config import PRESETS, MAMLConfig
from learn2stop.utils.config import ConfigError
from learn2stop.utils.config_files import resolve

TINY = ["--maml.iterations", "4", "--stage1.iterations", "4", "--stage2.iterations", "4", "--posterior.iterations", "4",
        "--posterior.batch_size", "3", "--maml.batch_size", "3",
        "--stage1.batch_size", "3", "--stage2.batch_size", "3", "--eval.tasks", "12", "--eval.val_tasks", "6",
        "--eval.chunk", "6", "--no-progress"]


def test_registered_with_presets():
    spec = get_task("maml")
    assert set(spec.commands) == {"train", "evaluate", "reproduce", "calibrate", "frontier", "export"}
    for name, preset in PRESETS.items():
        resolve(MAMLConfig, preset)  # every preset is a valid config


@pytest.mark.parametrize("override, field", [
    ({"data": {"k_min": 3, "k_max": 2}}, "data.k_max"),
    ({"data": {"k_min": 0}}, "data.k_min"),
    ({"data": {"source": "cifar"}}, "data.source"),
    ({"model": {"inner_lr": -1.0}}, "model.inner_lr"),
    ({"model": {"inner_grad_clip": -1.0}}, "model.inner_grad_clip"),
    ({"model": {"policy_support_loss": "step"}}, "model.policy_support_loss: unknown"),  # follows policy_inputs
    ({"model": {"answer": "nearest"}}, "model.answer: unknown"),  # follows policy_posterior
    ({"model": {"policy_inputs": "separate"}}, "model.policy_inputs"),
    ({"model": {"network": "mlp"}}, "model.network"),
    ({"stage1": {"objective": "stage2", "variant": "map"}}, "stage1.objective"),
    ({"eval": {"tasks": 0}}, "eval.tasks"),
    ({"inference": {"rule": "greedy"}}, "inference.rule"),
    ({"inference": {"param": 1.5}}, "inference.param"),
    ({"method": {"beta": 0.0}}, "method.beta"),
    ({"method": {"price": -1.0}}, "method.price"),
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
    cal = json.loads((run_dir / "calibration.json").read_text())
    # the deployed row: the learned stop, or a certified fixed depth that costs no more on validation, named as such
    deployed = ("MAML-stop (learned stop)" if cal["rule"] != "fixed" else f"MAML-stop (fixed depth {int(cal['param'])})")
    if cal["rule"] == "fixed":
        assert cal["target"]["instead_of"]["rule"] == "quantile"
        assert cal["calibration"]["mean_cost"] <= cal["target"]["instead_of"].get("mean_cost", math.inf)
    assert set(result["rows"]) >= {"MAML (3 steps)", deployed}
    assert result["inner_steps_computed"]["maml_stop"] <= result["inner_steps_computed"]["maml"]
    assert (run_dir / "stop_by_shot.png").stat().st_size > 1000 and "95% CI" in (run_dir / "results.md").read_text()
    for f in ("config.yaml", "metrics.jsonl", "training_summary.json", "checkpoints/baseline.pt", "checkpoints/stage2.pt"):
        assert (run_dir / f).is_file(), f  # one run-directory layout, no per-model sub-folders
    assert not (run_dir / "maml").exists() and not (run_dir / "stop").exists()
    mtime = (run_dir / "checkpoints" / "stage1.pt").stat().st_mtime
    capsys.readouterr()
    assert main(["maml", "evaluate", "--preset", "quick", "--run-dir", str(run_dir), "--model.inner_steps", "3"] + TINY) == 0
    assert main(["maml", "train", "--preset", "quick", "--run-dir", str(run_dir), "--model.inner_steps", "3"] + TINY) == 0
    assert (run_dir / "checkpoints" / "stage1.pt").stat().st_mtime == mtime  # finished stages are skipped
    assert deployed in capsys.readouterr().out


def test_frontier_and_calibrate_end_to_end(tmp_path, capsys):
    """frontier writes every curve with speeds; calibrate meets its budget; evaluate then uses the calibrated rule."""
    run_dir = str(tmp_path / "run")
    args = ["--preset", "quick", "--run-dir", run_dir, "--model.inner_steps", "4"] + TINY
    assert main(["maml", "frontier"] + args) == 2  # nothing trained yet: a clear error
    assert "run the 'train' command" in capsys.readouterr().err
    assert main(["maml", "train"] + args) == 0
    assert main(["maml", "frontier"] + args) == 0
    front = json.loads((tmp_path / "run" / "frontier.json").read_text())
    assert front["metric"] == "query MSE" and front["lower_is_better"] is True and front["num_steps"] == 4
    assert {"fixed_depth", "tolerance", "policy", "oracle"} <= set(front["curves"])
    assert "baseline_fixed_depth" not in front["curves"]  # MAML has one output, after all T updates
    assert [p["depth"] for p in front["curves"]["fixed_depth"]] == [1, 2, 3, 4]
    for name in ("fixed_depth", "tolerance", "policy", "oracle"):
        for p in front["curves"][name]:
            assert {"mean_steps", "metric"} <= set(p) and 1 <= p["mean_steps"] <= 4
            if name != "oracle":  # the oracle is a bound, not a method: it has no speed
                assert p["samples_per_s_batch1"] > 0 and p["samples_per_s_batchN"] > 0
    assert front["full_depth"]["metric"] == front["curves"]["fixed_depth"][-1]["metric"]
    assert front["batch_n"] == 12 and (tmp_path / "run" / "frontier.png").stat().st_size > 1000

    assert main(["maml", "calibrate", "--budget", "1.5"] + args) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["maml", "calibrate", "--budget", "0.5"] + args) == 0
    cal = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert cal["rule"] == "quantile" and cal["calibration"]["mean_steps"] <= 0.5 * 4 + 1e-6
    capsys.readouterr()
    assert main(["maml", "evaluate"] + args) == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["rule"].startswith("calibrated quantile rule") and "calibrated quantile rule" in capsys.readouterr().out
    assert result["mean_stop_step"] == pytest.approx(cal["test"]["mean_steps"])  # the same test tasks and rule


def test_fixed_task_sets_and_the_tolerance_signal():
    """val and test are fixed, seeded and distinct; training selects on the very val tasks; the classical
    rule watches the relative change of each task's support loss."""
    import torch

    from learn2stop.core import signal_trace, unroll
    from learn2stop.tasks.maml.app import APP

    cfg = resolve(MAMLConfig, PRESETS["quick"], overrides={"model": {"inner_steps": 3}, "eval": {"tasks": 7, "val_tasks": 5, "chunk": 3}})
    val, test = APP.eval_batches(cfg, "val", "cpu"), APP.eval_batches(cfg, "test", "cpu")
    assert [b[1].shape[0] for b in val] == [3, 2] and sum(b[1].shape[0] for b in test) == 7
    torch.testing.assert_close(val[0][1], APP.eval_batches(cfg, "val", "cpu")[0][1])
    assert not torch.equal(val[0][1], test[0][1][:3])
    sm = APP.build_models(cfg, "cpu")["stop"]
    task_val = APP.training_task(cfg, "stop", sm).validation_batches("cpu")
    torch.testing.assert_close(task_val[1][0]["support_x"], val[1][0]["support_x"])
    inputs, _ = val[0]
    with torch.no_grad():
        r = unroll(sm.model, inputs, keep_outputs=True)
    scores = signal_trace(APP.classical_signals(cfg)["tolerance"](), r.step_outputs, inputs)  # (3, T-1)
    loss = torch.stack([o["support_loss"] for o in r.step_outputs], 1)  # (3, T)
    assert torch.isinf(scores[:, 0]).all()  # step 1 has no previous support loss: never stops
    torch.testing.assert_close(scores[:, 1], -(loss[:, 1] - loss[:, 0]).abs() / loss[:, 1])


def test_omniglot_npz_run_on_generated_data(tmp_path):
    root = tmp_path / "omni"
    root.mkdir()
    rng = np.random.default_rng(0)
    for part, n in (("background", 12), ("evaluation", 8)):
        np.savez_compressed(root / f"{part}.npz", images=rng.integers(0, 256, (n, 6, 28, 28), dtype=np.uint8),
                            char_id=np.arange(n), alphabet=np.array([f"A{part}"] * n),
                            character=np.array([f"character{i:02d}" for i in range(n)]))
    args = ["maml", "reproduce", "--preset", "paper", "--data.path", str(root), "--data.n_way", "3", "--data.k_max", "3",
            "--model.hidden", "4", "--model.inner_steps", "2", "--eval.per_step", "false", "--inference.sampled", "true",
            "--run-dir", str(tmp_path / "run")] + TINY
    assert main(args) == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["tasks"] == 12 and set(result["rows"]) == {"MAML (2 steps)", "MAML-stop (learned stop)"}
    assert 0 <= result["rows"]["MAML (2 steps)"]["mean"] <= 100 and result["rule"] == "sampled policy"
    assert result["metric"] == "accuracy (%)" and result["lower_is_better"] is False


def test_missing_or_unfit_data_is_a_clear_error(tmp_path, capsys):
    assert main(["maml", "train", "--preset", "paper", "--data.path", str(tmp_path / "nowhere"),
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2
    assert "Omniglot folder not found" in capsys.readouterr().err
    assert main(["maml", "train", "--preset", "omniglot-folders", "--data.path", str(tmp_path),
                 "--run-dir", str(tmp_path / "r2")] + TINY) == 2
    assert "images_background/ is missing" in capsys.readouterr().err
    assert main(["maml", "evaluate", "--preset", "quick", "--run-dir", str(tmp_path / "empty")] + TINY) == 2
    assert "run the 'train' command first" in capsys.readouterr().err
    assert main(["maml", "evaluate", "--preset", "paper", "--data.path", str(tmp_path / "nowhere"),
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2  # the refused train left no folder at all
    assert "does not exist; run the 'train' command first" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "r2").exists()


def test_paper_preset_checks_real_omniglot(tmp_path, capsys):
    """20-way 1-5 shot with rotations fits the real split; 20-way 20-shot + 1 query does not (20 drawings)."""
    path = str(shared_data("omniglot"))
    from learn2stop.tasks.maml.data import Data

    data = Data(resolve(MAMLConfig, PRESETS["paper"], overrides={"data": {"path": path}}).data)
    assert data.split["train"].num_classes == 4400 and data.split["test"].num_classes == 1692
    assert main(["maml", "train", "--preset", "paper", "--data.path", path, "--data.k_max", "20",
                 "--run-dir", str(tmp_path / "r")] + TINY) == 2
    assert "fewer than k2 + query = 20 + 1 = 21" in capsys.readouterr().err

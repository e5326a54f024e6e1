"""DnCNN-stop end to end on tiny images: the core pipeline trains every stage, evaluation writes Table 6
with real early exit, frontier and calibrate run through the CLI, the denoise command writes images with
the depth used, and bad uses fail clearly."""
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from learn2stop.cli import main as cli_main
from learn2stop.core.trace import collect_trace
from learn2stop.core.train import load_stage
from learn2stop.tasks.base import RunContext
from learn2stop.tasks.denoise import add_noise, psnr
from learn2stop.tasks.denoise.app import APP, denoise_files, evaluate, train
from learn2stop.tasks.denoise.config import PRESETS, DenoiseAppConfig
from learn2stop.tasks.denoise.data import load_test_images, load_training_images
from learn2stop.utils.checkpoint import CheckpointError
from learn2stop.utils.config import merge
from learn2stop.utils.config_files import resolve

TINY = {
    "data": {"synthetic_train": 10, "synthetic_test": 2, "synthetic_size": 32, "patch_size": 16, "stride": 8,
             "scales": [1.0, 0.8], "val_patches": 16},
    "model": {"depth": 5, "channels": 8, "policy_hidden": 4},
    "method": {"beta": 0.1, "price": 0.5},
    "baseline": {"iterations": 120, "batch_size": 16, "lr": 5e-3, "eval_every": 40, "checkpoint_every": 40},
    "heads": {"iterations": 20, "batch_size": 16, "lr": 5e-3, "eval_every": 20, "checkpoint_every": 20},
    "stage1": {"iterations": 20, "batch_size": 16, "lr": 1e-3, "lr_schedule": "constant", "eval_every": 20,
               "checkpoint_every": 20},
    "stage2": {"iterations": 20, "batch_size": 16, "lr": 1e-2, "lr_schedule": "constant", "eval_every": 20,
               "checkpoint_every": 20},
    "eval": {"sigmas": [25.0, 50.0], "figure_sigmas": [50.0], "bm3d": False, "crop": 16},
}


def tiny_cfg(**extra):
    """The quick preset shrunk to seconds (the CLI's default preset, so ``--config`` of TINY gives the same)."""
    return resolve(DenoiseAppConfig, merge(merge(PRESETS["quick"], TINY), extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("denoise_run")
    cfg = tiny_cfg()
    run = RunContext(run_dir=run_dir, progress=False)
    train(cfg, run)
    return cfg, run


def test_training_raises_psnr_and_evaluation_writes_table_and_figure(trained):
    cfg, run = trained
    out = evaluate(cfg, run)
    results = json.loads((run.run_dir / "results.json").read_text())
    assert len(results["per_image"]) == 2 * 2 and "quantile rule" in results["rule"]
    for s in out["summary"]:
        assert s["psnr DnCNN"] > s["psnr_noisy"] + 2.0, s  # trained: clearly better than the noisy input
        assert s["psnr_stop_last"] > s["psnr_noisy"] + 2.0, s
        assert 1 <= s["stop_output"] <= 4 and s["psnr_stop_oracle"] >= s["psnr_stop_last"] - 1e-6
        assert 2 <= s["stop_layers"] <= 5 and 0 < s["stop_cost"] <= 1
    # real early exit gives exactly the full rollout's PSNR at the exit where each image stopped
    sm = load_stage(APP, cfg, run.run_dir, "stage2")
    trace = collect_trace(sm.model, APP.eval_batches(cfg, "test", None), APP.metric(cfg))
    for i, row in enumerate(results["per_image"]):
        assert row["psnr DnCNN-stop"] == pytest.approx(float(trace.metric[i, row["stop_output"] - 1]), abs=1e-4)
        assert row["stop_layers"] == sm.model.layers_at(row["stop_output"])
    # the untrained network (last layer initialised near zero) returns about the noisy input
    dncnn0 = APP.build_models(cfg, "cpu")["baseline"].model.eval()
    dncnn = load_stage(APP, cfg, run.run_dir, "baseline").model
    clean = torch.from_numpy(load_test_images(cfg)[0][0])[None, None]
    noisy = add_noise(clean, 25.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float(psnr(dncnn(noisy), clean)) > float(psnr(dncnn0(noisy), clean)) + 2.0
    table = (run.run_dir / "table6.md").read_text()
    assert "DnCNN-stop" in table and "| 25 |" in table and "| mean |" in table and "BM3D: off" in table
    assert "ms per image at batch 1" in table and "at batch 8" in table
    assert set(results["ms_per_image"]["1"]) == {"DnCNN", "DnCNN-stop", "DnCNN-stop full depth"}
    assert (run.run_dir / "denoise_crops.png").stat().st_size > 1000


def test_resume_skips_finished_stages(trained):
    cfg, run = trained
    mtimes = {p.name: p.stat().st_mtime for p in (run.run_dir / "checkpoints").glob("*.pt")}
    summary = train(cfg, run)
    assert list(summary) == ["baseline", "heads", "stage1", "stage2"]
    assert {p.name: p.stat().st_mtime for p in (run.run_dir / "checkpoints").glob("*.pt")} == mtimes
    # the heads warm-up left the backbone as DnCNN trained it; Stage I then fine-tuned it
    base, heads, stop = (load_stage(APP, cfg, run.run_dir, s).model for s in ("baseline", "heads", "stage1"))
    torch.testing.assert_close(heads.final.weight, base.final.weight)
    torch.testing.assert_close(heads.blocks[1][0].weight, base.blocks[1][0].weight)
    assert not torch.equal(stop.blocks[1][0].weight, base.blocks[1][0].weight)


def test_frontier_and_calibrate_through_the_cli(trained, tmp_path, capsys):
    cfg, run = trained
    run_dir = tmp_path / "run"
    shutil.copytree(run.run_dir, run_dir)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    common = ["--config", str(config), "--run-dir", str(run_dir), "--no-progress"]
    assert cli_main(["denoise", "frontier", *common]) == 0
    fr = json.loads((run_dir / "frontier.json").read_text())
    assert fr["metric"] == "PSNR (dB)" and fr["lower_is_better"] is False and fr["num_steps"] == 4
    assert {"fixed_depth", "baseline_fixed_depth", "tolerance", "policy", "oracle"} <= set(fr["curves"])
    assert fr["full_depth"]["samples_per_s_batch1"] > 0 and fr["full_depth"]["samples_per_s_batchN"] > 0
    stop_model = load_stage(APP, cfg, run_dir, "stage2").model  # full depth reads the last output alone: no head, no policy
    assert fr["full_depth"]["mean_macs_per_pixel"] == pytest.approx(stop_model.fixed_exit_costs[-1])
    assert stop_model.fixed_exit_costs[-1] < stop_model.exit_costs[-1]
    assert [p["depth"] for p in fr["curves"]["baseline_fixed_depth"]] == [1, 2, 3, 4]
    assert (run_dir / "frontier.md").is_file() and (run_dir / "frontier.png").stat().st_size > 1000
    capsys.readouterr()
    assert cli_main(["denoise", "calibrate", *common, "--budget", "0.5"]) == 0
    cal = json.loads((run_dir / "calibration.json").read_text())
    assert cal["target"] == {"kind": "budget", "budget": 0.5} and cal["calibration"]["mean_cost"] <= 0.5 + 1e-6
    assert cli_main(["denoise", "calibrate", *common, "--epsilon", "0.1", "--delta", "0.1"]) == 0
    cal = json.loads((run_dir / "calibration.json").read_text())
    assert cal["target"]["kind"] == "risk" and cal["calibration"]["risk"] <= 0.1
    # evaluate and the denoise command now use the calibrated rule
    assert cli_main(["denoise", "evaluate", *common]) == 0
    assert "calibrated quantile rule" in json.loads((run_dir / "results.json").read_text())["rule"]
    capsys.readouterr()
    assert cli_main(["denoise", "calibrate", *common, "--budget", "1.5"]) == 2
    assert "--budget" in capsys.readouterr().err


def test_denoise_command_writes_images_and_depths(trained, tmp_path, capsys):
    cfg, run = trained
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((20, 27)) * 255).astype(np.uint8), mode="L").save(folder / "grey.png")
    Image.fromarray((rng.random((18, 18, 3)) * 255).astype(np.uint8), mode="RGB").save(folder / "colour.png")
    cfg.denoise.input, cfg.denoise.output = str(folder), str(tmp_path / "out")
    out = denoise_files(cfg, run)
    assert "colour.png: colour image (mode RGB) converted to greyscale" in capsys.readouterr().out
    recs = {r["input"].split("/")[-1]: r for r in out["images"]}
    assert set(recs) == {"grey.png", "colour.png"}
    assert Image.open(tmp_path / "out" / "grey_denoised.png").size == (27, 20)
    assert all(2 <= r["layers"] <= cfg.model.depth for r in recs.values())
    assert json.loads((tmp_path / "out" / "depths.json").read_text())[0]["of_layers"] == cfg.model.depth
    cfg.denoise.input = str(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="not found"):
        denoise_files(cfg, run)


def test_the_denoise_command_serves_the_baseline_where_the_run_deploys_it(trained, tmp_path, capsys):
    """A run whose reproduce found no threshold keeping the baseline's quality (deployment.json) denoises with the
    baseline at full depth: every image through all layers, no early exit."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained[1].run_dir, copy, ignore=shutil.ignore_patterns(".lock", "calibration.json"))
    from learn2stop.utils.formats import RUN_FORMAT

    (copy / "deployment.json").write_text(json.dumps({"format": RUN_FORMAT, "stage": APP.baseline_stage, "reason": "a test"}))
    Image.fromarray((np.random.default_rng(0).random((20, 20)) * 255).astype(np.uint8), mode="L").save(tmp_path / "a.png")
    cfg = tiny_cfg()
    cfg.denoise.input, cfg.denoise.output = str(tmp_path / "a.png"), str(tmp_path / "out")
    out = denoise_files(cfg, RunContext(run_dir=copy, progress=False))
    assert "at full depth, no early exit: a test" in capsys.readouterr().out
    assert [r["layers"] for r in out["images"]] == [cfg.model.depth]


def test_evaluate_without_training_or_with_another_model_fails_clearly(trained, tmp_path):
    cfg, run = trained
    with pytest.raises(CheckpointError, match="not found"):
        evaluate(cfg, RunContext(run_dir=tmp_path, progress=False))
    with pytest.raises(CheckpointError, match="does not fit"):
        evaluate(tiny_cfg(model={"channels": 6}), run)


def test_cli_rejects_bad_values_and_missing_folders(tmp_path, capsys):
    for flag, value in (("--data.sigma_max", "-5"), ("--inference.param", "2"), ("--method.price", "-1")):
        with pytest.raises(SystemExit):
            cli_main(["denoise", "train", flag, value, "--run-dir", str(tmp_path / "r")])
        assert flag[2:] in capsys.readouterr().err
    rc = cli_main(["denoise", "train", "--no-progress", "--data.train_dir", str(tmp_path / "nowhere"),
                   "--run-dir", str(tmp_path / "r2")])
    assert rc == 2 and "image folder not found" in capsys.readouterr().err
    rc = cli_main(["denoise", "frontier", "--run-dir", str(tmp_path / "r3")])
    assert rc == 2 and "run the 'train' command" in capsys.readouterr().err


def test_presets_resolve():
    for name, p in PRESETS.items():
        cfg = resolve(DenoiseAppConfig, p)
        assert cfg.model.depth >= 3 and cfg.stage1.beta is None  # beta and price come from the method
    paper = resolve(DenoiseAppConfig, PRESETS["paper"])
    assert (paper.model.depth, paper.model.channels, len(paper.model.positions)) == (20, 64, 18)
    assert paper.method.beta == 0.1 and paper.stage1.lr == 1e-4 and paper.data.patch_size == 50
    quick = resolve(DenoiseAppConfig, PRESETS["quick"])
    assert quick.method.price > 0 and quick.stage1.inherit(quick.method).price == quick.method.price


def test_validation_split_is_disjoint_from_training_and_test(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    for i in range(10):
        Image.fromarray(np.full((20, 20), 20 * i, dtype=np.uint8), mode="L").save(folder / f"{i}.png")
    cfg = tiny_cfg(data={"train_dir": str(folder), "max_train_images": 0})
    train_imgs, val_imgs = load_training_images(cfg)
    levels = lambda imgs: {round(float(im[0, 0]) * 255) for im in imgs}
    assert len(val_imgs) == 2 and len(train_imgs) == 8
    assert levels(train_imgs).isdisjoint(levels(val_imgs)) and len(levels(train_imgs) | levels(val_imgs)) == 10
    # the embedded default: test images come from another seed than training/validation
    syn = tiny_cfg()
    tr, va = load_training_images(syn)
    te, names = load_test_images(syn)
    assert len(te) == 2 and names[0].endswith(".png")
    assert not any(np.array_equal(a, b) for a in te for b in tr + va)
    # evaluation samples: every image at every sigma, one seeded noise each, the same on every call
    items = APP.eval_set(syn, "test")
    assert [(s.name, s.sigma) for s in items[:2]] == [(names[0], 25.0), (names[0], 50.0)]
    assert not torch.equal(items[0].noisy - items[0].clean, items[2].noisy - items[2].clean)


def test_reproduce_deploys_the_rule_that_keeps_the_baselines_quality(trained, tmp_path):
    """reproduce = train (resumed: nothing left) + the calibrated default rule + evaluate."""
    from learn2stop.tasks.denoise.app import reproduce

    cfg, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run.run_dir, copy, ignore=shutil.ignore_patterns(".lock", "calibration.json"))
    out = reproduce(cfg, RunContext(run_dir=copy, progress=False))
    path = copy / "calibration.json"
    if path.is_file():  # the stop model leads the baseline on validation: its lead is spent, with the guarantee
        cal = json.loads(path.read_text())
        assert cal["target"]["kind"] == "risk" and cal["target"]["reference"] == "heads at full depth"
        assert out["rule"].startswith("calibrated")
    else:  # no lead to spend and no threshold matches: the configured rule stays, and the run deploys the baseline
        assert not out["rule"].startswith("calibrated")
        assert json.loads((copy / "deployment.json").read_text())["stage"] == "heads"
        assert "the run deploys DnCNN (its exits warmed up on the frozen backbone) at full depth instead" in out["rule"]

"""DnCNN-stop end to end on tiny images: training raises PSNR, evaluation writes Table 6 and the
figure, the denoise command writes images with the depth used, and bad uses fail clearly."""
import json

import numpy as np
import pytest
from PIL import Image

from learn2stop.cli import main as cli_main
from learn2stop.tasks.base import RunContext
from learn2stop.tasks.denoise.app import PRESETS, DenoiseAppConfig, denoise_files, evaluate, load_models, train
from learn2stop.utils.checkpoint import CheckpointError
from learn2stop.utils.config import ConfigError, resolve

TINY = {
    "data": {"synthetic_train": 10, "synthetic_test": 2, "synthetic_size": 32, "patch_size": 16, "stride": 8,
             "scales": [1.0, 0.8], "val_patches": 16},
    "model": {"depth": 5, "channels": 8, "policy_channels": 4},
    "dncnn": {"iterations": 120, "batch_size": 16, "lr": 5e-3, "eval_every": 40, "checkpoint_every": 40},
    "heads": {"iterations": 20, "batch_size": 16, "lr": 5e-3, "eval_every": 20, "checkpoint_every": 20},
    "stage1": {"iterations": 20, "batch_size": 16, "lr": 1e-3, "eval_every": 20, "checkpoint_every": 20},
    "stage2": {"iterations": 20, "batch_size": 16, "lr": 1e-2, "eval_every": 20, "checkpoint_every": 20},
    "eval": {"sigmas": [25.0, 50.0], "figure_sigmas": [50.0], "bm3d": False, "crop": 16},
}


def tiny_cfg(**extra):
    from learn2stop.utils.config import merge

    return resolve(DenoiseAppConfig, merge(TINY, extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("denoise_run")
    cfg = tiny_cfg()
    run = RunContext(run_dir=run_dir, progress=False)
    run.prepare(cfg)
    train(cfg, run)
    return cfg, run


def test_training_raises_psnr_and_evaluation_writes_table_and_figure(trained):
    cfg, run = trained
    out = evaluate(cfg, run)
    results = json.loads((run.run_dir / "results.json").read_text())
    assert len(results["per_image"]) == 2 * 2
    for s in out["summary"]:
        assert s["DnCNN"] > s["noisy"] + 2.0, s  # trained: clearly better than the noisy input
        assert s["DnCNN-stop"] > s["noisy"] + 2.0, s
        assert 1 <= s["depth_output"] <= 4 and s["stop_oracle"] >= s["stop_last"] - 1e-6
    # the untrained network (last layer initialised near zero) returns about the noisy input
    cfg0 = tiny_cfg()
    from learn2stop.tasks.denoise.app import build_models, load_test_images
    from learn2stop.tasks.denoise import add_noise, psnr
    import torch

    dncnn0, _ = build_models(cfg0)
    dncnn, _ = load_models(cfg, run.run_dir)
    test, _ = load_test_images(cfg)
    clean = torch.from_numpy(test[0])[None, None]
    noisy = add_noise(clean, 25.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float(psnr(dncnn(noisy), clean)) > float(psnr(dncnn0.eval()(noisy), clean)) + 2.0
    table = (run.run_dir / "table6.md").read_text()
    assert "DnCNN-stop" in table and "| 25 |" in table and "BM3D: off" in table
    assert (run.run_dir / "denoise_crops.png").stat().st_size > 1000


def test_resume_skips_finished_stages(trained, capsys):
    cfg, run = trained
    before = (run.run_dir / "models.pt").read_bytes()
    summary = train(cfg, run)
    assert [s["stage"] for s in summary["stages"]] == ["dncnn", "heads", "stage1", "stage2"]
    a, b = load_models(cfg, run.run_dir)
    import torch
    from learn2stop.utils.checkpoint import load_checkpoint

    old = load_checkpoint(run.run_dir / "models.pt")
    for k, v in b.state_dict().items():
        torch.testing.assert_close(v, old["stop"][k])
    assert len(before) > 0


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
    assert all(1 <= r["layers"] <= cfg.model.depth for r in recs.values())
    assert json.loads((tmp_path / "out" / "depths.json").read_text())[0]["of_layers"] == cfg.model.depth
    cfg.denoise.input = str(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="not found"):
        denoise_files(cfg, run)


def test_evaluate_without_training_or_with_another_model_fails_clearly(trained, tmp_path):
    cfg, run = trained
    with pytest.raises(CheckpointError, match="run the 'train' command first"):
        evaluate(cfg, RunContext(run_dir=tmp_path, progress=False))
    other = tiny_cfg(model={"channels": 6})
    with pytest.raises(ConfigError, match="model"):
        load_models(other, run.run_dir)


def test_cli_rejects_bad_values_and_missing_folders(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["denoise", "train", "--data.sigma_max", "-5", "--run-dir", str(tmp_path / "r")])
    assert "data.sigma_max" in capsys.readouterr().err
    rc = cli_main(["denoise", "train", "--no-progress", "--data.train_dir", str(tmp_path / "nowhere"),
                   "--run-dir", str(tmp_path / "r2")])
    assert rc == 2 and "image folder not found" in capsys.readouterr().err


def test_presets_resolve():
    for name, preset in PRESETS.items():
        cfg = resolve(DenoiseAppConfig, preset)
        assert cfg.model.depth >= 3
    paper = resolve(DenoiseAppConfig, PRESETS["paper"])
    assert (paper.model.depth, paper.model.channels, len(paper.model.positions)) == (20, 64, 18)
    assert paper.stage1.beta == 0.1 and paper.stage1.lr == 1e-4 and paper.data.patch_size == 50


def test_bm3d_baseline_when_installed():
    pytest.importorskip("bm3d")
    from learn2stop.tasks.denoise.bm3d_baseline import bm3d_denoise
    from learn2stop.tasks.denoise.data import synthetic_images
    import torch
    from learn2stop.tasks.denoise import psnr

    clean = synthetic_images(1, 32, seed=3)[0]
    noisy = clean + np.random.default_rng(0).normal(0, 25 / 255, clean.shape).astype(np.float32)
    out = bm3d_denoise(noisy, 25.0)
    t = lambda a: torch.from_numpy(np.asarray(a, np.float32))[None, None]
    assert float(psnr(t(out), t(clean))) > float(psnr(t(noisy), t(clean))) + 1.0


def test_validation_split_is_disjoint_from_training_and_test(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    for i in range(10):
        Image.fromarray(np.full((20, 20), 20 * i, dtype=np.uint8), mode="L").save(folder / f"{i}.png")
    from learn2stop.tasks.denoise.app import load_test_images, load_training_images

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

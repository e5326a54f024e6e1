"""Denoising data: folders and bad images, patch grids, augmentation, noise, PSNR, configs."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import shared_data
from learn2stop.tasks.denoise import ImageDataError, PatchBank, add_noise, augment, inverse_augment, load_image, psnr
from learn2stop.tasks.denoise.config import DataConfig, EvalConfig, DenoiseCommandConfig
from learn2stop.tasks.denoise.data import DenoiseTask, grid_count, sample_sigmas
from learn2stop.tasks.denoise.images import list_images, load_folder, synthetic_images
from learn2stop.utils.config import ConfigError


def write_png(path, arr, mode="L"):
    Image.fromarray(arr, mode=mode).save(path)
    return path


# ----------------------------------------------------------------------------- loading and bad inputs
def test_grey_png_round_trip(tmp_path):
    arr = (np.arange(35 * 21) % 256).astype(np.uint8).reshape(21, 35)
    img = load_image(write_png(tmp_path / "a.png", arr))
    assert img.shape == (21, 35) and img.dtype == np.float32
    np.testing.assert_allclose(img, arr / 255.0, atol=1e-6)


def test_colour_image_is_converted_with_a_warning(tmp_path):
    rgb = np.zeros((8, 9, 3), dtype=np.uint8)
    rgb[..., 0] = 255
    path = write_png(tmp_path / "c.png", rgb, mode="RGB")
    with pytest.warns(UserWarning, match="greyscale"):
        img = load_image(path)
    assert img.shape == (8, 9)
    np.testing.assert_allclose(img, round(0.299 * 255) / 255.0, atol=2 / 255)


def test_corrupt_missing_and_empty(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageDataError, match="cannot read image .*bad.png"):
        load_image(bad)
    with pytest.raises(ImageDataError, match="not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ImageDataError, match="not found"):
        list_images(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    with pytest.raises(ImageDataError, match="no images"):
        list_images(empty)


def test_image_smaller_than_patch_is_a_clear_error(tmp_path):
    write_png(tmp_path / "small.png", np.zeros((10, 30), dtype=np.uint8))
    with pytest.raises(ImageDataError, match="smaller than the 20x20 patch"):
        load_folder(tmp_path, min_size=20)
    with pytest.raises(ImageDataError, match="smaller than the 20x20 patch"):
        PatchBank([np.zeros((10, 30), np.float32)], patch_size=20, stride=5)


# ----------------------------------------------------------------------------- patches and augmentation
def test_patch_counts_over_scales_and_contents():
    rng = np.random.default_rng(0)
    img = rng.random((30, 24)).astype(np.float32)
    bank = PatchBank([img], patch_size=10, stride=5, scales=(1.0, 0.5, 0.3))
    # 1.0: 30x24 -> 5 x 3 = 15; 0.5: 15x12 -> 2 x 1 = 2; 0.3: 9x7 -> none
    assert grid_count(30, 24, 10, 5) == 15 and len(bank) == 15 + 2
    q = np.round(img * 255) / 255  # the bank stores uint8
    np.testing.assert_allclose(bank.patch(0), q[0:10, 0:10], atol=1e-6)
    np.testing.assert_allclose(bank.patch(4), q[5:15, 5:15], atol=1e-6)  # row 1, column 1 (3 columns)
    np.testing.assert_allclose(bank.patch(14), q[20:30, 10:20], atol=1e-6)
    assert bank.patch(15).shape == (10, 10)
    with pytest.raises(IndexError):
        bank.patch(17)


def test_sampled_patches_are_bounded_deterministic_and_augmented():
    bank = PatchBank(synthetic_images(3, 40, seed=1), patch_size=16, stride=8)
    a = bank.sample(64, torch.Generator().manual_seed(3))
    b = bank.sample(64, torch.Generator().manual_seed(3))
    assert a.shape == (64, 1, 16, 16) and torch.equal(a, b)
    assert a.min() >= 0 and a.max() <= 1
    # every sampled patch is one of the 8 symmetries of a bank patch
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(len(bank), (64,), generator=g)
    modes = torch.randint(8, (64,), generator=g)
    assert len(set(modes.tolist())) > 1
    for i in range(64):
        torch.testing.assert_close(inverse_augment(a[i, 0], int(modes[i])), torch.from_numpy(bank.patch(int(idx[i]))))


def test_augment_inverse_and_distinct_symmetries():
    x = torch.arange(5 * 7, dtype=torch.float32).reshape(1, 5, 7)
    for mode in range(8):
        torch.testing.assert_close(inverse_augment(augment(x, mode), mode), x)
    sq = torch.arange(16.0).reshape(4, 4)
    images = {tuple(augment(sq, m).flatten().tolist()) for m in range(8)}
    assert len(images) == 8
    with pytest.raises(ValueError):
        augment(x, 8)


# ----------------------------------------------------------------------------- noise and PSNR
def test_noise_levels_and_negative_sigma():
    clean = torch.full((2, 1, 64, 64), 0.5)
    noisy = add_noise(clean, torch.tensor([0.0, 25.5]), torch.Generator().manual_seed(0))
    assert torch.equal(noisy[0], clean[0])
    assert abs(float((noisy[1] - clean[1]).std()) - 0.1) < 0.01
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        add_noise(clean, -5.0, torch.Generator())
    s = sample_sigmas(1000, torch.Generator().manual_seed(0), 55.0)
    assert s.min() >= 0 and s.max() <= 55 and s.std() > 10
    assert set(sample_sigmas(100, torch.Generator(), sigma_set=(35, 45, 55)).tolist()) == {35.0, 45.0, 55.0}


def test_psnr_against_a_hand_computation():
    clean = torch.tensor([[0.0, 0.5], [1.0, 0.25]])[None, None]
    est = torch.tensor([[0.1, 0.5], [1.3, 0.25]])[None, None]  # 1.3 is clamped to 1
    mse = (0.1 ** 2) / 4
    assert float(psnr(est, clean)) == pytest.approx(10 * math.log10(1 / mse), rel=1e-6)
    assert float(psnr(est, clean, clamp=False)) == pytest.approx(10 * math.log10(4 / (0.01 + 0.09)), rel=1e-6)
    two = psnr(torch.cat([est, clean + 0.1]), torch.cat([clean, clean]))
    # second image: errors 0.1, 0.1, 0 (1.1 clamped to 1), 0.1
    assert two.shape == (2,) and float(two[1]) == pytest.approx(10 * math.log10(4 / 0.03), rel=1e-5)
    with pytest.raises(ValueError, match="shape"):
        psnr(est, clean[..., :1])


# ----------------------------------------------------------------------------- task and config
def test_task_batches_are_reproducible_and_validation_is_fixed():
    imgs = synthetic_images(4, 32, seed=0)
    task = DenoiseTask(imgs[:3], imgs[3:], patch_size=16, stride=8, val_patches=10, val_batch=4)
    a = task.sample_batch(8, torch.Generator().manual_seed(5), "cpu")
    b = task.sample_batch(8, torch.Generator().manual_seed(5), "cpu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], a[1])
    v = task.validation_batches("cpu")
    assert [n.shape[0] for n, _ in v] == [4, 4, 2]
    assert torch.equal(v[0][0], task.validation_batches("cpu")[0][0])
    with pytest.raises(ValueError, match=">= 0"):
        DenoiseTask(imgs[:3], imgs[3:], patch_size=16, sigma_max=-1)


@pytest.mark.parametrize("cls, kw, field", [
    (DataConfig, {"sigma_max": -1.0}, "data.sigma_max"),
    (DataConfig, {"sigma_set": (35.0, -5.0)}, "data.sigma_set"),
    (DataConfig, {"patch_size": 0}, "data.patch_size"),
    (DataConfig, {"val_fraction": 1.0}, "data.val_fraction"),
    (EvalConfig, {"sigmas": (-15.0,)}, "eval.sigmas"),
    (DenoiseCommandConfig, {"model": "bm3d"}, "denoise.model"),
])
def test_bad_config_values_name_the_field(cls, kw, field):
    with pytest.raises(ConfigError, match=field):
        cls(**kw)


def test_synthetic_images_are_deterministic_and_textured():
    a, b = synthetic_images(2, 48, seed=7), synthetic_images(2, 48, seed=7)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], a[1])
    assert a[0].shape == (48, 48) and 0 <= a[0].min() and a[0].max() <= 1 and a[0].std() > 0.1


def test_shared_denoising_data_loads():
    root = shared_data("denoising")
    bsd = list_images(root / "BSD68")
    train = list_images(root / "Train400")
    assert len(bsd) == 68 and len(train) == 400
    img = load_image(bsd[0])
    assert sorted(img.shape) == [321, 481]
    assert load_image(train[0]).shape == (180, 180)

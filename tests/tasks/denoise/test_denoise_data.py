"""Denoising data: patch grids, augmentation, noise, the training task's batches."""
import numpy as np
import pytest
import torch

from learn2stop.tasks.denoise import PatchBank, add_noise, augment, inverse_augment
from learn2stop.tasks.denoise.data import DenoiseTask, grid_count, sample_sigmas
from learn2stop.tasks.denoise.images import synthetic_images


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

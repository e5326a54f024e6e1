"""Denoising's metric: PSNR against a hand computation."""
import math

import pytest
import torch

from learn2stop.tasks.denoise import psnr


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

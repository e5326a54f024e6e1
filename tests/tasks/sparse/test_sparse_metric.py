"""Sparse recovery's metric: NMSE in dB as a ratio of sums."""
import numpy as np
import pytest
import torch

from learn2stop.tasks.sparse import nmse_db


def test_nmse_is_ratio_of_sums_in_db():
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    est = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert nmse_db(est, x) == pytest.approx(10 * np.log10((1 + 9) / (1 + 9)))
    est2 = x * 1.1
    assert nmse_db(est2, x) == pytest.approx(10 * np.log10(0.01))

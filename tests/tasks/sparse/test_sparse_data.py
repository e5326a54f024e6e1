"""Sparse recovery's data: the matrix, the problem generator and its fixed sets, and bad measurements."""
import pytest
import torch

from learn2stop.core import StoppingModel, unroll
from learn2stop.tasks.sparse import LISTA, ProblemConfig, fixed_set, make_matrix, nmse_db, sample_problems

SMALL = ProblemConfig(m=13, n=27, sparsity=0.2, test_per_snr=40, val_per_snr=30)


def test_matrix_has_unit_columns_and_condition_option():
    for kind in ("gaussian", "cond5"):
        A = make_matrix(ProblemConfig(m=40, n=80, matrix=kind))
        assert A.shape == (40, 80)
        torch.testing.assert_close(A.norm(dim=0), torch.ones(80))
    assert torch.equal(make_matrix(SMALL), make_matrix(SMALL))  # seeded


def test_problem_statistics_match_the_paper_recipe():
    cfg = ProblemConfig(m=50, n=100, sparsity=0.1, snrs=(20.0, 40.0))
    A = make_matrix(cfg)
    b = sample_problems(A, cfg, 4000, torch.Generator().manual_seed(0))
    assert abs((b.x != 0).float().mean().item() - 0.1) < 0.01
    assert set(b.snr.unique().tolist()) == {20.0, 40.0}
    noise = b.y - b.x @ A.T
    clean = b.x @ A.T
    ratio = (noise.std(1) / clean.std(1))[b.snr == 20.0].mean()
    assert abs(ratio.item() - 0.1) < 0.01  # std(noise) = std(Ax) 10^(-SNR/20)
    t = fixed_set(A, cfg, 7, seed=3)
    assert len(t) == 14 and t.snr.tolist() == [20.0] * 7 + [40.0] * 7
    torch.testing.assert_close(t.y, fixed_set(A, cfg, 7, seed=3).y)


def test_bad_measurements_get_clear_errors():
    lista = LISTA(make_matrix(SMALL), 4)
    with pytest.raises(ValueError, match="13 rows"):
        unroll(lista, torch.randn(3, 12))
    with pytest.raises(ValueError, match="NaN or inf"):  # checked once, at the API boundary (not in the hot loop)
        StoppingModel(lista).unroll(torch.full((3, 13), float("nan")))
    with pytest.raises(ValueError, match="NaN or inf"):
        StoppingModel(lista)(torch.full((3, 13), float("nan")))
    with pytest.raises(ValueError, match=r"batch-first, shape \(B, \.\.\.\); got shape \(13,\)"):
        unroll(lista, torch.randn(13))
    with pytest.raises(ValueError, match="does not match"):
        nmse_db(torch.zeros(2, 3), torch.zeros(2, 4))

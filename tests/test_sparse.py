"""Sparse recovery: problem generator, NMSE, LISTA/ISTA/FISTA, policy, pipeline, bad input."""
import json

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from learn2stop.core import StageConfig, StagedTrainer, StoppingModel, unroll, validation_scores
from learn2stop.tasks.sparse import (
    FISTA,
    ISTA,
    LISTA,
    ProblemConfig,
    SparseRecoveryTask,
    SparseStopPolicy,
    build_lista_stop,
    fixed_set,
    make_matrix,
    nmse_by_snr,
    nmse_db,
    preset,
    sample_problems,
)
from learn2stop.utils.config import ConfigError

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


def test_nmse_is_ratio_of_sums_in_db():
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    est = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert nmse_db(est, x) == pytest.approx(10 * np.log10((1 + 9) / (1 + 9)))
    est2 = x * 1.1
    assert nmse_db(est2, x) == pytest.approx(10 * np.log10(0.01))


def numpy_ista(A, y, L, rho, T):
    x = np.zeros((y.shape[0], A.shape[1]))
    for _ in range(T):
        v = x - (x @ A.T - y) @ A / L
        x = np.sign(v) * np.maximum(np.abs(v) - rho / L, 0)
    return x


def numpy_fista(A, y, L, rho, T):
    x = z = np.zeros((y.shape[0], A.shape[1]))
    s = 1.0
    for _ in range(T):
        v = z - (z @ A.T - y) @ A / L
        x_new = np.sign(v) * np.maximum(np.abs(v) - rho / L, 0)
        s_new = (1 + np.sqrt(1 + 4 * s * s)) / 2
        z = x_new + (s - 1) / s_new * (x_new - x)
        x, s = x_new, s_new
    return z


def test_ista_fista_and_lista_init_match_reference():
    A = make_matrix(SMALL).double()
    b = sample_problems(A.float(), SMALL, 9, torch.Generator().manual_seed(0))
    y = b.y.double()
    ref = numpy_ista(A.numpy(), y.numpy(), 3.0, 0.1, 7)
    np.testing.assert_allclose(unroll(ISTA(A, 7, 3.0, 0.1), y).outputs.numpy(), ref, atol=1e-10)
    np.testing.assert_allclose(unroll(FISTA(A, 7, 3.0, 0.1), y).outputs.numpy(), numpy_fista(A.numpy(), y.numpy(), 3.0, 0.1, 7), atol=1e-10)
    lista = LISTA(A, 7, L=3.0, rho=0.1).double()  # ISTA initialisation: identical iterates
    np.testing.assert_allclose(unroll(lista, y).outputs.detach().numpy(), ref, atol=1e-10)


def test_lista_thresholds_are_untied():
    lista = LISTA(make_matrix(SMALL), 5)
    lista.theta.grad = None
    loss = unroll(lista, torch.randn(4, 13)).outputs.abs().sum() + 0 * lista.theta.sum()
    loss.backward()
    assert lista.W_x.shape == (5, 27, 27) and lista.W_b.shape == (5, 27, 13) and lista.theta.shape == (5,)
    with torch.no_grad():
        lista.theta[0] += 1.0
    assert lista.theta[1] != lista.theta[0]


@pytest.mark.parametrize("features", ["sketch", "full"])
def test_policy_shapes_and_min_step_survives_checkpoint(features):
    A = make_matrix(SMALL)
    p = SparseStopPolicy(A, 5, features=features, sketch_dim=4)
    out = p(torch.randn(6, 13), torch.randn(6, 27), 2)
    assert out.shape == (6,)
    p.min_step = 3
    q = SparseStopPolicy(A, 5, features=features, sketch_dim=4)
    q.load_state_dict(p.state_dict())
    assert q.min_step == 3


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


@pytest.mark.parametrize("over, field", [
    ({"stage1": {"beta": 0.0}}, "stage1.beta"),
    ({"lista": {"num_steps": 0}}, "lista.num_steps"),
    ({"problem": {"sparsity": 1.5}}, "problem.sparsity"),
    ({"problem": {"matrix": "ortho"}}, "problem.matrix"),
    ({"stage2": {"objective": "stage1"}}, "stage2.objective"),  # a changed objective takes its own variant
    ({"stage3": {"objective": "aevb"}}, "stage3.objective"),
    ({"lista": {"bogus": 1}}, "lista.bogus"),
])
def test_bad_config_values_name_the_field(over, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        preset("quick", **over)
    with pytest.raises(KeyError, match="unknown sparse preset"):
        preset("huge")


def test_two_stage_training_beats_deep_supervision_baseline_on_tiny_problem(tmp_path):
    """A short run: Stage I lowers the oracle error below the start; Stage II's early exit
    recovers most of it; both are better than the untrained ISTA initialisation."""
    cfg = preset("quick", problem={"m": 13, "n": 27, "sparsity": 0.2, "val_per_snr": 40},
                 lista={"num_steps": 6})
    task = SparseRecoveryTask(cfg.problem)
    sm = build_lista_stop(cfg, task)
    before = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    tr = StagedTrainer(sm, task, tmp_path, progress=False)
    tr.fit("stage1", StageConfig(objective="stage1", beta=0.05, iterations=150, batch_size=64, lr=3e-3, eval_every=50))
    tr.fit("stage2", StageConfig(objective="stage2", beta=0.05, iterations=150, batch_size=64, lr=3e-3, eval_every=50))
    after = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    assert after["oracle"] < 0.7 * before["oracle"]
    assert after["policy"] < 0.8 * before["last"]
    assert after["oracle"] <= after["policy"]


def test_the_depth_planner_features_are_the_documented_statistics():
    """The planner's few-operation features equal their written-out definitions, and its functional head (ReLU)
    equals the modules' own forward, at inference and in training."""
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner

    g = torch.Generator().manual_seed(0)
    A = torch.randn(12, 20, generator=g) / 4
    y = torch.randn(5, 12, generator=g)
    x = torch.randn(5, 20, generator=g) * (torch.rand(5, 20, generator=g) < 0.3)
    support = (x != 0).float().mean(1, keepdim=True)

    norms = SparseDepthPlanner(A, num_steps=6, hidden=(16,))  # no product with A
    assert "A" not in norms.state_dict() and isinstance(norms.net[1], torch.nn.ReLU)
    expected = torch.cat([torch.log(torch.stack([x.abs().sum(1), x.norm(dim=1), y.norm(dim=1)], 1) + 1e-6), support], 1)
    torch.testing.assert_close(norms.extract(y, x), expected)
    norms.train()
    torch.testing.assert_close(norms.plan_log_q(y, x, 1), torch.log_softmax(norms.net(norms.plan_norm(expected)), 1))
    assert norms.plan_norm.num_batches_tracked == 2  # training gathers the batch statistics ...
    norms.eval()
    standard = (expected - norms.plan_norm.running_mean) / (norms.plan_norm.running_var + norms.plan_norm.eps).sqrt()
    torch.testing.assert_close(norms.plan_log_q(y, x, 1), torch.log_softmax(norms.net(standard), 1))  # ... and uses them


def test_support_size_counts_exactly_what_count_nonzero_counts():
    """The planners' support statistic: the exact nonzero count per row, in the input's dtype; a negative zero and a
    subnormal value count as what they are (zero, nonzero)."""
    from learn2stop.tasks.sparse.policy import support_size

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * (torch.rand(64, 300, generator=g) < 0.2)
    x[0, :3] = torch.tensor([-0.0, 1e-40, -1e-40])
    for dtype in (torch.float32, torch.float64):
        got = support_size(x.to(dtype))
        assert got.dtype == dtype and got.shape == (64,)
        assert torch.equal(got, torch.count_nonzero(x, dim=1).to(dtype))
        assert torch.equal(support_size(x.to(dtype), x.to(dtype).abs()), got)  # from |x|, where the caller has it
    assert support_size(x)[0] == int((x[0] != 0).sum()) and x[0, 0] == 0 and x[0, 1] != 0

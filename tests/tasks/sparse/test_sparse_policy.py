"""Sparse recovery's policies: shapes, the planner's features, the support statistic."""
import pytest
import torch

from learn2stop.tasks.sparse import ProblemConfig, SparseStopPolicy, make_matrix

SMALL = ProblemConfig(m=13, n=27, sparsity=0.2, test_per_snr=40, val_per_snr=30)


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

"""The sparse planner's numpy plans (small batches on a CPU, at inference): the same stop steps as its torch plans,
made again when a weight changes, and left to torch where they do not apply."""
import numpy as np
import pytest
import torch

from learn2stop.core import SignalRule, run_with_early_exit, unroll
from learn2stop.core.stop_rule import StepView
from learn2stop.core.policy_signals import PriceSignal
from learn2stop.core.signal_registry import make_signal
from learn2stop.tasks.sparse import LISTA
from learn2stop.core.fastpath import NUMPY_MAX_BATCH, torch_only
from learn2stop.tasks.sparse.numpy_plan import _state_norms_np
from learn2stop.tasks.sparse.policy import SparseDepthPlanner, _state_norms

T, S1, S2 = 12, 3, 7


def _planner(seed=0):
    """A planner with both heads, its standardisation gathered from a few training batches of sparse states."""
    torch.manual_seed(seed)  # the heads' initial weights
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(10, 20, generator=g) / 10 ** 0.5
    planner = SparseDepthPlanner(A, T, hidden=(16, 16), replan=True)
    planner.min_step, planner.replan_step = S1, S2
    with torch.no_grad():
        for _ in range(3):
            y, x, prev = _states(64, g)
            planner.plan_log_q(y, x, S1)
            planner.replan_log_q(y, x, prev, S2)
    return A, planner.eval()


def _states(batch, g):
    y = torch.randn(batch, 10, generator=g) * torch.rand(batch, 1, generator=g) * 3
    x = torch.randn(batch, 20, generator=g) * (torch.rand(batch, 20, generator=g) < 0.4)
    return y, x, x * (0.5 + torch.rand(batch, 1, generator=g))


def _both(planner, y, x, prev, threshold):
    """(numpy, torch) stop steps of the price rule's first and second plans."""
    rule = SignalRule(make_signal("price", planner), threshold)
    first, second = StepView(S1, T, y, x, None, x, torch.arange(len(y))), StepView(S2, T, y, x, prev, x, torch.arange(len(y)))
    with torch.no_grad():
        fast = (rule.plan(first), rule.replan(second))
        with torch_only():
            slow = (rule.plan(first), rule.replan(second))
    return fast, slow


@pytest.mark.parametrize("batch", [1, 5])
def test_numpy_plans_stop_where_the_torch_plans_do(batch):
    _, planner = _planner()
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(10):
        y, x, prev = _states(batch, g)
        with torch.no_grad():
            assert planner.priced_plan(y, x, S1, 0.0) is not None and planner.priced_replan(y, x, prev, S2, 0.0) is not None
            np.testing.assert_allclose(_state_norms_np(y.numpy(), x.numpy(), prev.numpy()),
                                       _state_norms(y, x, prev).numpy(), rtol=1e-5, atol=1e-6)
        for price in (-3.0, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 30.0):
            fast, slow = _both(planner, y, x, prev, PriceSignal.from_param(price))
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
            assert fast[0].dtype == torch.long and fast[0].shape == (batch,)
            assert (fast[0] >= S1).all() and (fast[1] >= S2).all()
            seen.update(fast[0].tolist())
    assert len(seen) >= 3  # the prices spread the plans over the steps
    fast, slow = _both(planner, y, x, prev, PriceSignal.asked_never)  # the largest price: depth T, no overflow
    assert all((a == T).all() for a in (*fast, *slow))
    fast, slow = _both(planner, y, x, prev, -float("inf"))  # an infinite price: stop at the plan step, in both forms
    assert (fast[0] == S1).all() and (fast[1] == S2).all() and torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_single_samples_stop_where_their_batch_does():
    """One rollout per sample (numpy plans) against the whole batch at once (torch plans, past NUMPY_MAX_BATCH)."""
    A, planner = _planner()
    lista = LISTA(A, T).eval()
    y = _states(3 * NUMPY_MAX_BATCH, torch.Generator().manual_seed(2))[0]
    rule = SignalRule.from_param(make_signal("price", planner), 1.0)
    with torch.no_grad():
        batch = run_with_early_exit(lista, y, rule)
        one = torch.cat([run_with_early_exit(lista, y[i:i + 1], rule).stop_times for i in range(len(y))])
    assert torch.equal(one, batch.stop_times) and len(set(one.tolist())) > 2
    with torch.no_grad():  # each output is its own step's (the batch was sorted twice, the state gathered once)
        steps = torch.stack(unroll(lista, y, keep_outputs=True).step_outputs, 1)
    torch.testing.assert_close(batch.outputs, steps[torch.arange(len(y)), one - 1])


def test_a_changed_weight_or_load_makes_a_new_copy():
    _, planner = _planner()
    _, other = _planner(seed=5)
    y, x, prev = _states(4, torch.Generator().manual_seed(3))
    th = PriceSignal.from_param(1.0)
    with torch.no_grad():
        planner.priced_plan(y, x, S1, th)
        copy = planner._numpy._made["plan"][2]
        planner.priced_plan(y, x, S1, th)
        assert planner._numpy._made["plan"][2] is copy  # kept while nothing changes
        planner.net[0].bias.add_(5.0)
        planner.priced_plan(y, x, S1, th)
        assert planner._numpy._made["plan"][2] is not copy
    fast, slow = _both(planner, y, x, prev, th)
    assert torch.equal(fast[0], slow[0])
    planner.load_state_dict(other.state_dict())
    fast, slow = _both(planner, y, x, prev, th)
    theirs, _ = _both(other, y, x, prev, th)
    assert all(map(torch.equal, fast, theirs)) and all(map(torch.equal, fast, slow))


def test_torch_plans_where_numpy_does_not_apply():
    A, planner = _planner()
    y, x, prev = _states(NUMPY_MAX_BATCH + 1, torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert planner.priced_plan(y, x, S1, 0.0) is None  # a large batch
        assert planner.priced_plan(y[:2].double(), x[:2].double(), S1, 0.0) is None
        assert planner.priced_replan(y[:2], x[:2], prev[:2], S2 + 1, 0.0) is None  # not its step: torch says so
        planner.train()
        assert planner.priced_plan(y[:2], x[:2], S1, 0.0) is None
        planner.eval()
    assert planner.priced_plan(y[:2], x[:2], S1, 0.0) is None  # gradients on
    with torch.inference_mode():  # weights made under inference_mode keep no version to check a copy against
        made = SparseDepthPlanner(A, T, hidden=(8,)).eval()
        assert made.priced_plan(y[:2], x[:2], 1, 0.0) is None
        assert SignalRule(make_signal("price", made), 0.0).plan(StepView(1, T, y[:2], x[:2], None, x[:2], torch.arange(2))).shape == (2,)


def test_a_nan_state_is_a_clear_error():
    _, planner = _planner()
    y, x, _ = _states(1, torch.Generator().manual_seed(5))
    x[0, 0] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="NaN or inf"):
        planner.priced_plan(y, x, S1, 0.0)

"""The sparse planner's price-rule plans: a sample stops where it stops inside its batch, and each output is its
own step's."""
import torch

from learn2stop.core import SignalRule, run_with_early_exit, unroll
from learn2stop.core.signal_registry import make_signal
from learn2stop.tasks.sparse import LISTA
from learn2stop.tasks.sparse.policy import SparseDepthPlanner

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


def test_single_samples_stop_where_their_batch_does():
    """One rollout per sample against the whole batch at once: the price rule's plans stop each sample at the same step."""
    A, planner = _planner()
    lista = LISTA(A, T).eval()
    y = _states(48, torch.Generator().manual_seed(2))[0]
    rule = SignalRule.from_param(make_signal("price", planner), 1.0)
    with torch.no_grad():
        batch = run_with_early_exit(lista, y, rule)
        one = torch.cat([run_with_early_exit(lista, y[i:i + 1], rule).stop_times for i in range(len(y))])
    assert torch.equal(one, batch.stop_times) and len(set(one.tolist())) > 2
    with torch.no_grad():  # each output is its own step's (the batch was sorted twice, the state gathered once)
        steps = torch.stack(unroll(lista, y, keep_outputs=True).step_outputs, 1)
    torch.testing.assert_close(batch.outputs, steps[torch.arange(len(y)), one - 1])

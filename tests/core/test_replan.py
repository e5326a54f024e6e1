"""A plan revised once: the combined q_phi, the loop's second plan, its offline trace, Stage II, and the refusals."""
import pytest
import torch
from torch import nn

from conftest import ToyStepModel, ToyTask, oracle_kl
from learn2stop.core import (InferenceConfig, SignalRule, StoppingModel, first_crossing, log_stop_time_distribution, run_with_early_exit,
                             signal_trace, unroll)
from learn2stop.core.distributions import log_oracle_distribution, replanned_log_q, stop_logits_from_distribution
from learn2stop.core.policy_signals import PriceSignal
from learn2stop.core.signal_registry import make_signal


class Replanner(nn.Module):
    """Plans at ``plan_step`` from the output, and again at ``replan_step`` from the output and the one before."""

    def __init__(self, T, plan_step, replan_step):
        super().__init__()
        self.T, self.plan_step, self.replan_step = T, plan_step, replan_step
        self.first, self.second = nn.Linear(5, T), nn.Linear(10, T)
        self.asked = []

    def plan_log_q(self, y, x, t):
        self.asked.append(("plan", t, x.shape[0]))
        return torch.log_softmax(self.first(x), dim=1)

    def forward(self, y, x, t):
        return stop_logits_from_distribution(self.plan_log_q(y, x, t))

    def replan_log_q(self, y, x, previous, t):
        self.asked.append(("replan", t, x.shape[0]))
        return torch.log_softmax(self.second(torch.cat([x, x - previous], dim=1)), dim=1)


def _spread(planner):
    with torch.no_grad():
        planner.first.weight.mul_(6)
        planner.second.weight.mul_(6)
    return planner


def test_replanned_q_keeps_the_first_plan_before_the_second_and_sums_to_one():
    torch.manual_seed(0)
    T, s = 7, 4
    log_q1, log_q2 = torch.log_softmax(torch.randn(5, T), 1), torch.randn(5, T)
    q = replanned_log_q(log_q1, log_q2, s).exp()
    torch.testing.assert_close(q.sum(1), torch.ones(5))
    torch.testing.assert_close(q[:, :s - 1], log_q1.exp()[:, :s - 1])
    late = log_q1.exp()[:, s - 1:].sum(1, keepdim=True)
    torch.testing.assert_close(q[:, s - 1:], late * torch.softmax(log_q2[:, s - 1:], 1))
    with pytest.raises(ValueError, match="replan_step must be an integer in 2..7"):
        replanned_log_q(log_q1, log_q2, 1)


def test_forward_kl_to_the_oracle_splits_into_the_first_plan_and_the_second():
    """KL(q* || q) = KL over {t < s each, t >= s} + q*(>= s) KL(q*(. | >= s) || q2): Stage II's forward KL on the
    combined q_phi fits the second head to the oracle conditioned on the late steps."""
    torch.manual_seed(1)
    T, s = 6, 3
    log_p = log_oracle_distribution(torch.rand(4, T) * 3, 0.4)
    log_q1, log_q2 = torch.log_softmax(torch.randn(4, T), 1), torch.log_softmax(torch.randn(4, T), 1)
    log_q = replanned_log_q(log_q1, log_q2, s)
    kl = (log_p.exp() * (log_p - log_q)).sum(1)
    p, k = log_p.exp(), s - 1
    p_late, q1_late = p[:, k:].sum(1), log_q1.exp()[:, k:].sum(1)
    coarse = (p[:, :k] * (log_p[:, :k] - log_q1[:, :k])).sum(1) + p_late * (p_late.log() - q1_late.log())
    cond_p, cond_q2 = torch.log_softmax(log_p[:, k:], 1), torch.log_softmax(log_q2[:, k:], 1)
    fine = p_late * (cond_p.exp() * (cond_p - cond_q2)).sum(1)
    torch.testing.assert_close(kl, coarse + fine)


@pytest.mark.parametrize("batch", [1, 3, 50])
def test_the_loop_plans_twice_and_stops_where_the_trace_says(batch):
    """Online: asked at the plan step for every sample, at the second plan's step only for those still running;
    stop times equal the first crossing of the revised scores offline, and each output is the full rollout's at
    its stop time."""
    torch.manual_seed(2)
    T, s1, s2 = 8, 2, 5
    model, planner = ToyStepModel(num_steps=T), _spread(Replanner(T, s1, s2))
    y = torch.randn(batch, 3)
    with torch.no_grad():
        full = unroll(model, y, keep_outputs=True)
        trace = signal_trace(PriceSignal(planner), full.step_outputs, y)
    depths = set()
    for price in (-1.0, 0.0, 0.7, 2.0, 6.0, 25.0):
        planner.asked = []
        with torch.no_grad():
            r = run_with_early_exit(model, y, SignalRule.from_param(make_signal("price", planner), price))
        expected = first_crossing(trace, PriceSignal.from_param(price))
        assert torch.equal(r.stop_times, expected)
        steps = torch.stack(full.step_outputs, 1)[torch.arange(batch), expected - 1]
        torch.testing.assert_close(r.outputs, steps)
        kinds = [a[:2] for a in planner.asked]
        assert kinds[0] == ("plan", s1) and planner.asked[0][2] == batch
        assert kinds[1:] in ([], [("replan", s2)])
        if (expected > s2).any():  # a sample past s2 was planned past it first, so planned again
            assert len(kinds) == 2 and planner.asked[1][2] <= int((expected >= s2).sum())
        depths.add(float(expected.float().mean()))
        with torch.no_grad():  # validation's reading: the full rollout's two plans, no second policy call
            full_plans = unroll(model, y, policy=planner)
        assert torch.equal(InferenceConfig(rule="price", param=price).stop_times(full_plans), expected)
    assert len(depths) > 2 or batch == 1


def test_the_revised_scores_are_the_combined_rule():
    """Offline, for every price: stop at the first plan's re-priced argmax if it is by s2, else at the second's."""
    torch.manual_seed(3)
    T, s1, s2 = 9, 2, 6
    model, planner = ToyStepModel(num_steps=T), _spread(Replanner(T, s1, s2))
    y = torch.randn(200, 3)
    with torch.no_grad():
        full = unroll(model, y, keep_outputs=True)
        trace = signal_trace(PriceSignal(planner), full.step_outputs, y)
        log_q1 = planner.plan_log_q(y, full.step_outputs[s1 - 1], s1)
        log_q2 = planner.replan_log_q(y, full.step_outputs[s2 - 1], full.step_outputs[s2 - 2], s2)
    c = torch.arange(1, T + 1) / T
    for price in (0.0, 1.0, 3.0, 10.0):
        t1 = (log_q1[:, s1 - 1:] - price * c[s1 - 1:]).argmax(1) + s1
        t2 = (log_q2[:, s2 - 1:] - price * c[s2 - 1:]).argmax(1) + s2
        assert torch.equal(first_crossing(trace, PriceSignal.from_param(price)), torch.where(t1 <= s2, t1, t2))


def test_unroll_returns_both_plans_and_stage2_trains_each_on_its_oracle():
    """The full rollout gives the first plan's stop logits and the second plan; Stage II's extra term is the second
    plan's KL to the oracle conditioned on the late steps, weighted by their mass, and trains the second head."""
    from learn2stop.core.losses import stage2_replan_forward_kl
    from learn2stop.core.objectives import OBJECTIVES, StageConfig

    torch.manual_seed(4)
    T, s1, s2 = 6, 2, 4
    model, planner = ToyStepModel(num_steps=T), Replanner(T, s1, s2)
    y = torch.randn(16, 3)
    r = unroll(model, y, policy=planner, keep_outputs=True)
    with torch.no_grad():
        log_q1 = planner.plan_log_q(y, r.step_outputs[s1 - 1], s1)
        log_q2 = planner.replan_log_q(y, r.step_outputs[s2 - 1], r.step_outputs[s2 - 2], s2)
    torch.testing.assert_close(log_stop_time_distribution(r.stop_logits)[:, s1 - 1:],
                               torch.log_softmax(log_q1[:, s1 - 1:], 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.replan_log_q[:, s2 - 1:], torch.log_softmax(log_q2[:, s2 - 1:], 1))
    losses = torch.rand(16, T) * 2
    log_p = log_oracle_distribution(losses, 0.3)
    p_late = log_p.exp()[:, s2 - 1:].sum(1)
    cond = torch.log_softmax(log_p[:, s2 - 1:], 1)
    expected = (p_late * (cond.exp() * (cond - r.replan_log_q[:, s2 - 1:])).sum(1)).mean()
    torch.testing.assert_close(stage2_replan_forward_kl(r.replan_log_q, losses, 0.3, s2), expected)
    task = ToyTask()
    loss, _ = OBJECTIVES.get("stage2")(StoppingModel(model, planner), *task.sample_batch(16, torch.Generator(), "cpu"),
                                       task.loss_fn, StageConfig(objective="stage2", beta=0.3), None)
    loss.backward()
    assert planner.first.weight.grad.abs().sum() > 0 and planner.second.weight.grad.abs().sum() > 0


def test_stage2_fits_a_replanning_policy(tmp_path):
    """Stage II on the toy task lowers the forward KL of the two plans combined to the oracle."""
    from learn2stop.core import InferenceConfig, StageConfig, StagedTrainer

    torch.manual_seed(5)
    price = InferenceConfig(rule="price", param=0.0)  # validation reads the second plan through the price rule
    T = 5
    model, planner = ToyStepModel(num_steps=T), Replanner(T, 1, 3)
    sm, task = StoppingModel(model, planner), ToyTask()
    StagedTrainer(sm, task, tmp_path, progress=False, inference=price).fit(
        "stage1", StageConfig(objective="stage1", iterations=120, batch_size=32, lr=1e-2, beta=0.1, eval_every=60))

    before = oracle_kl(sm, task, 0.1)
    StagedTrainer(sm, task, tmp_path, progress=False, inference=price).fit(
        "stage2", StageConfig(objective="stage2", iterations=80, batch_size=32, lr=3e-2, beta=0.1, eval_every=40))
    assert oracle_kl(sm, task, 0.1) < 0.7 * before


def test_one_plan_rules_refuse_a_second_plan():
    from learn2stop.core.inference import policy_rules
    from learn2stop.export.graphs import ExportError, _schedule

    T = 6
    model, planner = ToyStepModel(num_steps=T), Replanner(T, 2, 4)
    assert policy_rules(planner) == ("price",)
    for name in ("threshold", "quantile"):
        with pytest.raises(ValueError, match=f"the '{name}' rule reads one plan.*use the price rule"):
            make_signal(name, planner)
    with pytest.raises(ExportError, match="rule 'quantile' reads one plan, and this policy plans again at step 4"):
        _schedule({"name": "quantile", "param": 0.5, "never_stops_early": False}, planner, T)
    assert _schedule({"name": "price", "param": 1.0, "never_stops_early": False}, planner, T)["replan"] == 4
    late = Replanner(T, 2, 2)
    with pytest.raises(ValueError, match=r"replan_step must be an integer after the plan step \(2\)"):
        run_with_early_exit(model, torch.randn(3, 3), SignalRule.from_param(make_signal("price", late), 1.0))


class SplitPlanner(nn.Module):
    """First plan: step s2 for inputs with y_0 > 0, else T; second plan: step s2 + 1 if y_1 > 0, else T."""

    def __init__(self, T, s1, s2):
        super().__init__()
        self.T, self.plan_step, self.replan_step = T, s1, s2

    def _one_hot(self, where, a, b):
        log_q = torch.full((where.shape[0], self.T), -30.0)
        log_q[where, a - 1] = 0.0
        log_q[~where, b - 1] = 0.0
        return log_q

    def plan_log_q(self, y, x, t):
        return self._one_hot(y[:, 0] > 0, self.replan_step, self.T)

    def forward(self, y, x, t):
        return stop_logits_from_distribution(self.plan_log_q(y, x, t))

    def replan_log_q(self, y, x, previous, t):
        assert x.shape == previous.shape == (y.shape[0], x.shape[1])
        return self._one_hot(y[:, 1] > 0, self.replan_step + 1, self.T)


@pytest.mark.parametrize("batch", [1, 2, 40])
def test_samples_stopping_at_the_second_plans_step_leave_before_it(batch):
    """Rows whose first plan ends at s2 stop there, and the second plan sees only the others, each with its own
    previous output (the rows kept in step)."""
    torch.manual_seed(7)
    T, s1, s2 = 7, 2, 4
    model, planner = ToyStepModel(num_steps=T), SplitPlanner(T, s1, s2)
    y = torch.randn(batch, 3)
    with torch.no_grad():
        r = run_with_early_exit(model, y, SignalRule.from_param(make_signal("price", planner), 0.0))
        full = unroll(model, y, keep_outputs=True)
    expected = torch.where(y[:, 0] > 0, s2, torch.where(y[:, 1] > 0, s2 + 1, T))
    assert torch.equal(r.stop_times, expected)
    assert torch.equal(first_crossing(signal_trace(PriceSignal(planner), full.step_outputs, y), 0.0), expected)
    torch.testing.assert_close(r.outputs, torch.stack(full.step_outputs, 1)[torch.arange(batch), expected - 1])


def test_sparse_config_refuses_a_second_plan_it_cannot_make():
    from learn2stop.tasks.sparse.config import preset
    from learn2stop.utils.config import ConfigError

    with pytest.raises(ConfigError, match=r"replan_mass: must be in \[0, 1\)"):
        preset("quick", policy={"replan_mass": 1.0})
    with pytest.raises(ConfigError, match="it needs features 'plan'"):
        preset("quick", policy={"replan_mass": 0.3, "features": "sketch"})
    with pytest.raises(ConfigError, match="read by the price rule; inference.rule is 'quantile'"):
        preset("quick", policy={"replan_mass": 0.3}, inference={"rule": "quantile", "param": 0.5})
    with pytest.raises(ConfigError, match="inference.sampled samples one plan"):
        preset("quick", inference={"sampled": True})
    assert preset("quick", policy={"replan_mass": 0.0}, inference={"rule": "quantile", "param": 0.5})
    for rule, param in (("tolerance", 0.01), ("fixed", 12)):  # rules that read no policy work beside a second plan
        assert preset("quick", inference={"rule": rule, "param": param}).inference.rule == rule


def test_the_sparse_planners_second_head_reads_the_last_move():
    """Its inputs are the documented statistics of x_s2 and the move from x_(s2-1), with no product with A; its
    step travels in the checkpoint; one plan keeps the state dict of before (old checkpoints load)."""
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner

    torch.manual_seed(8)
    A = torch.randn(6, 12)
    planner = SparseDepthPlanner(A, 8, hidden=(5,), replan=True)
    assert planner.replan_step is None  # one plan until a step is set (by the pipeline, from the oracle)
    planner.replan_step = 5
    y, x = torch.randn(4, 6), torch.randn(4, 12) * (torch.rand(4, 12) < 0.5)
    prev = x * 0.9
    f = planner.extract_late(y, x, prev)
    size, move = x.norm(dim=1), (x - prev).norm(dim=1)
    expected = torch.stack([(x.abs().sum(1) + 1e-6).log(), (size + 1e-6).log(), (y.norm(dim=1) + 1e-6).log(),
                            (move + 1e-6).log(), (move / (size + 1e-6) + 1e-6).log(), (x != 0).float().mean(1)], 1)
    torch.testing.assert_close(f, expected)
    planner.eval()
    assert planner.replan_log_q(y, x, prev, 5).shape == (4, 8)
    with pytest.raises(ValueError, match="plans again only at its replan_step"):
        planner.replan_log_q(y, x, prev, 6)
    again = SparseDepthPlanner(A, 8, hidden=(5,), replan=True)
    again.load_state_dict(planner.state_dict())
    assert again.replan_step == 5
    with pytest.raises(ValueError, match="has no second head"):
        SparseDepthPlanner(A, 8, hidden=(5,)).load_state_dict(planner.state_dict(), strict=False)
    assert set(SparseDepthPlanner(A, 8).state_dict()) == {  # one plan: no second head, and no copy of A
        "_extra_state", "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias",
        "plan_norm.running_mean", "plan_norm.running_var", "plan_norm.num_batches_tracked"}


@pytest.mark.parametrize("price", [-1.0, 0.0, 1.0])
def test_the_exported_second_plan_stops_where_torch_does(tmp_path, price):
    """ONNX Runtime runs the second plan's graph (with the previous output as its input) and stops every row at
    the step the torch loop does, with the same outputs."""
    pytest.importorskip("onnxruntime")
    from learn2stop.core import StoppingModel
    from learn2stop.export import export_stop_model
    from learn2stop.runtime import load
    from learn2stop.tasks.sparse.models import LISTA
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner

    torch.manual_seed(0)
    A = torch.randn(20, 40) / 20 ** 0.5
    planner = SparseDepthPlanner(A, 8, hidden=(8,), replan=True)
    planner.min_step, planner.replan_step = 2, 5
    with torch.no_grad():
        for p in planner.parameters():
            p.mul_(5)  # plans that spread over the steps
    sm = StoppingModel(LISTA(A, 8), planner).eval()
    y = torch.randn(64, 20)
    with torch.no_grad():
        ref = run_with_early_exit(sm.model, y, SignalRule.from_param(make_signal("price", planner), price))
    assert (ref.stop_times > 5).any()  # the second plan decides some rows
    out = export_stop_model(sm, {"name": "price", "param": price}, y[:2], tmp_path / "ex", task="sparse")
    got = load(out).run(y.numpy())
    assert (got.stop_times == ref.stop_times.numpy()).all()
    assert abs(got.outputs - ref.outputs.numpy()).max() < 1e-5


def test_the_streaming_runner_plans_again_where_the_loop_does():
    """Requests arriving one by one, served in refilled per-step batches, stop where the batch loop stops them."""
    from learn2stop.core.streaming import StreamingRunner

    torch.manual_seed(2)
    T = 8
    model, planner = ToyStepModel(num_steps=T), _spread(Replanner(T, 2, 5))
    y = torch.randn(40, 3)
    rule = lambda: SignalRule.from_param(make_signal("price", planner), 0.7)  # noqa: E731
    with torch.no_grad():
        ref = run_with_early_exit(model, y, rule())
    assert (ref.stop_times > 5).any() and (ref.stop_times < 5).any()
    runner = StreamingRunner(model, rule(), max_batch=7)
    ids = [runner.submit(y[i:i + 1]) for i in range(len(y))]
    runner.run_until_idle()
    assert [runner.finished[i].stop_time for i in ids] == ref.stop_times.tolist()

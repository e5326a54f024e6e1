"""Stopping that pays: the price on computation, stop rules, calibration, risk control, frontier."""
import json
import math

import pytest
import torch
from torch import nn

from learn2stop.core import (ConfidenceSignal, EntropySignal, InferenceConfig, MethodConfig, PatienceSignal,
                             PolicySignal, QuantileSignal, SignalRule, StageConfig, StagedTrainer, StoppingModel,
                             ToleranceSignal, calibrate_budget, calibrate_risk, exit_costs, first_crossing,
                             log_cost_prior, log_oracle_distribution, run_with_early_exit,
                             signal_trace, unroll, validation_scores)
from learn2stop.core.calibration import mean_cost_curve
from learn2stop.core.inference import policy_scores
from learn2stop.utils.config import ConfigError


class Toy(nn.Module):
    """x_t = tanh(W_t x_{t-1} + U y); readout: 5-class logits."""

    def __init__(self, d=6, T=7, costs=None):
        super().__init__()
        self.num_steps = T
        self.W = nn.ModuleList(nn.Linear(d, d) for _ in range(T))
        self.U = nn.Linear(d, d)
        self.head = nn.Linear(d, 5)
        if costs is not None:
            self.exit_costs = costs

    def initial_state(self, y):
        return torch.zeros_like(y)

    def step(self, t, x, y):
        return torch.tanh(self.W[t - 1](x) + self.U(y))

    def readout(self, t, x, y):
        return self.head(x)


class Pol(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.net = nn.Linear(d + 1, 1)

    def forward(self, y, out, t):
        return 2 * self.net(torch.cat([out, out.new_full((out.shape[0], 1), t / 7)], 1)).squeeze(1)


@pytest.fixture
def sm():
    torch.manual_seed(0)
    return StoppingModel(Toy(), Pol()).eval()


def log_cost_oracle_distribution(losses, beta, costs, price):
    """log q*(t) proportional to exp(-(loss_t + price * c_t) / beta), written out directly."""
    return torch.log_softmax(-(losses + price * costs) / beta, dim=1)


def test_cost_aware_oracle_equals_the_prior_form():
    g = torch.Generator().manual_seed(1)
    losses = torch.rand(9, 6, generator=g) * 3
    costs = torch.tensor([1.0, 2.0, 4.0, 5.0, 8.0, 10.0]) / 10
    for beta, price in ((0.3, 0.0), (0.3, 1.7), (2.0, 0.5)):
        direct = log_cost_oracle_distribution(losses, beta, costs, price)
        as_prior = log_oracle_distribution(losses, beta, log_cost_prior(costs, price, beta))
        torch.testing.assert_close(direct, as_prior)
        torch.testing.assert_close(direct.exp().sum(1), torch.ones(9))
    # a price moves mass to earlier (cheaper) steps
    q0 = log_cost_oracle_distribution(losses, 1.0, costs, 0.0).exp()
    q1 = log_cost_oracle_distribution(losses, 1.0, costs, 5.0).exp()
    steps = torch.arange(1, 7.0)
    assert ((q1 * steps).sum(1) < (q0 * steps).sum(1)).all()


def test_stage_config_inherits_the_method_and_adds_the_price_to_its_prior():
    method = MethodConfig(beta=0.5, price=2.0)
    cfg = StageConfig(objective="stage1").inherit(method)
    assert (cfg.beta, cfg.price) == (0.5, 2.0)
    assert StageConfig(objective="stage1", beta=0.1).inherit(method).beta == 0.1  # a stage may override
    model = Toy(costs=[1, 1, 2, 3, 5, 8, 13])
    c = exit_costs(model)
    torch.testing.assert_close(c, torch.tensor([1, 1, 2, 3, 5, 8, 13.0]) / 13)
    torch.testing.assert_close(cfg.model_log_prior(model), log_cost_prior(c, 2.0, 0.5))
    with pytest.raises(ValueError, match="exit_costs has 3 entries"):
        exit_costs(Toy(costs=[1, 2, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        exit_costs(Toy(costs=[3, 2, 1, 4, 5, 6, 7]))
    with pytest.raises(ConfigError, match="method.price"):
        MethodConfig(price=-1.0)


@pytest.mark.parametrize("make", [
    lambda p: QuantileSignal(p), lambda p: PolicySignal(p), lambda p: ToleranceSignal(),
    lambda p: ConfidenceSignal(), lambda p: EntropySignal(), lambda p: PatienceSignal()])
def test_online_rules_stop_where_the_full_rollout_says(sm, make):
    y = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
    full = unroll(sm.model, y, keep_outputs=True, model_grad=False)
    scores = signal_trace(make(sm.policy), full.step_outputs, y)
    thr = float(scores.flatten().median())
    with torch.no_grad():
        r = run_with_early_exit(sm.model, y, SignalRule(make(sm.policy), thr))
    expected = first_crossing(scores, thr)
    assert torch.equal(r.stop_times, expected)
    assert 1 < expected.float().mean() < sm.num_steps  # some stop early, some late: the test can fail
    picked = torch.stack([full.step_outputs[t - 1][i] for i, t in enumerate(expected.tolist())])
    torch.testing.assert_close(r.outputs, picked)


def test_quantile_scores_are_the_cdf_of_q_phi(sm):
    from learn2stop.core import log_stop_time_distribution

    y = torch.randn(10, 6)
    logits = unroll(sm.model, y, policy=sm.policy, model_grad=False).stop_logits
    cdf = log_stop_time_distribution(logits).exp().cumsum(1)[:, :-1]
    score = policy_scores(logits, "quantile")  # -log survival: a monotone map of the CDF that keeps precision
    torch.testing.assert_close(-torch.expm1(-score), cdf)
    for alpha in (0.2, 0.5, 0.9):
        assert QuantileSignal.to_param(QuantileSignal.from_param(alpha)) == pytest.approx(alpha)
    r = unroll(sm.model, y, policy=sm.policy, model_grad=False)
    assert torch.equal(InferenceConfig(rule="quantile", param=0.5).stop_times(r),
                       first_crossing(cdf, 0.5 - 1e-6))
    sharp = torch.full((1, 3), 30.0)  # pi ~ 1: the CDF is exactly 1.0 in float32 at every step, the score is not
    assert policy_scores(sharp, "quantile").diff(dim=1).gt(0).all()


def test_a_budget_of_exactly_the_first_steps_cost_is_met_despite_float32_rounding():
    """1 step of 10 costs 0.1 in float32, which is 0.10000000149: a budget of 0.1 stops every sample at step 1."""
    scores = torch.rand(50, 9, generator=torch.Generator().manual_seed(0))
    costs = torch.arange(1, 11, dtype=torch.float32) / 10
    cal = calibrate_budget(scores, costs, 0.1, "quantile")
    assert (first_crossing(scores, cal.threshold) == 1).all() and cal.calibration["mean_steps"] == 1.0


@pytest.mark.parametrize("costs", [None, torch.tensor([1, 3, 4, 6, 7, 9, 10.0]) / 10])
@pytest.mark.parametrize("budget", [0.2, 0.45, 0.7, 1.0])
def test_budget_calibration_meets_its_budget_on_the_calibration_data(costs, budget):
    g = torch.Generator().manual_seed(int(budget * 100))
    scores = torch.rand(500, 6, generator=g)
    c = costs if costs is not None else torch.arange(1, 8.0) / 7
    if float(c[0]) > budget:
        with pytest.raises(ConfigError, match="below the cost of the first step"):
            calibrate_budget(scores, c, budget, "quantile")
        return
    cal = calibrate_budget(scores, c, budget, "quantile")
    stops = first_crossing(scores, cal.threshold)
    realised = float(c[stops - 1].mean())
    assert realised <= budget + 1e-6
    assert realised == pytest.approx(cal.calibration["mean_cost"], abs=1e-5)
    # the next more generous threshold would overspend: the budget is used, not wasted
    higher = scores.cummax(1).values.flatten()
    higher = higher[higher > cal.threshold]
    if higher.numel():
        nxt = float(higher.min()) + 1e-7
        assert float(c[first_crossing(scores, nxt) - 1].mean()) > budget
    cand = torch.tensor([0.1, 0.5, 0.9, math.inf])
    direct = torch.stack([c[first_crossing(scores, float(t)) - 1].mean() for t in cand])
    torch.testing.assert_close(mean_cost_curve(scores, c, cand), direct)


def test_risk_control_holds_in_at_least_1_minus_delta_of_random_splits():
    """Learn-then-Test: on fresh data, the excess risk stays <= epsilon in >= 1 - delta of 200 splits."""
    g = torch.Generator().manual_seed(0)
    N, T, eps, delta = 1200, 8, 0.05, 0.1
    difficulty = torch.rand(N, generator=g)
    # a step is wrong with a probability that falls with depth, faster for easy samples
    p_wrong = (difficulty[:, None] * torch.linspace(1.0, 0.15, T)[None]).clamp(0, 1)
    wrong = (torch.rand(N, T, generator=g) < p_wrong).float()
    wrong[:, -1] = (torch.rand(N, generator=g) < 0.15 * difficulty).float()
    # wrong where full depth is right (CALM's consistency form): in [0, 1], and its mean bounds the accuracy drop
    losses = (wrong - wrong[:, -1:]).clamp_min(0)
    scores = (1 - difficulty[:, None]) * torch.linspace(0.2, 1.0, T - 1)[None] + 0.1 * torch.rand(N, T - 1, generator=g)
    violations, saved = 0, []
    for split in range(200):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(split))
        cal_i, test_i = perm[:600], perm[600:]
        cal = calibrate_risk(scores[cal_i], losses[cal_i], eps, delta, "quantile", loss_range=(0.0, 1.0))
        stops = first_crossing(scores[test_i], cal.threshold)
        risk = float((wrong[test_i].gather(1, (stops - 1)[:, None]) - wrong[test_i, -1:]).mean())  # accuracy drop
        violations += risk > eps
        saved.append(1 - float(stops.float().mean()) / T)
    assert violations <= delta * 200
    assert sum(saved) / len(saved) > 0.1  # and it does stop early: the guarantee is not bought by never stopping


def test_match_calibration_is_the_cheapest_threshold_reaching_the_goal():
    """With no full-depth lead, an earlier exit may still match the baseline: the cheapest threshold whose
    metric reaches the goal, found by brute force over every candidate; None when none reaches it."""
    from learn2stop.core.calibration import calibrate_match, candidate_thresholds

    g = torch.Generator().manual_seed(1)
    N, T = 400, 6
    right = (torch.rand(N, T, generator=g) < torch.tensor([0.4, 0.55, 0.65, 0.75, 0.72, 0.7])).float()  # exit 4 best
    scores = torch.rand(N, T - 1, generator=g) + torch.linspace(0, 1, T - 1)
    c = torch.arange(1, T + 1.0) / T
    accuracy = lambda stops: float(right.gather(1, (stops - 1)[:, None]).mean())  # noqa: E731
    goal = float(right[:, -1].mean())
    cal = calibrate_match(scores, c, accuracy, lambda a, b: a >= b, goal, "quantile")
    stops = first_crossing(scores, cal.threshold)
    assert accuracy(stops) >= goal and cal.calibration["metric"] == accuracy(stops)
    assert cal.target["kind"] == "match" and cal.calibration["mean_cost"] < 1
    cheapest = min(float(c[first_crossing(scores, float(t)) - 1].mean()) for t in candidate_thresholds(scores, 200)
                   if accuracy(first_crossing(scores, float(t))) >= goal)
    assert float(c[stops - 1].mean()) == pytest.approx(cheapest)
    assert calibrate_match(scores, c, accuracy, lambda a, b: a >= b, 0.99, "quantile") is None


def test_bad_calibration_targets_name_the_flag():
    s, c = torch.rand(5, 3), torch.arange(1, 5.0) / 4
    for b in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="--budget"):
            calibrate_budget(s, c, b, "quantile")
    with pytest.raises(ConfigError, match="--epsilon"):
        calibrate_risk(s, torch.zeros(5, 4), -0.1, 0.1, "quantile")
    for d in (0.0, 1.0, 2.0):
        with pytest.raises(ConfigError, match="--delta"):
            calibrate_risk(s, torch.zeros(5, 4), 0.1, d, "quantile")
    with pytest.raises(ConfigError, match="inference.param"):
        InferenceConfig(rule="quantile", param=1.5)
    with pytest.raises(ConfigError, match="inference.rule"):
        InferenceConfig(rule="magic")


def test_validation_uses_the_evaluation_rule(sm):
    y = torch.randn(200, 6, generator=torch.Generator().manual_seed(5))
    target = torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(6))
    loss_fn = lambda out, tgt: nn.functional.cross_entropy(out, tgt, reduction="none")
    batches = [(y, target)]
    for rule, param in (("quantile", 0.3), ("quantile", 0.8), ("threshold", 0.6)):
        inf = InferenceConfig(rule=rule, param=param)
        val = validation_scores(sm, batches, loss_fn, inf)
        with torch.no_grad():
            r = run_with_early_exit(sm.model, y, inf.make_rule(sm.policy))
        assert val["depth"] == pytest.approx(float(r.stop_times.float().mean()))
        assert val["policy"] == pytest.approx(float(loss_fn(r.outputs, target).mean()), rel=1e-5)


class _Task:
    def loss_fn(self, out, tgt):
        return nn.functional.cross_entropy(out, tgt, reduction="none")

    def sample_batch(self, n, gen, device):
        y = torch.randn(n, 6, generator=gen)
        return y, (y[:, :5].argmax(1))

    def validation_batches(self, device):
        return [self.sample_batch(64, torch.Generator().manual_seed(0), device)]


def test_the_trainer_validates_with_its_inference_rule(tmp_path, sm):
    inf = InferenceConfig(rule="quantile", param=0.2)
    tr = StagedTrainer(sm, _Task(), tmp_path, progress=False, inference=inf)
    assert tr._validate(StageConfig(objective="stage2")) == validation_scores(sm, _Task().validation_batches("cpu"),
                                                                              _Task().loss_fn, inf, seed=tr_seed(tr))


def tr_seed(tr):
    from learn2stop.core import derive_seed

    return derive_seed(tr.seed, "validation")


def test_frontier_and_calibrate_run_end_to_end_on_tiny_sparse(tmp_path, capsys):
    from learn2stop.cli import main
    from conftest import TINY

    TINY = [*TINY, "--run_aevb", "false", "--run_stage3", "false"]
    run = tmp_path / "run"
    assert main(["sparse", "frontier", "--run-dir", str(run), "--no-progress", *TINY]) == 2
    assert "run the 'train' command" in capsys.readouterr().err
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "1.5", *TINY]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", *TINY]) == 0
    cal = json.loads((run / "calibration.json").read_text())
    assert cal["target"] == {"kind": "budget", "budget": 0.6} and cal["calibration"]["mean_cost"] <= 0.6 + 1e-6
    assert main(["sparse", "frontier", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    fr = json.loads((run / "frontier.json").read_text())
    assert fr["metric"] == "NMSE (dB)" and fr["lower_is_better"] is True and fr["num_steps"] == 5
    assert {"fixed_depth", "baseline_fixed_depth", "tolerance", "policy", "oracle"} <= set(fr["curves"])
    assert fr["speed_reference"]["name"] == "baseline at full depth"  # the frontier in time
    assert fr["speed_passes_batch1"] == 3 * fr["speed_passes"]  # batch 1's short passes jitter: three times as many
    assert set(fr["speed_at_quality"]) >= {"fixed_depth", "policy"}
    assert (run / "frontier_time.png").is_file() and "## In time" in (run / "frontier.md").read_text()
    for name in ("fixed_depth", "baseline_fixed_depth", "tolerance", "policy"):
        for p in fr["curves"][name]:
            assert {"mean_steps", "metric", "samples_per_s_batch1", "samples_per_s_batchN"} <= set(p)
            assert p["samples_per_s_batch1"] > 0
    assert [p["mean_steps"] for p in fr["curves"]["fixed_depth"]] == [1, 2, 3, 4, 5]
    assert fr["full_depth"]["metric"] == pytest.approx(fr["curves"]["fixed_depth"][-1]["metric"])
    for p in fr["curves"]["policy"]:
        assert p["mean_steps"] / 5 <= p["budget"] + 0.15  # calibrated on validation, scored on test
    # the main rule also swept on the test trace, like the classical rules: its points are thresholds, timed too
    swept = fr["curves"]["policy_swept"]
    assert len({p["mean_steps"] for p in swept}) >= 2 and all(1 <= p["mean_steps"] <= 5 for p in swept)
    assert all(p["samples_per_s_batch1"] > 0 and "threshold" in p for p in swept)
    assert (run / "frontier.png").is_file() and "| policy |" in (run / "frontier.md").read_text()
    # the learned rule against each one-line rule at its own cost, with intervals
    h2h = fr["head_to_head"]
    assert h2h["policy"] == "price" and len(h2h["rows"]) == len(fr["curves"]["policy"])
    assert all(set(row["rules"]) == {"tolerance", "fixed"} and all(c["low"] <= c["diff"] <= c["high"]
               for c in row["rules"].values()) for row in h2h["rows"])
    assert "## The learned rule against each rule at its cost" in (run / "frontier.md").read_text()
    # evaluate now uses the calibrated rule
    assert main(["sparse", "evaluate", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    assert "calibrated price rule" in capsys.readouterr().out  # the quick preset's rule (inference.rule)
    # the run directory belongs to one configuration: another problem is refused by every command
    for cmd in ("evaluate", "frontier", "calibrate", "train"):
        extra = ["--budget", "0.5"] if cmd == "calibrate" else []
        assert main(["sparse", cmd, "--run-dir", str(run), "--no-progress", *TINY, "--problem.sparsity", "0.3", *extra]) == 2
        assert "problem.sparsity" in capsys.readouterr().err


def test_expected_stage1_pushes_bad_steps_up_while_marginal_weights_are_the_oracle():
    """Why the presets use the marginal Stage I: the gradient of sum_t q*_t l_t through q* is
    q*_t (1 - (l_t - E_q* l) / beta), negative for steps much worse than average (gradient *ascent* on
    their loss: measured, early LISTA steps and early exits decay); the marginal form's gradient is q* >= 0."""
    from learn2stop.core.losses import stage1_expected_loss, stage1_marginal_loss

    losses = torch.tensor([[0.1, 2.0, 0.3, 0.15]], requires_grad=True)
    beta = 0.28
    stage1_expected_loss(losses, beta).backward()
    g_expected = losses.grad.clone()
    losses.grad = None
    stage1_marginal_loss(losses, beta).backward()
    q = log_oracle_distribution(losses.detach(), beta).exp()
    torch.testing.assert_close(losses.grad, q)
    expected = q * (1 - (losses.detach() - (q * losses.detach()).sum()) / beta)
    torch.testing.assert_close(g_expected, expected)
    assert (g_expected < 0).any() and (losses.grad >= 0).all()


def test_validation_with_a_price_scores_the_priced_objective(sm):
    y = torch.randn(50, 6, generator=torch.Generator().manual_seed(8))
    target = torch.randint(0, 5, (50,), generator=torch.Generator().manual_seed(9))
    loss_fn = lambda out, tgt: nn.functional.cross_entropy(out, tgt, reduction="none")
    inf = InferenceConfig(rule="quantile", param=0.5)
    plain = validation_scores(sm, [(y, target)], loss_fn, inf)
    priced = validation_scores(sm, [(y, target)], loss_fn, inf, price=2.0)
    with torch.no_grad():
        stops = run_with_early_exit(sm.model, y, inf.make_rule(sm.policy)).stop_times
    c = exit_costs(sm.model)
    assert priced["policy"] == pytest.approx(plain["policy"] + 2.0 * float(c[stops - 1].mean()), rel=1e-5)
    assert priced["last"] == pytest.approx(plain["last"]) and priced["oracle"] > plain["oracle"]


def test_the_fixed_sequence_asks_only_the_thresholds_it_tests_and_matches_the_trace_calibration():
    """Fixed-sequence testing ends at the first threshold that fails: a measured risk (a model run per threshold)
    is asked for no threshold beyond it, and certifying from a trace gives calibrate_risk's record."""
    from learn2stop.core.calibration import candidate_thresholds
    from learn2stop.core.risk_control import certify

    g = torch.Generator().manual_seed(4)
    N, T = 3000, 5
    scores = torch.rand(N, T - 1, generator=g) * torch.linspace(0.3, 1.0, T - 1)
    losses = torch.cat([(torch.rand(N, T - 1, generator=g) > scores).float() * 0.3, torch.zeros(N, 1)], 1)
    ref = calibrate_risk(scores, losses, 0.05, 0.1, "threshold")
    asked = []

    def at(thr):
        asked.append(thr)
        stops = first_crossing(scores, thr)
        return losses.gather(1, (stops - 1)[:, None])[:, 0], stops

    cand = candidate_thresholds(scores, 200).flip(0).tolist()
    cal = certify(cand, at, 0.05, 0.1, "threshold", torch.arange(1, T + 1) / T)
    assert cal.threshold == ref.threshold and cal.calibration == ref.calibration
    tested = ref.calibration["thresholds_tested"]
    assert asked == cand[:tested] and 1 < tested < len(cand)  # in order, and none past the first failure


def test_cost_spaced_thresholds_run_from_full_depth_down_finest_near_it():
    from learn2stop.core.calibration import cost_spaced_thresholds, mean_cost_curve

    scores = torch.rand(4000, 5, generator=torch.Generator().manual_seed(2))
    costs = torch.arange(1, 7) / 6
    th = cost_spaced_thresholds(scores, costs, 20)
    assert th[0] == math.inf and th.numel() <= 20 and bool((th[1:] < th[:-1]).all())
    cost = mean_cost_curve(scores, costs, th)
    gaps = cost[:-1] - cost[1:]
    assert bool((gaps > 0).all()) and gaps[0] < gaps[len(gaps) // 2] < gaps[-1]  # fine near full depth
    assert float(cost[-1]) == pytest.approx(float(costs[0]), abs=1e-6)  # down to the cheapest the trace allows
    steps = torch.arange(1, 5.0).expand(50, 4)  # the fixed rule's signal: its thresholds are the exits
    assert cost_spaced_thresholds(steps, torch.arange(1, 6) / 5, 40).tolist() == [math.inf, 4, 3, 2, 1]

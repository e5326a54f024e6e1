"""The language model's stages and calibration: the per-token oracle and its identities, Stage II's loss, a short
training run that lowers the loss, and Learn-then-Test certifying a rule that keeps its risk on held-out tokens."""
from __future__ import annotations

import pytest
import torch
from lm_reference import tiny_gpt

from learn2stop.tasks.lm.config import preset
from learn2stop.tasks.lm.data import CharVocab
from learn2stop.tasks.lm.metric import LmTrace, MeasuredRisk, calibrate_rule, score_split, trace_split, windows
from learn2stop.tasks.lm.config import POLICIES
from learn2stop.tasks.lm.policy import TokenExitPolicy, policy_stop_logits
from learn2stop.tasks.lm.train import (exit_cost_fractions, new_policy, oracle_q, per_exit_losses,
                                       policy_batch, risk_batch, stage2_loss, stage2_objective, train_stages)


def markov_text(n: int, seed: int = 0) -> str:
    """A text whose next character mostly follows from the one before: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    chars, out, c = "abcdefgh ", [], 0
    nxt = torch.randint(len(chars), (len(chars),), generator=g)
    for r in torch.rand(n, generator=g).tolist():
        c = int(nxt[c]) if r < 0.85 else int(torch.randint(len(chars), (1,), generator=g))
        out.append(chars[c])
    return "".join(out)


def test_oracle_is_the_softmax_of_priced_losses_and_sums_to_one():
    cfg = preset("tiny", method={"beta": 0.3, "price": 0.5})
    gpt = tiny_gpt(0, n_layer=4)
    x = torch.randint(13, (2, 7), generator=torch.Generator().manual_seed(0))
    losses = per_exit_losses(gpt, x, torch.roll(x, -1, 1))  # (14, 4)
    assert losses.shape == (14, 4)
    q = oracle_q(cfg, gpt, losses)
    c = exit_cost_fractions(gpt)
    assert torch.allclose(c, torch.tensor([0.25, 0.5, 0.75, 1.0]))
    by_hand = torch.softmax(-(losses + 0.5 * c) / 0.3, dim=1)
    assert torch.allclose(q, by_hand, atol=1e-6) and torch.allclose(q.sum(1), torch.ones(14, dtype=q.dtype))
    assert not q.requires_grad or q.grad_fn is None  # held fixed in Stage I


@pytest.mark.parametrize("kind, hidden", [(k, 8) for k in POLICIES] + [("hidden", 0)])
def test_stage2_loss_is_a_kl_that_fitting_lowers(kind, hidden):
    cfg = preset("tiny", model={"policy": kind, "policy_hidden": hidden})
    gpt = tiny_gpt(1, n_layer=3).float()
    x = torch.randint(13, (4, 12), generator=torch.Generator().manual_seed(1))
    policy = new_policy(cfg, gpt)
    states, logits, losses = policy_batch(gpt, x, torch.roll(x, -1, 1), policy.reads_logits)
    assert len(states) == 4 and states[0].shape == (48, 16) and losses.shape == (48, 3)
    assert (logits is None) == (kind == "hidden")
    torch.manual_seed(0)
    policy.fit_scale(*policy_batch(gpt, x, torch.roll(x, -1, 1), True)[:2])
    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    first = float(stage2_loss(cfg, gpt, policy, states, logits, losses).detach())
    for _ in range(60):
        loss = stage2_loss(cfg, gpt, policy, states, logits, losses)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = float(stage2_loss(cfg, gpt, policy, states, logits, losses).detach())
    assert first >= 0 and 0 <= last < first
    assert policy.flops(65, 128) < 0.05 * 24 * 128 ** 2  # under 5 % of a block's projections


@pytest.mark.parametrize("risk", ["loss", "agreement"])
def test_the_risk_target_is_the_per_token_risk_and_fitting_it_ranks_the_exits(risk):
    cfg = preset("tiny", method={"stage2_target": "risk"}, calibration={"risk": risk})
    gpt, ref = tiny_gpt(1, n_layer=3).float(), tiny_gpt(2, n_layer=3).float()
    x = torch.randint(13, (4, 12), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    states, logits, target = risk_batch(gpt, ref, x, y, risk, False)
    assert logits is None and target.shape == (48, 2)
    _, own_logits, losses = policy_batch(gpt, x, y, True)
    ref_logits = ref(x).flatten(0, 1)
    ref_ce = torch.nn.functional.cross_entropy(ref_logits, y.flatten(), reduction="none")
    by_hand = (ref_ce[:, None] - losses[:, :2] if risk == "loss"
               else (torch.stack(own_logits[:2], 1).argmax(-1) == ref_logits.argmax(-1)[:, None]).float())
    assert torch.allclose(target, by_hand, atol=1e-6)
    if risk == "loss":  # against its own full depth, the gain of the last exit before it is the loss it saves
        assert torch.allclose(risk_batch(gpt, gpt, x, y, risk, False)[2][:, 1], losses[:, 2] - losses[:, 1])
    else:
        assert set(target.unique().tolist()) <= {0.0, 1.0}
    policy = new_policy(cfg, gpt)
    objective = stage2_objective(cfg, gpt, policy, ref)
    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    first = float(objective(x, y).detach())
    for _ in range(60):
        loss = objective(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(objective(x, y).detach()) < first
    s = policy_stop_logits(policy, states, None).detach().flatten()
    order = s.argsort(descending=True)
    top, bottom = target.flatten()[order[:48]], target.flatten()[order[48:]]
    assert top.mean() > bottom.mean()  # the fitted policy stops first where stopping costs least


def test_a_policy_asked_at_one_exit_gives_that_exits_column_of_the_batch():
    gpt = tiny_gpt(4, n_layer=4).float()
    x = torch.randint(13, (2, 9), generator=torch.Generator().manual_seed(4))
    for kind, hidden in [(k, 8) for k in POLICIES] + [("hidden", 0)]:
        policy = new_policy(preset("tiny", model={"policy": kind, "policy_hidden": hidden}), gpt)
        with torch.no_grad():
            for p in policy.parameters():
                p.normal_(0, 0.5)
        states, logits, _ = policy_batch(gpt, x, x, True)
        cols = policy_stop_logits(policy, states, logits)  # (18, 3)
        assert cols.shape == (18, 3)
        for t in (1, 3):
            alone = policy.stop_logits(t, logits[t - 1][5:6], states[t][5:6], states[t - 1][5:6])
            assert torch.allclose(alone, cols[5:6, t - 1], atol=1e-6)
        h = states[2]  # the hidden-state policy reads the normalised state: blind to its scale and offset
        if kind == "hidden":
            assert torch.allclose(policy.stop_logits(2, None, h, None), policy.stop_logits(2, None, 3 * h + 1, None),
                                  atol=1e-4)


def test_a_short_training_lowers_the_loss_and_resumes(tmp_path):
    text = markov_text(6000)
    vocab = CharVocab.of(text)
    ids = vocab.encode(text)
    cfg = preset("tiny", baseline={"iters": 60, "lr": 5e-3}, deep={"iters": 5}, stage1={"iters": 5},
                 stage2={"iters": 10})
    x, y = windows(ids[5000:], cfg.model.context)
    untrained = train_stages(preset("tiny", baseline={"iters": 0}, deep={"iters": 0}, stage1={"iters": 0},
                                    stage2={"iters": 0}), tmp_path / "untrained", ids[:5000], len(vocab), log=print)
    out = train_stages(cfg, tmp_path / "run", ids[:5000], len(vocab), log=print)
    never = lambda t, lg, h, hp: torch.zeros(lg.shape[:-1], dtype=torch.bool)  # noqa: E731
    before = score_split(untrained["models"]["baseline"][0], x, y, never)["loss"]
    after = score_split(out["models"]["baseline"][0], x, y, never)["loss"]
    assert after < before - 0.3, (before, after)
    lines = []
    again = train_stages(cfg, tmp_path / "run", ids[:5000], len(vocab), log=lines.append)
    assert all("loaded" in m for m in lines) and len(lines) == 4
    w = out["models"]["stage2"][1].first.weight
    assert torch.equal(again["models"]["stage2"][1].first.weight, w)


def test_learned_propagation_is_fitted_after_each_backbone_and_kept_in_its_checkpoint(tmp_path):
    text = markov_text(3000)
    vocab = CharVocab.of(text)
    cfg = preset("tiny", model={"propagation": "learned"}, baseline={"iters": 5}, deep={"iters": 2},
                 stage1={"iters": 2}, stage2={"iters": 2})
    lines = []
    out = train_stages(cfg, tmp_path / "run", vocab.encode(text), len(vocab), log=lines.append)
    fitted = [m for m in lines if "propagation maps fitted" in m]
    assert len(fitted) == 3  # baseline, deep supervision, Stage I
    eye = torch.eye(cfg.model.n_embd)
    again = train_stages(cfg, tmp_path / "run", vocab.encode(text), len(vocab), log=lambda m: None)
    for stage in ("baseline", "deep", "stage1"):
        maps = out["models"][stage][0].propagate_maps
        assert not torch.allclose(maps[0].weight, eye)  # fitted, no longer the identity it starts as
        for a, b in zip(maps.parameters(), again["models"][stage][0].propagate_maps.parameters()):
            assert torch.equal(a, b)


def test_calibration_certifies_and_keeps_the_risk_on_held_out_tokens():
    g = torch.Generator().manual_seed(3)
    N, T = 40000, 4
    sure = torch.rand(N, T - 1, generator=g)  # a signal: the surer, the likelier an early exit is right
    wrong = (torch.rand(N, T - 1, generator=g) > sure).float()
    losses = torch.cat([wrong * 2.0, torch.zeros(N, 1)], 1)  # the loss increase of exiting at t (0 at full depth)
    trace = LmTrace(losses, torch.zeros(N, T, dtype=torch.long), torch.zeros(N, dtype=torch.long),
                    {"margin": sure})
    costs = torch.arange(1, T + 1, dtype=torch.float32) / T
    half = N // 2
    cal_trace = LmTrace(losses[:half], trace.greedy[:half], trace.targets[:half], {"margin": sure[:half]})
    c = calibrate_rule(cal_trace, "margin", costs, "loss", 0.05, 0.1)
    assert c.rule == "margin" and c.threshold < float("inf") and c.calibration["mean_steps"] < T
    from learn2stop.core.rules import first_crossing

    stops = first_crossing(sure[half:], c.threshold)
    held_out = float(losses[half:].gather(1, (stops - 1)[:, None]).mean())
    assert held_out <= 0.05 + 0.01 and c.calibration["risk"] <= 0.05


def test_the_trace_of_a_model_has_every_signal_per_token():
    gpt = tiny_gpt(2, n_layer=3).float()
    x = torch.randint(13, (3, 10), generator=torch.Generator().manual_seed(2))
    policy = TokenExitPolicy(3, 4)
    tr = trace_split(gpt, x, torch.roll(x, -1, 1), policy, batch=2)
    assert tr.losses.shape == (30, 3) and set(tr.signals) == {"policy", "margin", "saturation", "fixed"}
    assert all(v.shape == (30, 2) for v in tr.signals.values())
    assert torch.equal(tr.signals["fixed"][0], torch.tensor([1.0, 2.0]))
    assert torch.equal(tr.risk("loss")[:, -1], torch.zeros(30)) and bool((tr.risk("agreement") <= 1).all())


def test_a_threshold_is_certified_on_real_early_exit_not_on_the_trace():
    """The certified risk is that of the deployed model: real early exit, a stopped token's later layers propagated
    (later tokens attend to them), which the full-depth trace does not see; each threshold is scored once."""
    from learn2stop.tasks.lm.rules import make_rule

    gpt = tiny_gpt(2, n_layer=4).float()
    x = torch.randint(13, (6, 12), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    trace = trace_split(gpt, x, y)
    measured = MeasuredRisk(gpt, x, y, None, trace, "loss")
    costs = exit_cost_fractions(gpt)
    cal = calibrate_rule(trace, "margin", costs, "loss", 0.2, 0.1, measured=measured)
    on_trace = calibrate_rule(trace, "margin", costs, "loss", 0.2, 0.1)
    assert cal.threshold < float("inf") and cal.calibration["mean_steps"] < 4
    real = score_split(gpt, x, y, make_rule("margin", cal.threshold))
    assert cal.calibration["risk"] == pytest.approx(real["loss"] - float(trace.losses[:, -1].mean()), abs=1e-6)
    assert cal.calibration["mean_steps"] == pytest.approx(float(real["exit_steps"].float().mean()))
    assert abs(cal.calibration["risk"] - on_trace.calibration["risk"]) > 1e-3  # the trace misjudges it
    assert len(measured._scored) == cal.calibration["thresholds_tested"]  # full depth and each threshold tested, once
    calibrate_rule(trace, "margin", costs, "loss", 0.2, 0.1, measured=measured)
    assert len(measured._scored) == cal.calibration["thresholds_tested"]
    with pytest.raises(ValueError, match="reference trace has 72 tokens, the windows 12"):
        MeasuredRisk(gpt, x[:1], y[:1], None, trace, "loss")


def test_the_risk_over_a_reference_is_over_its_full_depth_and_certifies_no_more_stopping():
    g = torch.Generator().manual_seed(5)
    N, T = 20000, 3
    own = torch.rand(N, T, generator=g)
    own[:, -1] = 1.0
    ref = LmTrace(torch.full((N, T), 0.97), torch.zeros(N, T, dtype=torch.long), torch.zeros(N, dtype=torch.long), {})
    sure = torch.rand(N, T - 1, generator=g)
    trace = LmTrace(own, torch.ones(N, T, dtype=torch.long), torch.zeros(N, dtype=torch.long), {"margin": sure})
    assert torch.allclose(trace.risk("loss", ref), own - 0.97)
    assert torch.equal(trace.risk("agreement", ref), torch.ones(N, T))  # every greedy token differs from the reference's
    costs = torch.arange(1, T + 1, dtype=torch.float32) / T
    alone = calibrate_rule(trace, "margin", costs, "loss", 0.05, 0.1)
    against = calibrate_rule(trace, "margin", costs, "loss", 0.05, 0.1, reference=ref)
    assert against.threshold >= alone.threshold  # 0.03 of the budget is spent before any token stops early
    with pytest.raises(ValueError, match="reference trace has 5 tokens"):
        trace.risk("loss", LmTrace(ref.losses[:5], ref.greedy[:5], ref.targets[:5], {}))


def test_a_backbone_whose_full_depth_is_above_the_reference_is_certified_nowhere_and_says_so():
    g = torch.Generator().manual_seed(6)
    N, T = 5000, 3
    own = 1.0 + 0.1 * torch.rand(N, T, generator=g)
    ref = LmTrace(torch.full((N, T), 0.9), torch.zeros(N, T, dtype=torch.long), torch.zeros(N, dtype=torch.long), {})
    trace = LmTrace(own, torch.zeros(N, T, dtype=torch.long), torch.zeros(N, dtype=torch.long),
                    {"margin": torch.rand(N, T - 1, generator=g)})
    c = calibrate_rule(trace, "margin", torch.tensor([1 / 3, 2 / 3, 1.0]), "loss", 0.05, 0.1, reference=ref)
    assert c.threshold == float("inf") and c.calibration["mean_steps"] == T
    assert abs(c.calibration["risk"] - float((own[:, -1] - 0.9).mean())) < 1e-6 and c.calibration["p_value"] > 0.1


@pytest.mark.parametrize("kind, hidden", [("hidden", 8), ("hidden", 0), ("signals", 8)])
def test_the_policy_rule_stops_where_its_stop_probability_reaches_the_threshold(kind, hidden):
    from learn2stop.tasks.lm.rules import make_rule

    gpt = tiny_gpt(7, n_layer=4).float()
    policy = new_policy(preset("tiny", model={"policy": kind, "policy_hidden": hidden}), gpt)
    with torch.no_grad():
        for p in policy.parameters():
            p.normal_(0, 0.5)
    x = torch.randint(13, (3, 11), generator=torch.Generator().manual_seed(7))
    states, logits, _ = policy_batch(gpt, x, x, True)
    probs = torch.sigmoid(policy_stop_logits(policy, states, logits)).detach()  # (33, 3) as the trace holds them
    lam = float(probs.median())
    rule = make_rule("policy", lam, policy)
    assert rule.reads_logits == (kind == "signals")
    for t in (1, 2, 3):
        got = rule(t, logits[t - 1] if rule.reads_logits else None, states[t], states[t - 1])
        assert torch.equal(got, probs[:, t - 1] >= lam)

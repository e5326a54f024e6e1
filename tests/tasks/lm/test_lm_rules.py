"""The language model's exit rules: what they are shown (the exit's hidden state and the one before) and their masks
on crafted logits and hidden states."""
from __future__ import annotations

import math

import pytest
import torch
from lm_reference import tiny_gpt

from learn2stop.tasks.lm import StepwiseGPT, generate, score_with_exits
from learn2stop.tasks.lm.rules import (ExitRule, fixed_depth, make_rule, planned_rule, reads_logits, saturation,
                                        softmax_margin)


def test_scoring_shows_each_rule_the_exit_state_and_the_one_before():
    gpt = tiny_gpt(3)
    view, idx = StepwiseGPT(gpt), torch.randint(13, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = []
    score_with_exits(view, idx, lambda t, logits, h, h_prev: seen.append((t, h.clone(), h_prev.clone()))
                     or torch.zeros(idx.shape, dtype=torch.bool))
    h = gpt.embed(idx)
    assert torch.equal(seen[0][2], h)
    for t, h_t, h_prev in seen:
        h = gpt.blocks[t - 1](h)
        assert torch.allclose(h_t, h) and (t == 1 or torch.equal(h_prev, seen[t - 2][1]))
        assert torch.allclose(gpt.head(h_t), gpt.head(h))


def test_generation_shows_the_rows_still_running_their_states():
    gpt = tiny_gpt(4)
    view = StepwiseGPT(gpt)
    prompt = torch.randint(13, (5, 3), generator=torch.Generator().manual_seed(2))
    rule = make_rule("saturation", 0.3)
    batch = generate(view, prompt, 6, rule)
    for b in range(5):  # each row alone: the same tokens and exits (the rule saw that row's states)
        one = generate(view, prompt[b:b + 1], 6, rule)
        assert torch.equal(one.tokens[0], batch.tokens[b]) and torch.equal(one.exit_steps[0], batch.exit_steps[b])
    assert 1 < batch.exit_steps.float().mean() < view.num_steps  # the crafted threshold stops some, not all


def test_margin_and_saturation_masks_on_crafted_inputs():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    assert torch.allclose(softmax_margin(logits), torch.tensor([0.5, 0.05]))
    h = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    h_prev = torch.tensor([[2.0, 0.0], [1.0, -1.0]])
    assert torch.allclose(saturation(h, h_prev), torch.tensor([1.0, 0.0]), atol=1e-6)
    assert make_rule("margin", 0.3)(1, logits, h, h_prev).tolist() == [True, False]
    assert make_rule("saturation", 0.9)(1, logits, h, h_prev).tolist() == [True, False]
    assert make_rule("fixed", 2)(1, logits, h, h_prev).tolist() == [False, False]
    assert make_rule("fixed", 2)(2, logits, h, h_prev).tolist() == [True, True]
    assert make_rule("full", math.inf)(1, logits, h, h_prev).tolist() == [False, False]
    exits = torch.tensor([[1, 3], [2, 2]])
    assert planned_rule(exits)(2, None, None, None).tolist() == [[False, False], [True, True]]


def test_a_plain_function_is_a_rule_that_reads_the_logits_and_decides_per_token_and_a_non_function_is_refused():
    plain = lambda t, logits, h, h_prev: torch.ones(h.shape[:-1], dtype=torch.bool)  # noqa: E731
    assert reads_logits(plain) and fixed_depth(plain, 4) is None
    assert reads_logits(None) and fixed_depth(None, 4) == 4  # no rule: every token at the last step
    assert fixed_depth(make_rule("fixed", 9.0), 4) == 4 and not reads_logits(make_rule("fixed", 2.0))
    view = StepwiseGPT(tiny_gpt(4))
    with pytest.raises(TypeError, match="exit_rule must be None, an ExitRule or a function"):
        score_with_exits(view, torch.zeros(1, 3, dtype=torch.long), 0.5)
    with pytest.raises(TypeError, match="exit_rule must be None, an ExitRule or a function"):
        generate(view, torch.zeros(1, 3, dtype=torch.long), 2, "margin")


def test_bad_rules_are_refused_by_name():
    with pytest.raises(ValueError, match="rule must be one of"):
        make_rule("entropy", 0.5)
    with pytest.raises(ValueError, match="needs a trained policy"):
        make_rule("policy", 0.5)(1, torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 2))


def test_a_rule_that_stops_every_token_at_one_step_runs_a_truncated_model_and_is_never_asked():
    gpt = tiny_gpt(4)
    view = StepwiseGPT(gpt)
    idx = torch.randint(13, (3, 8), generator=torch.Generator().manual_seed(3))
    fixed = make_rule("fixed", 2.5)  # stops every token at exit 3
    assert fixed.depth == 3 and make_rule("full", math.inf).depth == math.inf and make_rule("margin", 0.5).depth is None

    def never_asked(*args):
        raise AssertionError("a rule with a fixed depth was asked")
    asked = ExitRule(never_asked, reads_logits=False, depth=3)
    per_token = lambda t, logits, h, h_prev: torch.full(h.shape[:-1], t >= 3)  # the same stops, asked at every exit
    h = gpt.embed(idx)
    for block in gpt.blocks[:3]:
        h = block(h)
    logits, exits = score_with_exits(view, idx, asked)
    assert torch.equal(exits, torch.full(idx.shape, 3)) and torch.allclose(logits, gpt.head(h), atol=1e-6)
    assert torch.allclose(score_with_exits(view, idx, per_token)[0], logits, atol=1e-6)
    assert torch.equal(score_with_exits(view, idx, make_rule("full", math.inf))[0], gpt(idx))

    prompt = idx[:, :3]
    out = generate(view, prompt, 5, asked)
    reference = generate(view, prompt, 5, per_token)
    assert torch.equal(out.tokens, reference.tokens) and torch.equal(out.exit_steps, torch.full((3, 5), 3))
    assert torch.equal(generate(view, prompt, 5, make_rule("full", math.inf)).tokens, generate(view, prompt, 5).tokens)


def test_the_in_time_record_reports_a_fixed_exit_by_its_layer_and_never_credits_full_depth():
    from learn2stop.tasks.lm import preset
    from learn2stop.tasks.lm.report import in_time_record

    cfg = preset("tiny", model={"n_layer": 4, "exit_every": 2})  # exits after layers 2 and 4

    def row(label, rule, threshold, layers, val=1.0):
        return {"row": label, "backbone": "stage1", "rule": rule, "threshold": threshold, "test_loss": 1.0,
                "test_mean_layers": layers, "val_loss": val}
    results = [{**row("full depth (GPT)", "full", None, 4.0), "backbone": "baseline"},
               row("Stage I, full depth", "full", None, 4.0), row("Stage I + fixed exit 2", "fixed", 1.0, 2.0),
               row("Stage I + CALM margin", "margin", 0.9, 3.0)]
    speeds = {"full depth (GPT)": 100.0, "Stage I, full depth": 130.0, "Stage I + fixed exit 2": 90.0,
              "Stage I + CALM margin": 110.0}
    timing = {k: {"generate": {1: v}, "score": v, "spread": {1: 0.0}} for k, v in speeds.items()}
    rec = in_time_record(cfg, {"results": results, "timing": timing,
                               "deployed": {"backbone": "baseline", "row": "full depth (GPT)"}}, 4)
    rows = {r["rule"]: r for r in rec["rows"]}
    assert rows["fixed"]["param"] == 2.0 and rows["fixed"]["mean_steps"] == 2.0  # step 1 is layer 2
    assert rec["fastest"] == {"1": "margin"}  # Stage I at full depth times faster, but runs the GPT's layers

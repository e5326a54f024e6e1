"""Generation with a KV cache and early exits, and self-speculative decoding: full-depth greedy tokens without exits,
a cache after mixed exits equal to a row-by-row reference, batch 8 equal to eight batch-1 runs, bad input refused."""
from __future__ import annotations

import pytest
import torch
from lm_reference import greedy_reference, reference_run, tiny_gpt

from learn2stop.tasks.lm import StepwiseGPT, generate, self_speculative_decode
from learn2stop.tasks.lm.models import Block


def confidence_rule(threshold: float):
    """Stop a row once its exit's top probability reaches ``threshold``."""
    return lambda t, logits, h, h_prev: logits.softmax(-1).amax(-1) >= threshold


def median_confidence(gpt, prompt) -> float:
    """A threshold that stops about half the positions at the first exit (mixed exits)."""
    view = StepwiseGPT(gpt)
    with torch.no_grad():
        state = view.step(1, view.initial_state(prompt), prompt)
        return float(view.readout(1, state, prompt).softmax(-1).amax(-1).median())


def prompts(batch: int, length: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(13, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 5])
def test_without_exits_generation_is_full_depth_greedy(length):
    gpt = tiny_gpt(11)
    prompt = prompts(3, length)
    out = generate(StepwiseGPT(gpt), prompt, 9)
    assert torch.equal(out.tokens, greedy_reference(gpt, prompt, 9))
    assert bool((out.exit_steps == 4).all())


@pytest.mark.parametrize("propagation,exit_every", [("copy", 1), ("learned", 1), ("copy", 2)])
def test_the_cache_after_mixed_exits_matches_a_row_by_row_reference(propagation, exit_every):
    gpt = tiny_gpt(12, propagation=propagation, exit_every=exit_every)
    if gpt.propagate_maps is not None:  # maps that are not the identity, so that propagation shows
        with torch.no_grad():
            for m in gpt.propagate_maps:
                m.weight.add_(0.3 * torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(13),
                                                dtype=m.weight.dtype))
    view, prompt, n = StepwiseGPT(gpt), prompts(5, 4), 8
    out = generate(view, prompt, n, confidence_rule(median_confidence(gpt, prompt)))
    assert any(len(set(col.tolist())) > 1 for col in out.exit_steps.T), "no step where rows exit at different layers"
    fed = prompt.shape[1] + n - 1  # positions in the cache: the prompt and every new token but the last
    assert out.cache.length == fed
    for b in range(prompt.shape[0]):
        exits = [gpt.cfg.n_layer] * (prompt.shape[1] - 1) + [gpt.cfg.exit_layers[s - 1] for s in out.exit_steps[b]]
        logits, kv = reference_run(gpt, out.tokens[b, :fed], exits)
        assert torch.equal(logits[prompt.shape[1] - 1:].argmax(-1), out.tokens[b, prompt.shape[1]:])
        for layer, (k, v) in enumerate(kv):
            torch.testing.assert_close(out.cache.k[layer][b, :, :fed], k, rtol=0, atol=1e-10)
            torch.testing.assert_close(out.cache.v[layer][b, :, :fed], v, rtol=0, atol=1e-10)


def test_batch_8_equals_eight_batch_1_generations():
    gpt = tiny_gpt(14, exit_every=1)
    view, prompt = StepwiseGPT(gpt), prompts(8, 3, seed=15)
    rule = confidence_rule(median_confidence(gpt, prompt))
    batched = generate(view, prompt, 10, rule)
    assert len(set(batched.exit_steps.flatten().tolist())) > 1
    for b in range(8):
        alone = generate(view, prompt[b:b + 1], 10, rule)
        assert torch.equal(alone.tokens[0], batched.tokens[b])
        assert torch.equal(alone.exit_steps[0], batched.exit_steps[b])
        for layer in range(gpt.cfg.n_layer):
            torch.testing.assert_close(alone.cache.k[layer][0], batched.cache.k[layer][b], rtol=0, atol=1e-10)
            torch.testing.assert_close(alone.cache.v[layer][0], batched.cache.v[layer][b], rtol=0, atol=1e-10)


def test_a_rule_that_reads_no_logits_gets_none_and_the_same_generation(monkeypatch):
    """Saturation reads hidden states alone: the head then runs only where rows stop, and the tokens, exits and
    caches are those of the same rule handed the logits."""
    from learn2stop.tasks.lm import rules

    gpt = tiny_gpt(17, exit_every=1)
    view, prompt = StepwiseGPT(gpt), prompts(6, 3, seed=18)
    lean = rules.make_rule("saturation", 0.0)
    assert not rules.reads_logits(lean) and rules.reads_logits(confidence_rule(0.5))
    seen = []

    def told(t, logits, h, h_prev):  # the same decisions, from a rule that does not say it skips the logits
        seen.append(logits is not None)
        return lean(t, logits, h, h_prev)

    heads, original = [], type(gpt).head

    def counted(self, h):
        heads.append(h.shape[0])
        return original(self, h)

    monkeypatch.setattr(type(gpt), "head", counted)
    a = generate(view, prompt, 6, lean)
    lean_heads, heads[:] = sum(heads), []
    b = generate(view, prompt, 6, told)
    assert all(seen) and lean_heads < sum(heads)  # fewer rows read out
    assert len(set(a.exit_steps.flatten().tolist())) > 1
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.exit_steps, b.exit_steps)
    for layer in range(gpt.cfg.n_layer):
        assert torch.equal(a.cache.k[layer], b.cache.k[layer]) and torch.equal(a.cache.v[layer], b.cache.v[layer])


def test_rows_that_stop_at_the_first_exit_cost_no_later_block(monkeypatch):
    """Every row stopping at the first exit: the later blocks never run (their caches are propagation alone)."""
    gpt = tiny_gpt(16)
    blocks, ran = list(gpt.blocks), []
    original = Block.cached

    def counted(self, *args):
        ran.append(blocks.index(self))
        return original(self, *args)

    monkeypatch.setattr(Block, "cached", counted)
    out = generate(StepwiseGPT(gpt), prompts(4, 1), 5, lambda t, logits, h, h_prev: torch.ones(len(logits), dtype=torch.bool))
    assert ran == [0] * 5 and bool((out.exit_steps == 1).all())


@pytest.mark.parametrize("draft_layer", [1, 2, 3])
@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_self_speculative_decoding_returns_the_full_models_greedy_tokens(draft_layer, num_draft):
    gpt = tiny_gpt(17, scale=0.25)
    prompt, n = prompts(1, 4, seed=18), 16
    result = self_speculative_decode(gpt, prompt, n, draft_layer, num_draft)
    assert torch.equal(result.tokens, greedy_reference(gpt, prompt, n))
    assert result.verify_passes == n - result.accepted
    assert 0 <= result.accepted <= result.drafted


def test_self_speculative_decoding_accepts_drafts_when_the_exit_agrees():
    """With the last block's contribution small the early exit mostly agrees: drafts are accepted, passes saved."""
    gpt = tiny_gpt(19, scale=0.25)
    with torch.no_grad():
        for p in gpt.blocks[-1].parameters():
            p.mul_(0.01)
    prompt = prompts(1, 2, seed=20)
    result = self_speculative_decode(gpt, prompt, 20, 3, 4)
    assert torch.equal(result.tokens, greedy_reference(gpt, prompt, 20))
    assert result.accepted > 0 and result.verify_passes < 20


def test_speculative_decoding_reaches_the_end_of_the_context():
    gpt = tiny_gpt(21, context=10)
    prompt = prompts(1, 3, seed=22)
    result = self_speculative_decode(gpt, prompt, 8, 2, 5)  # the last token predicted from position 9
    assert torch.equal(result.tokens, greedy_reference(gpt, prompt, 8))


@pytest.mark.parametrize("prompt,n,match", [
    (torch.zeros(0, 3, dtype=torch.long), 4, "batch"),
    (torch.zeros(2, 0, dtype=torch.long), 4, "at least one token"),
    (torch.zeros(2, 3, dtype=torch.long), 0, "max_new_tokens"),
    (torch.zeros(2, 3, dtype=torch.long), -2, "max_new_tokens"),
    (torch.zeros(2, 3, dtype=torch.long), True, "max_new_tokens"),
    (torch.zeros(2, 25, dtype=torch.long), 1, r"prompt length \(25\) exceeds the model's context \(24\)"),
    (torch.full((2, 3), 13), 4, "outside the model's vocabulary of 13"),
    (torch.full((2, 3), -1), 4, "outside the model's vocabulary"),
    (torch.zeros(2, 3), 4, "torch.long"),
])
def test_bad_generation_input_is_refused_naming_the_problem(prompt, n, match):
    gpt = tiny_gpt(0)
    with pytest.raises(ValueError, match=match):
        generate(StepwiseGPT(gpt), prompt, n)
    with pytest.raises(ValueError, match=match):
        self_speculative_decode(gpt, prompt[:1] if len(prompt) else prompt, n, 2)


@pytest.mark.parametrize("context", [10, 11])
def test_generation_goes_past_the_context_in_a_restarted_window(context):
    gpt = tiny_gpt(23, context=context)
    prompt = prompts(2, 4, seed=24)
    want = greedy_reference(gpt, prompt, 3 * context)  # the window restarts several times
    assert torch.equal(generate(StepwiseGPT(gpt), prompt, 3 * context).tokens, want)
    for draft in (1, 4):  # a round never crosses a full cache: still greedy decoding's tokens
        assert torch.equal(self_speculative_decode(gpt, prompt[:1], 3 * context, 2, draft).tokens, want[:1])


def test_early_exit_past_the_context_keeps_its_exits():
    gpt = tiny_gpt(25, context=10)
    never = lambda t, logits, h, h_prev: torch.zeros(h.shape[0], dtype=torch.bool)  # noqa: E731
    always = lambda t, logits, h, h_prev: torch.ones(h.shape[0], dtype=torch.bool)  # noqa: E731
    prompt = prompts(3, 2, seed=26)
    full = generate(StepwiseGPT(gpt), prompt, 25, never)
    assert torch.equal(full.tokens, greedy_reference(gpt, prompt, 25))
    first = generate(StepwiseGPT(gpt), prompt, 25, always)
    assert first.tokens.shape == (3, 27) and bool((first.exit_steps == 1).all())


def test_a_prompt_that_fills_the_context_still_gets_one_token():
    gpt = tiny_gpt(0)
    out = generate(StepwiseGPT(gpt), torch.zeros(1, 24, dtype=torch.long), 1)
    assert out.tokens.shape == (1, 25)


@pytest.mark.parametrize("kwargs,match", [
    ({"draft_layer": 4}, "draft_layer"), ({"draft_layer": 0}, "draft_layer"),
    ({"draft_layer": 2, "num_draft": 0}, "num_draft")])
def test_bad_speculative_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        self_speculative_decode(tiny_gpt(0), torch.zeros(1, 3, dtype=torch.long), 4, **kwargs)
    with pytest.raises(ValueError, match="batch 1"):
        self_speculative_decode(tiny_gpt(0), torch.zeros(2, 3, dtype=torch.long), 4, 2)


def test_the_draft_plans_rank_tokens_per_layer_run_and_the_fastest_is_timed():
    from learn2stop.tasks.lm.speculative import draft_plans, fastest_draft

    # exits that always agree: the shallowest, drafting as far as allowed; 9 tokens for 9 + 5 layer runs
    k, m, gain = draft_plans({1: 1.0, 3: 1.0}, 6, max_draft=8)[0]
    assert (k, m) == (1, 8) and gain == pytest.approx(9 * 6 / 14)
    # a shallow exit that rarely agrees loses to a deeper one that mostly does
    plans = draft_plans({1: 0.1, 3: 0.95}, 6)
    k, m, gain = plans[0]
    tokens = sum(0.95 ** i for i in range(m + 1))
    assert k == 3 and gain == pytest.approx(tokens * 6 / ((m + 1) * 3 + 3)) and gain > 1.4
    assert len(plans) == 16 and [p[2] for p in plans] == sorted((p[2] for p in plans), reverse=True)
    # no exit agrees: nothing pays; one draft at the first exit costs the least
    k, m, gain = draft_plans({1: 0.0, 2: 0.0}, 4)[0]
    assert (k, m) == (1, 1) and gain < 1
    for bad in ({}, {4: 0.5}):
        with pytest.raises(ValueError, match="draft_plans"):
            draft_plans(bad, 4)
    # the timed choice is one of the plans given, with a positive speed against greedy decoding
    gpt = tiny_gpt(0)
    k, m, speed = fastest_draft(gpt, torch.zeros(1, 3, dtype=torch.long), [(2, 1, 1.0), (1, 2, 1.0)], 6, rounds=1)
    assert (k, m) in ((2, 1), (1, 2)) and speed > 0
    with pytest.raises(ValueError, match="at least one draft plan"):
        fastest_draft(gpt, torch.zeros(1, 3, dtype=torch.long), [], 6)

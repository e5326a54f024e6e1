"""Generation with early exits for Hugging Face causal LMs: the model's own greedy tokens without exits, the cache
after mixed exits against a row-by-row reference, batch 8 equal to eight batch-1 runs, skipped blocks, refusals."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import KINDS, reference_run, tiny_hf, tokens, tolerance  # noqa: E402

from learn2stop.tasks.lm.hf import attach_exits  # noqa: E402
from learn2stop.tasks.lm.hf_generate import generate  # noqa: E402


def confidence_rule(threshold: float):
    """Stop a row once its exit's top probability reaches ``threshold``."""
    return lambda t, logits, h, h_prev: logits.softmax(-1).amax(-1) >= threshold


def median_confidence(view, prompt) -> float:
    """A threshold that stops about half the positions at the first exit (mixed exits)."""
    with torch.no_grad():
        state = view.step(1, view.initial_state(prompt), prompt)
        return float(view.readout(1, state, prompt).softmax(-1).amax(-1).median())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("length", [1, 5])
def test_without_exits_generation_is_the_models_own_greedy_decoding(kind, length):
    model = tiny_hf(kind, "eager")
    prompt = tokens(3, length)
    out = generate(attach_exits(model), prompt, 9)
    theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9, eos_token_id=None,
                            do_sample=False, pad_token_id=0)
    assert torch.equal(out.tokens, theirs)
    assert bool((out.exit_steps == 3).all())


@pytest.mark.parametrize("kind,impl", KINDS)
@pytest.mark.parametrize("exit_every", [1, 2])
def test_the_cache_after_mixed_exits_matches_a_row_by_row_reference(kind, impl, exit_every):
    model = tiny_hf(kind, impl, seed=2, n_layer=4)
    view, prompt, n = attach_exits(model, exit_every), tokens(5, 4), 8
    out = generate(view, prompt, n, confidence_rule(median_confidence(view, prompt)))
    assert any(len(set(col.tolist())) > 1 for col in out.exit_steps.T), "no step where rows exit at different layers"
    fed = prompt.shape[1] + n - 1  # positions in the cache: the prompt and every new token but the last
    assert out.cache.length == fed
    for b in range(prompt.shape[0]):
        exits = [4] * (prompt.shape[1] - 1) + [view.exit_layers[s - 1] for s in out.exit_steps[b]]
        with torch.no_grad():
            logits, kv = reference_run(model, out.tokens[b, :fed], exits)
        assert torch.equal(logits[prompt.shape[1] - 1:].argmax(-1), out.tokens[b, prompt.shape[1]:])
        for layer, (k, v) in enumerate(kv):
            torch.testing.assert_close(out.cache.k[layer][b, :, :fed], k, rtol=0, atol=tolerance(kind, impl))
            torch.testing.assert_close(out.cache.v[layer][b, :, :fed], v, rtol=0, atol=tolerance(kind, impl))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_batch_of_eight_equals_eight_single_runs(kind):
    model = tiny_hf(kind, "sdpa", seed=4, n_layer=4)
    view, prompt = attach_exits(model), tokens(8, 3, seed=9)
    rule = confidence_rule(median_confidence(view, prompt))
    out = generate(view, prompt, 7, rule)
    assert len(set(out.exit_steps.flatten().tolist())) > 1
    for b in range(8):
        one = generate(view, prompt[b:b + 1], 7, rule)
        assert torch.equal(one.tokens[0], out.tokens[b]) and torch.equal(one.exit_steps[0], out.exit_steps[b])
        for layer in range(4):
            torch.testing.assert_close(one.cache.k[layer][0], out.cache.k[layer][b], rtol=0, atol=1e-10)


def test_rows_that_stop_at_the_first_exit_run_no_later_block():
    model = tiny_hf("llama", n_layer=3)
    view = attach_exits(model)  # before the hooks: attaching runs the model once on a probe
    seen = []
    hooks = [b.mlp.register_forward_hook(lambda m, args, out, i=i: seen.append(i))
             for i, b in enumerate(model.model.layers)]
    out = generate(view, tokens(4, 1), 5, lambda t, logits, h, h_prev: torch.ones(len(logits), dtype=torch.bool))
    for h in hooks:
        h.remove()
    assert seen == [0] * 5 and bool((out.exit_steps == 1).all())
    assert out.cache.k[2].abs().sum() > 0  # the skipped layers' cache was filled by propagation


def test_bad_prompts_are_refused():
    view = attach_exits(tiny_hf("gpt2"))
    cases = [(torch.zeros(2, 3), 4, r"prompt must be a \(batch, length\) tensor of token ids"),
             (torch.zeros(0, 3, dtype=torch.long), 4, r"at least one row and one token; got shape \(0, 3\)"),
             (torch.zeros(2, 3, dtype=torch.long), 0, r"max_new_tokens must be an integer >= 1; got 0"),
             (torch.zeros(1, 1000, dtype=torch.long), 26, r"prompt \+ max_new_tokens - 1 length \(1025\) exceeds "
                                                        r"the model's positions \(1024\)"),
             (torch.full((1, 3), 50), 4, r"token id 50, outside the model's vocabulary of 50")]
    for prompt, n, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(view, prompt, n)

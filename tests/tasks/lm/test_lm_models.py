"""The GPT's step-wise view: the full model's logits when no token stops, and a stopped token's logits and the
later tokens' with CALM's state propagation, against a row-by-row, token-by-token reference."""
from __future__ import annotations

import pytest
import torch
from lm_reference import reference_run, tiny_gpt

from learn2stop.core.loop import unroll
from learn2stop.tasks.lm import GPT, GPTConfig, StepwiseGPT, score_with_exits
from learn2stop.tasks.lm.train import fit_propagation
from learn2stop.utils.config import ConfigError


@pytest.mark.parametrize("exit_every,n_layer", [(1, 4), (2, 3)])
def test_no_stop_gives_the_full_models_logits_exactly(exit_every, n_layer):
    gpt = tiny_gpt(1, n_layer=n_layer, exit_every=exit_every)
    view = StepwiseGPT(gpt)
    idx = torch.randint(13, (3, 11), generator=torch.Generator().manual_seed(2))
    rollout = unroll(view, idx, model_grad=False, keep_outputs=True)  # the core's loop drives the view
    assert view.num_steps == len(gpt.cfg.exit_layers) == len(rollout.step_outputs)
    assert torch.equal(rollout.step_outputs[-1], gpt(idx))
    h = gpt.embed(idx)  # each exit is the shared head after its blocks
    for t, layer in enumerate(gpt.cfg.exit_layers, start=1):
        for block in gpt.blocks[gpt.cfg.exit_layers[t - 2] if t > 1 else 0:layer]:
            h = block(h)
        assert torch.equal(rollout.step_outputs[t - 1], gpt.head(h))
    logits, exits = score_with_exits(view, idx, lambda t, out, h, h_prev: torch.zeros(out.shape[:2], dtype=torch.bool))
    assert torch.equal(logits, gpt(idx)) and bool((exits == view.num_steps).all())


def test_exit_layers_every_k_and_the_last():
    assert GPTConfig(n_layer=7, exit_every=3).exit_layers == [3, 6, 7]
    assert GPTConfig(n_layer=6, exit_every=2).exit_layers == [2, 4, 6]
    view = StepwiseGPT(tiny_gpt(0, n_layer=5, exit_every=2))
    assert [list(view.layers_of(t)) for t in (1, 2, 3)] == [[1, 2], [3, 4], [5]]
    assert view.exit_costs == [2.0, 4.0, 5.0]


@pytest.mark.parametrize("propagation", ["copy", "learned"])
@pytest.mark.parametrize("exit_every", [1, 2])
def test_early_exit_with_state_propagation_matches_the_token_by_token_reference(propagation, exit_every):
    gpt = tiny_gpt(3, n_layer=4, exit_every=exit_every, propagation=propagation)
    view = StepwiseGPT(gpt)
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(13, (3, 10), generator=g)
    planned = torch.randint(1, view.num_steps + 1, idx.shape, generator=g)  # (B, T) exit step of each position
    planned[0] = view.num_steps  # a row where nothing stops, beside rows with mixed exits
    logits, exits = score_with_exits(view, idx, lambda t, out, h, h_prev: planned == t)
    assert torch.equal(exits, planned) and len(set(planned[1:].flatten().tolist())) == view.num_steps
    layers = torch.tensor(gpt.cfg.exit_layers)[planned - 1]  # (B, T) exit layer of each position
    for b in range(idx.shape[0]):
        expected, _ = reference_run(gpt, idx[b], layers[b].tolist())
        torch.testing.assert_close(logits[b], expected, rtol=0, atol=1e-10)
    # the row where nothing stops is the full model's (to float64 rounding: beside other rows, its matmuls may
    # split differently)
    torch.testing.assert_close(logits[0], gpt(idx[:1])[0], rtol=0, atol=1e-12)


def test_state_propagation_is_what_later_tokens_read():
    """A learned propagation map that is not the identity changes the tokens after a stopped one, and only them."""
    gpt = tiny_gpt(5, propagation="learned")
    view = StepwiseGPT(gpt)
    idx = torch.randint(13, (1, 9), generator=torch.Generator().manual_seed(6))
    planned = torch.full(idx.shape, view.num_steps)
    planned[0, 4] = 1  # position 4 stops after layer 1
    before, _ = score_with_exits(view, idx, lambda t, out, h, h_prev: planned == t)
    with torch.no_grad():
        for m in gpt.propagate_maps:
            m.weight.mul_(0.5)
    after, _ = score_with_exits(view, idx, lambda t, out, h, h_prev: planned == t)
    assert torch.equal(before[0, :5], after[0, :5])
    assert (before[0, 5:] - after[0, 5:]).abs().amax(-1).min() > 1e-6


def test_learned_propagation_starts_as_copy():
    copy = GPT(GPTConfig(vocab_size=11, context=8, n_layer=3, n_head=2, n_embd=16)).double()
    learned = GPT(GPTConfig(vocab_size=11, context=8, n_layer=3, n_head=2, n_embd=16, propagation="learned")).double()
    learned.load_state_dict(copy.state_dict(), strict=False)
    h = torch.randn(2, 5, 16, dtype=torch.float64)
    for layer in (2, 3):
        for a, b in zip(copy.propagated_kv(layer, h), learned.propagated_kv(layer, h)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("exit_every", [1, 2])
def test_fitted_propagation_gives_a_skipped_layers_keys_and_values_closer_than_copy_on_held_out_tokens(exit_every):
    gpt = tiny_gpt(7, propagation="learned", exit_every=exit_every)
    unreached = gpt.propagate_maps[0].weight.clone()  # layer 2: with exits every 2 blocks, no token skips it
    g = torch.Generator().manual_seed(8)
    err = fit_propagation(gpt, torch.randint(13, (32, 24), generator=g))
    assert 0 <= err["fitted"] < err["copy"]
    held = torch.randint(13, (16, 24), generator=g)
    with torch.no_grad():
        states = [gpt.embed(held)]
        for block in gpt.blocks:
            states.append(block(states[-1]))
        fitted = copied = 0.0
        for layer in range(2, gpt.cfg.n_layer + 1):
            block = gpt.blocks[layer - 1]
            true = torch.cat(block.attn.kv(block.ln_1(states[layer - 1])))
            for k in (k for k in gpt.cfg.exit_layers if k < layer):
                fitted += float((torch.cat(gpt.propagated_kv(layer, states[k])) - true).pow(2).sum())
                copied += float((torch.cat(block.attn.kv(block.ln_1(states[k]))) - true).pow(2).sum())
    assert fitted < copied
    assert torch.equal(gpt.propagate_maps[0].weight, unreached) == (exit_every == 2)
    with pytest.raises(ValueError, match="propagates by copy"):
        fit_propagation(tiny_gpt(7), held)


def test_the_lm_head_is_tied_to_the_token_embedding():
    gpt = GPT(GPTConfig(vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=16))
    assert gpt.lm_head.weight is gpt.wte.weight


@pytest.mark.parametrize("fields,field", [
    ({"n_embd": 18, "n_head": 4}, "n_embd"), ({"n_layer": 2, "exit_every": 3}, "exit_every"),
    ({"propagation": "mlp"}, "propagation"), ({"context": 0}, "context"), ({"vocab_size": 0}, "vocab_size"),
    ({"dropout": 1.0}, "dropout")])
def test_bad_config_names_the_field(fields, field):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**fields)


def test_a_sequence_longer_than_the_context_is_refused():
    gpt = tiny_gpt(0, context=8)
    with pytest.raises(ValueError, match="context"):
        StepwiseGPT(gpt).initial_state(torch.zeros(1, 9, dtype=torch.long))


def test_the_cores_loop_stops_whole_sequences_at_their_exits():
    """Driven by the core's early-exit loop, a sequence stopped at step t gets every position's logits of exit t."""
    from learn2stop.core.loop import run_with_early_exit

    gpt = tiny_gpt(8, exit_every=1)
    view = StepwiseGPT(gpt)
    idx = torch.randint(13, (4, 7), generator=torch.Generator().manual_seed(9))
    wanted = torch.tensor([1, 3, 4, 2])  # the step each sequence stops at
    rollout = run_with_early_exit(view, idx, lambda v: wanted[v.index] == v.t)
    assert torch.equal(rollout.stop_times.cpu(), wanted)
    full = unroll(view, idx, model_grad=False, keep_outputs=True).step_outputs
    for b, t in enumerate(wanted.tolist()):
        torch.testing.assert_close(rollout.outputs[b], full[t - 1][b], rtol=0, atol=1e-12)

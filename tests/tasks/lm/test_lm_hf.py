"""The step-wise view of Hugging Face causal LMs (GPT-2 and Llama layouts, tiny random configs, never downloaded):
the model's own logits without a stop, per-position exits against a row-by-row reference, skipped blocks, refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_reference import KINDS, reference_run, run_all, tiny_hf, tokens, tolerance  # noqa: E402

from learn2stop.core.loop import unroll  # noqa: E402
from learn2stop.tasks.lm.hf import HFStepwise, attach_exits  # noqa: E402
from learn2stop.tasks.lm.models import score_with_exits  # noqa: E402


@pytest.mark.parametrize("kind,impl", KINDS)
@pytest.mark.parametrize("exit_every", [1, 2])
def test_without_a_stop_the_last_exit_is_the_models_own_logits(kind, impl, exit_every):
    model = tiny_hf(kind, impl)
    view = attach_exits(model, exit_every)
    assert view.exit_layers == ([1, 2, 3] if exit_every == 1 else [2, 3])
    assert view.exit_costs == [float(k) for k in view.exit_layers]
    idx = tokens(3, 11)
    with torch.no_grad():
        ours, theirs = run_all(view, idx), model(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    rollout = unroll(view, idx, model_grad=False)
    torch.testing.assert_close(rollout.outputs, theirs, rtol=0, atol=1e-10)  # the core's loop drives the view


@pytest.mark.parametrize("kind,impl", KINDS)
@pytest.mark.parametrize("exit_every", [1, 2])
def test_per_position_exits_match_a_row_by_row_reference(kind, impl, exit_every):
    model = tiny_hf(kind, impl, seed=1, n_layer=4)
    view = attach_exits(model, exit_every)
    idx = tokens(3, 9)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logits, exits = score_with_exits(view, idx, lambda t, z, h, h_prev: torch.rand(z.shape[:2], generator=g) < 0.4)
    assert len(set(exits.flatten().tolist())) == view.num_steps, "every exit should be used somewhere"
    full = model(idx).logits.detach()
    assert (logits - full).abs().amax() > 1e-3, "early exits that change no logit test nothing"
    for b in range(idx.shape[0]):
        with torch.no_grad():
            ref, _ = reference_run(model, idx[b], [view.exit_layers[s - 1] for s in exits[b]])
        torch.testing.assert_close(logits[b], ref, rtol=0, atol=tolerance(kind, impl))


def test_the_reference_itself_is_the_models_forward_without_exits():
    for kind in ("gpt2", "llama"):
        model = tiny_hf(kind, "sdpa")
        idx = tokens(1, 7)
        with torch.no_grad():
            ref, _ = reference_run(model, idx[0], [3] * 7)
            torch.testing.assert_close(ref, model(idx).logits[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_stopped_positions_run_no_later_block(kind):
    model = tiny_hf(kind, n_layer=4)
    view = attach_exits(model)
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    seen = []
    hooks = [b.mlp.register_forward_hook(lambda m, args, out, i=i: seen.append((i, args[0].shape[:-1].numel())))
             for i, b in enumerate(blocks)]
    idx = tokens(2, 8)
    stops = {1: torch.tensor([[1, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool),
             2: torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)}
    with torch.no_grad():
        state = view.initial_state(idx)
        for t in range(1, 5):
            state = view.step(t, state, idx)
            if t in stops:
                state = view.stop(state, stops[t])
    for h in hooks:
        h.remove()
    assert seen == [(0, 16), (1, 13), (2, 9), (3, 9)]  # 16 positions, 3 stop after block 1, 4 more after block 2


def test_gradients_reach_the_models_weights():
    model = tiny_hf("llama")
    view = attach_exits(model)
    idx = tokens(2, 6)
    state = view.initial_state(idx)
    state = view.stop(view.step(1, state, idx), torch.rand(2, 6, generator=torch.Generator().manual_seed(0)) < 0.5)
    view.readout(2, view.step(2, state, idx), idx).logsumexp(-1).sum().backward()
    grads = [model.model.layers[1].self_attn.k_proj.weight.grad, model.model.embed_tokens.weight.grad]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_model_of_another_layout_is_refused_naming_it():
    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.ModuleList([nn.Linear(4, 4)])
            self.lm_head = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"Mystery: found neither transformer.h nor model.layers"):
        attach_exits(Mystery())
    with pytest.raises(ValueError, match=r"Mystery: no lm_head"):
        attach_exits(type("Mystery", (nn.Module,), {})())
    model = tiny_hf("llama")
    model.model.layers[1].self_attn.q_norm = nn.LayerNorm(8)  # a Qwen3-style part the view would not run
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: block 1 has parts outside the known layout: \['q_norm'\]"):
        attach_exits(model)


def test_a_model_whose_forward_the_view_does_not_reproduce_is_refused():
    cfg = transformers.GraniteConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=50, residual_multiplier=0.5)
    granite = transformers.GraniteForCausalLM(cfg).double().eval()  # Llama's parts, but residuals scaled by 0.5
    with pytest.raises(ValueError, match=r"GraniteForCausalLM: its blocks were found \(llama layout\) but the "
                                         r"step-wise view does not reproduce its logits"):
        attach_exits(granite)
    assert attach_exits(granite, verify=False).num_steps == 2  # the user's call, at their own risk
    cfg.residual_multiplier = 1.0
    attach_exits(transformers.GraniteForCausalLM(cfg).double().eval())  # multipliers of 1: Llama's forward


def test_bad_arguments_are_refused():
    model = tiny_hf("gpt2")
    for bad in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match=r"exit_every must be an integer in 1\.\.3"):
            HFStepwise(model, bad)
    view = attach_exits(model)
    with pytest.raises(ValueError, match=r"inputs must be a \(batch, length >= 1\) tensor of token ids"):
        view.initial_state(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"sequence length \(1025\) exceeds the model's positions \(1024\)"):
        view.initial_state(torch.zeros(1, 1025, dtype=torch.long))
    flash = tiny_hf("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"attn_implementation 'flash_attention_2' is not supported"):
        attach_exits(flash)

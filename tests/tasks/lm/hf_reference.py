"""Hand-written references for the Hugging Face adapter's tests: tiny random GPT-2 and Llama models (never
downloaded) and a token-by-token, row-by-row run with per-position exits and CALM's propagation."""
from __future__ import annotations

import torch
import transformers
from torch import nn

KINDS = [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager"), ("llama", "sdpa")]


def tiny_hf(kind: str, impl: str = "eager", seed: int = 0, n_layer: int = 3) -> nn.Module:
    """A tiny float64 GPT-2 or Llama (GQA: 4 query heads, 2 key/value heads) with N(0, 0.3^2) weights and norms
    near 1, so that exits disagree, in eval mode."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0,
                                      eos_token_id=0, attn_implementation=impl)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                       attn_implementation=impl)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = ("norm" in name or "ln_" in name) and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if is_norm_weight else 0.0))
    return model


def tokens(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(50, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_all(view, idx):
    state = view.initial_state(idx)
    for t in range(1, view.num_steps + 1):
        state = view.step(t, state, idx)
    return view.readout(view.num_steps, state, idx)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_run(model: nn.Module, idx: torch.Tensor, exit_layer: list[int]):
    """One sequence idx (N,), position i exiting after 1-based layer exit_layer[i], one position at a time with plain
    loops: the (N, V) logits at each exit and per layer the (G, N, d) keys and values each position left. A position
    keeps its hidden state after its exit, and its keys and values there come from that state (CALM's propagation)."""
    gpt2 = hasattr(model, "transformer")
    base = model.transformer if gpt2 else model.model
    blocks = base.h if gpt2 else base.layers
    cfg = model.config
    H = cfg.num_attention_heads
    G = H if gpt2 else cfg.num_key_value_heads
    d = cfg.hidden_size // H
    keys, values = [[] for _ in blocks], [[] for _ in blocks]
    logits = []
    for i, token in enumerate(idx.tolist()):
        h = base.wte.weight[token] + base.wpe.weight[i] if gpt2 else base.embed_tokens.weight[token]  # (C,)
        for layer, block in enumerate(blocks, start=1):
            if gpt2:
                q, k, v = block.attn.c_attn(block.ln_1(h)[None])[0].view(3, H, d)
            else:
                x, a = block.input_layernorm(h), block.self_attn
                cos, sin = (c[0, 0] for c in base.rotary_emb(x[None, None], torch.tensor([[i]])))  # (d,)
                q = _rotate(a.q_proj(x).view(H, d), cos, sin)
                k, v = _rotate(a.k_proj(x).view(G, d), cos, sin), a.v_proj(x).view(G, d)
            keys[layer - 1].append(k)
            values[layer - 1].append(v)
            if layer > exit_layer[i]:
                continue  # stopped: keys and values from the exit state, the hidden state kept
            K, V = torch.stack(keys[layer - 1]), torch.stack(values[layer - 1])  # (i + 1, G, d)
            heads = []
            for head in range(H):
                g = head // (H // G)
                att = torch.softmax((K[:, g] * q[head]).sum(-1) / d ** 0.5, dim=0)  # (i + 1,)
                heads.append((att[:, None] * V[:, g]).sum(0))
            y = torch.cat(heads)  # (C,)
            if gpt2:
                h = h + block.attn.c_proj(y[None])[0]
                h = h + block.mlp(block.ln_2(h)[None])[0]
            else:
                h = h + block.self_attn.o_proj(y)
                h = h + block.mlp(block.post_attention_layernorm(h))
        logits.append(model.lm_head((base.ln_f if gpt2 else base.norm)(h)))
    kv = [(torch.stack(k).transpose(0, 1), torch.stack(v).transpose(0, 1)) for k, v in zip(keys, values)]
    return torch.stack(logits), kv


def tolerance(kind: str, impl: str) -> float:
    """HF's Llama eager attention takes its softmax in float32 (the reference's is float64),
    so its logits agree to float32 precision; the others at float64 precision."""
    return 1e-5 if (kind, impl) == ("llama", "eager") else 1e-10

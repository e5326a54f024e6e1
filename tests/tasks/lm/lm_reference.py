"""Hand-written references for the language-model tests: tiny seeded GPTs and a token-by-token, row-by-row run."""
from __future__ import annotations

import math

import torch

from learn2stop.tasks.lm import GPT, GPTConfig


def tiny_gpt(seed: int = 0, scale: float = 0.4, **overrides) -> GPT:
    """A tiny GPT in float64 with N(0, scale^2) weights (exits that disagree, decisions that vary), in eval mode."""
    cfg = {"vocab_size": 13, "context": 24, "n_layer": 4, "n_head": 2, "n_embd": 16}
    cfg.update(overrides)
    gpt = GPT(GPTConfig(**cfg)).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
        for ln in [m for m in gpt.modules() if isinstance(m, torch.nn.LayerNorm)]:
            ln.weight.add_(1.0)
    return gpt


def reference_run(gpt: GPT, idx: torch.Tensor, exit_layer: list[int]):
    """One sequence idx (N,), position i exiting after 1-based layer exit_layer[i], one position at a time with
    plain loops: the (N, V) logits at each exit and per layer the (H, N, d) keys and values each position left
    (its own below its exit, propagated from its exit hidden state above it)."""
    cfg = gpt.cfg
    H, d = cfg.n_head, cfg.n_embd // cfg.n_head
    keys = [[] for _ in range(cfg.n_layer)]
    values = [[] for _ in range(cfg.n_layer)]
    logits = []
    for i, token in enumerate(idx.tolist()):
        h = gpt.wte.weight[token] + gpt.wpe.weight[i]  # (C,)
        for layer in range(1, cfg.n_layer + 1):
            block = gpt.blocks[layer - 1]
            if layer <= exit_layer[i]:
                q, k, v = block.attn.c_attn(block.ln_1(h)).view(3, H, d)
                keys[layer - 1].append(k)
                values[layer - 1].append(v)
                K, V = torch.stack(keys[layer - 1]), torch.stack(values[layer - 1])  # (i + 1, H, d)
                att = torch.softmax((K * q).sum(-1) / math.sqrt(d), dim=0)  # (i + 1, H)
                y = (att[:, :, None] * V).sum(0).reshape(-1)  # (C,)
                h = h + block.attn.c_proj(y)
                h = h + block.mlp(block.ln_2(h))
            else:
                x = gpt.propagate_maps[layer - 2](h) if gpt.propagate_maps is not None else h
                _, k, v = block.attn.c_attn(block.ln_1(x)).view(3, H, d)
                keys[layer - 1].append(k)
                values[layer - 1].append(v)
        logits.append(gpt.lm_head(gpt.ln_f(h)))
    kv = [(torch.stack(k).transpose(0, 1), torch.stack(v).transpose(0, 1)) for k, v in zip(keys, values)]
    return torch.stack(logits), kv


def greedy_reference(gpt: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Full-depth greedy continuation of prompt (B, T0) by n tokens, the whole window re-run each time (no cache).
    The window is the tokens since ``start``; once it would pass the context (the cache full before the next token),
    it restarts from the last context // 2 tokens fed before the newest one."""
    tokens, start, C = prompt, 0, gpt.cfg.context
    for _ in range(n):
        if tokens.shape[1] - start > C:
            start = tokens.shape[1] - 1 - C // 2
        tokens = torch.cat([tokens, gpt(tokens[:, start:])[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens

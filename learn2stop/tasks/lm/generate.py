"""Generation with a KV cache where each new token may exit early, and LayerSkip's self-speculative decoding.

At each new token every row starts at layer 1; after each exit layer the rows the exit rule stops leave the batch for
the remaining layers, and their cache entries of those layers are completed by state propagation
(:meth:`GPT.propagated_kv`); the next token starts again with every row. Decoding is greedy (argmax at the exit).
Shapes as in :mod:`.models`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .models import GPT, StepwiseGPT
from .rules import as_exit_rule, fixed_depth, reads_logits


class KVCache:
    """Per layer keys and values of the first ``length`` positions: ``k[l]``, ``v[l]`` (B, H, context, d) of
    ``k``, ``v`` (L, B, H, context, d)."""

    def __init__(self, gpt: GPT, batch: int, like: Tensor):
        cfg = gpt.cfg
        shape = (cfg.n_layer, batch, cfg.n_head, cfg.context, cfg.n_embd // cfg.n_head)
        self.k, self.v = like.new_zeros(shape), like.new_zeros(shape)
        self.length = 0

    def store(self, layer: int, rows: Tensor | None, start: int):
        """The ``store`` of :meth:`~.models.Block.cached` at 0-based ``layer`` for the rows ``rows`` (None: all):
        ``store(k, v)`` writes (B_rows, H, N, d) keys and values at positions start..start + N - 1 and returns the
        rows' cached (B_rows, H, start + N, d) ones (a view of the cache when every row runs)."""
        def store(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            self.write(layer, rows, k, v, start)
            end = start + k.shape[2]
            keys, values = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
            return (keys, values) if rows is None else (keys[rows], values[rows])
        return store

    def write(self, layer: int, rows: Tensor | None, k: Tensor, v: Tensor, start: int) -> None:
        """Store (B_rows, H, N, d) keys and values at positions start..start + N - 1 of 0-based ``layer``."""
        end = start + k.shape[2]
        if rows is None:
            self.k[layer][:, :, start:end], self.v[layer][:, :, start:end] = k, v
        else:
            self.k[layer][rows, :, start:end], self.v[layer][rows, :, start:end] = k, v

    def write_from(self, layer: int, rows: Tensor, k: Tensor, v: Tensor, pos: int) -> None:
        """Store (L - layer, B_rows, H, d) keys and values of 0-based layers ``layer``..L-1 at position ``pos``."""
        self.k[layer:, :, :, pos][:, rows], self.v[layer:, :, :, pos][:, rows] = k, v


def check_prompt(gpt: GPT, prompt: Tensor, max_new_tokens: int, window: bool = False) -> None:
    """Refuse a prompt that the model cannot continue by ``max_new_tokens`` tokens, naming the problem; with
    ``window`` (a :class:`ContextWindow` decodes) the continuation may go past the context."""
    cfg = gpt.cfg
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.dtype != torch.long:
        raise ValueError(f"prompt must be a (batch, length) tensor of token ids (torch.long); got "
                         f"{type(prompt).__name__} {getattr(prompt, 'shape', '')} {getattr(prompt, 'dtype', '')}")
    B, T0 = prompt.shape
    if B == 0:
        raise ValueError("prompt: batch must be at least 1; got an empty batch (0 rows)")
    if T0 == 0:
        raise ValueError("prompt must hold at least one token; got length 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    if T0 > cfg.context:
        raise ValueError(f"prompt length ({T0}) exceeds the model's context ({cfg.context})")
    if not window and T0 + max_new_tokens - 1 > cfg.context:
        raise ValueError(f"prompt length ({T0}) + max_new_tokens ({max_new_tokens}) - 1 exceeds the model's context "
                         f"({cfg.context}): the last new token would be predicted from beyond it")
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"prompt holds token id {high if high >= cfg.vocab_size else low}, outside the model's "
                         f"vocabulary of {cfg.vocab_size} (a prompt encoded with another run's vocabulary?)")


class ContextWindow:
    """The tokens a KV cache holds, so that decoding can go past the model's context: when the cache is full, its
    last ``context // 2`` tokens are run again at full depth from position 0 and decoding goes on after them.

    The model's positions are absolute, so a cache shifted in place would hold keys it was never trained on; this is
    nanoGPT's crop of the input to the last ``context`` tokens, paid once every ``context - context // 2`` tokens
    instead of at every token. The re-run tokens get full-depth keys and values, wherever they had exited.
    """

    def __init__(self, gpt: GPT, cache: KVCache, held: Tensor):
        self.gpt, self.cache, self.chunks = gpt, cache, [held]  # held (B, cache.length): the tokens in the cache
        self.keep = gpt.cfg.context // 2

    def fed(self, tokens: Tensor) -> None:
        """Record tokens (B, n) just written to the cache."""
        self.chunks.append(tokens)

    def make_room(self) -> None:
        """Before a token is fed: if the cache is full, restart it from its last ``keep`` tokens."""
        if self.cache.length < self.gpt.cfg.context:
            return
        recent = torch.cat(self.chunks, 1)[:, self.cache.length - self.keep:]
        self.cache.length = 0
        if recent.shape[1]:
            prefill(self.gpt, self.cache, recent)
        self.chunks = [recent]


@dataclass
class Generation:
    """What :func:`generate` returns: tokens (B, T0 + n), the (B, n) 1-based exit step of each new token, and the
    cache (the window's positions: the last new token is not fed back)."""

    tokens: Tensor
    exit_steps: Tensor
    cache: KVCache


def prefill(gpt: GPT, cache: KVCache, idx: Tensor) -> Tensor:
    """Run idx (B, N) at full depth after the cached positions, caching every layer: the last hidden state (B, C)."""
    h = gpt.embed(idx, cache.length)
    for layer, block in enumerate(gpt.blocks):
        h = block.cached(h, cache.store(layer, None, cache.length))
    cache.length += idx.shape[1]
    return h[:, -1]


@torch.no_grad()
def generate(view: StepwiseGPT, prompt: Tensor, max_new_tokens: int, exit_rule=None, on_token=None) -> Generation:
    """Greedy continuation of prompt (B, T0) by ``max_new_tokens`` tokens, each exiting where ``exit_rule`` says.

    ``exit_rule(t, logits, h, h_prev) -> (B_active,) bool`` is asked after exit step t = 1..T-1 with the rows still
    running: their (B_active, V) logits at the exit, their (B_active, C) hidden state there and at the exit before
    (the embedding at t = 1) (None: no early exit). The prompt but its last token is prefilled at full depth; every new
    token is predicted at an exit. The continuation may be longer than the context (:class:`ContextWindow`).
    ``on_token(token (B,), exit_step (B,))`` is called with each new token as it comes (streaming).
    """
    gpt = view.gpt
    check_prompt(gpt, prompt, max_new_tokens, window=True)
    B = prompt.shape[0]
    cache = KVCache(gpt, B, gpt.wte.weight)
    if prompt.shape[1] > 1:
        prefill(gpt, cache, prompt[:, :-1])
    window = ContextWindow(gpt, cache, prompt[:, :-1])
    folded = folded_propagations(view) if fixed_depth(exit_rule, view.num_steps) is None else None

    def decode(token: Tensor) -> tuple[Tensor, Tensor]:
        window.make_room()
        out = decode_token(view, cache, token, exit_rule, folded)
        window.fed(token[:, None])
        return out

    return greedy_continuation(prompt, max_new_tokens, cache, decode, on_token)


def greedy_continuation(prompt: Tensor, max_new_tokens: int, cache, decode, on_token=None) -> Generation:
    """Feed the prompt's last token, then each new greedy token, ``max_new_tokens`` times through
    ``decode(token (B,)) -> ((B, V) logits, (B,) exit steps)`` (which advances ``cache``), telling ``on_token`` each
    new token and its exit steps: the one decoding loop of every step-wise language model here."""
    token, new, exits = prompt[:, -1], [], []
    for _ in range(max_new_tokens):
        logits, exit_step = decode(token)
        token = logits.argmax(-1)
        new.append(token)
        exits.append(exit_step)
        if on_token is not None:
            on_token(token, exit_step)
    return Generation(torch.cat([prompt, torch.stack(new, 1)], 1), torch.stack(exits, 1), cache)


def folded_propagations(view: StepwiseGPT) -> dict[int, tuple[Tensor, Tensor] | None]:
    """For every layer a stopped token can skip first, :meth:`GPT.folded_propagation` of the layers from it on."""
    return {k + 1: view.gpt.folded_propagation(k + 1) for k in view.exit_layers[:-1]}


def decode_token(view: StepwiseGPT, cache: KVCache, token: Tensor, exit_rule=None,
                 folded: dict | None = None) -> tuple[Tensor, Tensor]:
    """Feed token (B,) at position ``cache.length`` with early exits: the (B, V) logits of each row at its exit and
    its (B,) exit step; the rows that stop leave the batch and get their later layers' cache by propagation (in one
    product per stop with ``folded``, :func:`folded_propagations`; else layer by layer)."""
    gpt, pos = view.gpt, cache.length

    def run_layers(t: int, h: Tensor, rows: Tensor | None) -> Tensor:
        for layer in view.layers_of(t):
            h = gpt.blocks[layer - 1].cached(h, cache.store(layer - 1, rows, pos))
        return h

    def complete(t: int, h: Tensor, stopped: Tensor) -> None:
        first = view.exit_layers[t - 1] + 1  # the first layer the stopped rows skip
        if folded is None or folded[first] is None:
            for layer in range(first, gpt.cfg.n_layer + 1):
                cache.write(layer - 1, stopped, *gpt.propagated_kv(layer, h), pos)
            return
        w, b = folded[first]  # every skipped layer's keys and values in one product
        H = gpt.cfg.n_head
        kv = F.linear(F.layer_norm(h[:, 0], h.shape[-1:], eps=gpt.blocks[0].ln_1.eps), w, b)  # (n, 2C (L - first + 1))
        kv = kv.view(h.shape[0], -1, 2, H, h.shape[-1] // H).transpose(0, 1)  # (L - first + 1, n, 2, H, d)
        cache.write_from(first - 1, stopped, kv[:, :, 0], kv[:, :, 1], pos)

    out = exit_rows(view.num_steps, gpt.embed(token[:, None], pos), run_layers, gpt.head, complete, exit_rule)
    cache.length = pos + 1
    return out


def exit_rows(num_steps: int, h: Tensor, run_layers, head, complete, exit_rule=None) -> tuple[Tensor, Tensor]:
    """One decoding position of a batch with per-row early exit, for any decoder: ``h`` (B, 1, C) the rows'
    embeddings; ``run_layers(t, h, rows)`` runs step t's layers on the rows still going (``rows`` None: all of them;
    else their (B_active,) indices) and caches their keys and values; ``head`` the exits' readout; ``complete(t, h,
    stopped)`` fills the later layers' cache of the rows that stop at step t. Returns the (B, V) logits of each row at
    its exit and its (B,) exit step (``exit_rule(t, logits, h, h_prev)`` None: every row runs to the last step; a
    rule that does not read the logits, :func:`~.rules.reads_logits`, gets None for them and the head runs only
    where rows stop). A rule that stops every row at one step (:func:`~.rules.fixed_depth`) runs that many steps and
    the head once, as a truncated model: nothing is asked, and the later layers, which no token reaches, are not
    completed."""
    B, exit_rule = h.shape[0], as_exit_rule(exit_rule)
    depth = fixed_depth(exit_rule, num_steps)
    if depth is not None:
        for t in range(1, depth + 1):
            h = run_layers(t, h, None)
        return head(h[:, 0]), torch.full((B,), depth, dtype=torch.long, device=h.device)
    h_prev = h[:, 0]  # (B_active, C) the hidden state at the previous exit (the embedding before the first)
    rows = None  # None: every row (no gather); else the (B_active,) rows still running
    logits = None
    exit_steps = torch.full((B,), num_steps, dtype=torch.long, device=h.device)
    every_exit = reads_logits(exit_rule)  # else the head runs where a row stops only

    def keep(where, out: Tensor) -> None:
        nonlocal logits
        if logits is None:
            logits = out.new_empty(B, out.shape[-1])
        logits[where] = out

    for t in range(1, num_steps + 1):
        h = run_layers(t, h, rows)
        x = h[:, 0]  # (B_active, C)
        if t == num_steps:  # what still runs stops here
            keep(slice(None) if rows is None else rows, head(x))
            break
        out = head(x) if every_exit else None  # (B_active, V) the exit's logits
        stops = exit_rule(t, out, x, h_prev)  # (B_active,) bool
        h_prev = x
        if not stops.any():
            continue
        here = torch.arange(B, device=h.device) if rows is None else rows
        stopped = here[stops]
        keep(stopped, out[stops] if out is not None else head(x[stops]))
        exit_steps[stopped] = t
        complete(t, h[stops], stopped)
        going = ~stops
        rows, h, h_prev = here[going], h[going], h_prev[going]
        if rows.numel() == 0:
            break
    return logits, exit_steps

"""Greedy generation with early exits for Hugging Face causal LMs (:class:`~.hf.HFStepwise`), at batch > 1.

The same scheme as :mod:`.generate` for the library's GPT, on the model's own blocks: the prompt but its last token is
prefilled at full depth; for each new token every row starts at layer 1, and after each exit the rows that
``exit_rule`` stops leave the batch for the remaining layers. Their exit logits are kept and their cache entries of the
layers they skip are filled by CALM's state propagation (:meth:`HFStepwise.propagated_kv`, rotary at the token's
position for Llama). The cache is this module's own (per layer (B, G, capacity, d)), not transformers' DynamicCache,
because rows write different layers at the same position. Shapes as in :mod:`.hf`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .generate import Generation, exit_rows, greedy_continuation
from .hf import HFStepwise


class HFCache:
    """Per layer keys and values of the first ``length`` positions: ``k[l]``, ``v[l]`` (B, G, capacity, d), made at
    the first write of each layer."""

    def __init__(self, n_layer: int, batch: int, capacity: int):
        self.batch, self.capacity, self.length = batch, capacity, 0
        self.k: list[Tensor | None] = [None] * n_layer
        self.v: list[Tensor | None] = [None] * n_layer

    def past(self, layer: int, rows: Tensor | None, end: int) -> tuple[Tensor, Tensor]:
        """The cached (B_rows, G, end, d) keys and values of positions 0..end - 1 of 0-based ``layer``."""
        k, v = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        return (k, v) if rows is None else (k[rows], v[rows])

    def write(self, layer: int, rows: Tensor | None, k: Tensor, v: Tensor, start: int) -> None:
        """Store (B_rows, G, N, d) keys and values at positions start..start + N - 1 of 0-based ``layer``."""
        if self.k[layer] is None:
            shape = (self.batch, k.shape[1], self.capacity, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        end, rows = start + k.shape[2], slice(None) if rows is None else rows
        self.k[layer][rows, :, start:end], self.v[layer][rows, :, start:end] = k, v


def check_prompt(view: HFStepwise, prompt: Tensor, max_new_tokens: int) -> None:
    """Refuse a prompt that the model cannot continue by ``max_new_tokens`` tokens, naming the problem."""
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.dtype != torch.long:
        shape, dtype = tuple(getattr(prompt, "shape", ())), getattr(prompt, "dtype", "")
        raise ValueError(f"prompt must be a (batch, length) tensor of token ids (torch.long); got "
                         f"{type(prompt).__name__} {shape} {dtype}")
    B, T0 = prompt.shape
    if B == 0 or T0 == 0:
        raise ValueError(f"prompt must hold at least one row and one token; got shape {(B, T0)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    view.layout.check_length(T0 + max_new_tokens - 1, what="prompt + max_new_tokens - 1")
    vocab = view.layout.head.out_features
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"prompt holds token id {high if high >= vocab else low}, outside the model's vocabulary of "
                         f"{vocab}")


def prefill(view: HFStepwise, cache: HFCache, idx: Tensor) -> Tensor:
    """Run idx (B, N) at full depth after the cached positions, caching every layer: the last hidden state (B, C)."""
    lay, start, N = view.layout, cache.length, idx.shape[1]
    h = lay.embed(idx, start)
    pos = torch.arange(start, start + N, device=idx.device)
    allowed = (torch.arange(start + N, device=idx.device) <= pos[:, None])[None]  # (1, N, start + N)
    for layer in range(1, view.n_layer + 1):
        q, k, v = lay.qkv(layer, h, pos[None])
        cache.write(layer - 1, None, k, v, start)
        h = lay.finish(layer, h, lay.attend(layer, q, *cache.past(layer - 1, None, start + N), allowed))
    cache.length += N
    return h[:, -1]


def decode_token(view: HFStepwise, cache: HFCache, token: Tensor, exit_rule=None) -> tuple[Tensor, Tensor]:
    """Feed token (B,) at position ``cache.length`` with early exits: the (B, V) logits of each row at its exit and
    its (B,) exit step; the rows that stop leave the batch and get their later layers' cache by propagation
    (:func:`~learn2stop.tasks.lm.generate.exit_rows`)."""
    lay, p = view.layout, cache.length
    pos = torch.full((1, 1), p, device=token.device)

    def run_layers(t: int, h: Tensor, rows: Tensor | None) -> Tensor:
        for layer in view.layers_of(t):
            q, k, v = lay.qkv(layer, h, pos)
            cache.write(layer - 1, rows, k, v, p)
            h = lay.finish(layer, h, lay.attend(layer, q, *cache.past(layer - 1, rows, p + 1), None))
        return h

    def complete(t: int, h: Tensor, stopped: Tensor) -> None:
        for layer in range(view.exit_layers[t - 1] + 1, view.n_layer + 1):
            cache.write(layer - 1, stopped, *view.propagated_kv(layer, h, pos), p)

    out = exit_rows(view.num_steps, lay.embed(token[:, None], p), run_layers, view.head, complete, exit_rule)
    cache.length = p + 1
    return out


@torch.no_grad()
def generate(view: HFStepwise, prompt: Tensor, max_new_tokens: int, exit_rule=None) -> Generation:
    """Greedy continuation of prompt (B, T0) by ``max_new_tokens`` tokens, each exiting where ``exit_rule`` says.

    ``exit_rule(t, logits, h, h_prev) -> (B_active,) bool`` is asked after exit step t = 1..T-1 with the (B_active, V)
    logits, the hidden state there and at the previous exit (the embedding at t = 1) of the rows still running
    (None: no early exit, the model's own greedy decoding). Returns tokens (B, T0 + n), the (B, n) exit steps and
    the :class:`HFCache` (positions 0..T0 + n - 2).
    """
    check_prompt(view, prompt, max_new_tokens)
    B, T0 = prompt.shape
    cache = HFCache(view.n_layer, B, T0 + max_new_tokens - 1)
    if T0 > 1:
        prefill(view, cache, prompt[:, :-1])
    return greedy_continuation(prompt, max_new_tokens, cache, lambda token: decode_token(view, cache, token, exit_rule))

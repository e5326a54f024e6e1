"""The library's small GPT (nanoGPT's shape) and its step-wise view, where a token can stop after any exit layer.

B is the batch, T the sequence length, C = n_embd, H = n_head, d = C / H, V = vocab_size, L = n_layer.

A token that stops at layer k leaves layers k+1..L without its keys and values, which later tokens attend to. CALM's
state propagation fills them from the stopped token's hidden state at its exit, with each later layer's own key/value
projection (after a per-layer linear map when ``propagation="learned"``, fitted by
:func:`~.train.fit_propagation`): a cheap projection, no block. The readout at every exit is the model's own final
LayerNorm and LM head (shared by every exit, as in CALM and LayerSkip).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GPTConfig
from .rules import as_exit_rule, fixed_depth, reads_logits


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, split into its projections so that keys and values can be made alone."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v of every head at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def heads(self, x: Tensor) -> Tensor:
        """(B, N, C) -> (B, H, N, d)."""
        B, N, C = x.shape
        return x.view(B, N, self.n_head, C // self.n_head).transpose(1, 2)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries, keys and values of normalised x (B, N, C), each (B, H, N, d)."""
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.heads(q), self.heads(k), self.heads(v)

    def kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values alone of normalised x (B, N, C), each (B, H, N, d): the query third is not computed."""
        C = x.shape[-1]
        k, v = F.linear(x, self.c_attn.weight[C:], self.c_attn.bias[C:]).chunk(2, dim=-1)
        return self.heads(k), self.heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Attention of q (B, H, N, d) over k, v (B, H, S, d) under a (B or 1, 1, N, S) bool mask (True: may attend)
        or a plain causal mask, projected back: (B, N, C)."""
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, H, N, d)
        B, H, N, d = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(B, N, H * d))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln_1 x), then + mlp(ln_2 x)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Every position of x (B, T, C) attending to those before it: (B, T, C)."""
        q, k, v = self.attn.qkv(self.ln_1(x))
        return self.finish(x, self.attn.attend(q, k, v, causal=True))

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The residual around the attention output y, then the MLP: (..., C)."""
        x = x + self.drop(y)
        return x + self.mlp(self.ln_2(x))

    def cached(self, x: Tensor, store) -> Tensor:
        """x (B, N, C), the next N positions after P cached ones: the block's output (B, N, C). ``store(k, v)`` takes
        the new positions' keys and values (B, H, N, d) to cache and returns every cached position's (B, H, P + N, d),
        theirs included (:meth:`~.generate.KVCache.store`: written in place, then read, with no concatenation)."""
        q, k, v = self.attn.qkv(self.ln_1(x))
        keys, values = store(k, v)
        N = x.shape[1]
        P = keys.shape[2] - N
        mask = None
        if N > 1:  # query i (at position P + i) sees keys 0..P + i
            mask = torch.arange(P + N, device=x.device) <= P + torch.arange(N, device=x.device)[:, None]
        return self.finish(x, self.attn.attend(q, keys, values, mask))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and an LM head tied to the token embedding.

    Example::

        gpt = GPT(GPTConfig(vocab_size=13, context=16, n_layer=3, n_head=2, n_embd=16))
        logits = gpt(torch.randint(13, (4, 16)))  # (4, 16, 13)
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.context, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (nanoGPT, GPT-2)
        # propagation maps for layers 2..L (layer 1 is never skipped), identity at the start: see the module's text
        self.propagate_maps = nn.ModuleList(_identity_linear(cfg.n_embd) for _ in range(cfg.n_layer - 1)) \
            if cfg.propagation == "learned" else None
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("c_proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and not getattr(module, "is_identity_map", False):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def embed(self, idx: Tensor, start: int = 0) -> Tensor:
        """Tokens idx (B, N) at positions start..start + N - 1: (B, N, C)."""
        N = idx.shape[1]
        if start + N > self.cfg.context:
            raise ValueError(f"positions up to {start + N} exceed the model's context ({self.cfg.context})")
        pos = torch.arange(start, start + N, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, h: Tensor) -> Tensor:
        """The readout shared by every exit: final LayerNorm and LM head, (..., C) -> (..., V) logits."""
        return self.lm_head(self.ln_f(h))

    def propagated_kv(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values at 1-based ``layer`` of tokens that stopped before it, from their exit hidden states
        h (B, N, C): each (B, H, N, d), by the layer's own key/value projection (CALM's state propagation)."""
        if self.propagate_maps is not None:
            h = self.propagate_maps[layer - 2](h)
        block = self.blocks[layer - 1]
        return block.attn.kv(block.ln_1(h))

    def folded_propagation(self, first: int) -> tuple[Tensor, Tensor] | None:
        """:meth:`propagated_kv` of every layer ``first``..L in one map of the normalised state: W (2C (L - first + 1),
        C) and b, with each layer's LayerNorm affine folded into its key/value projection (LN_l(h) = g_l n(h) + b_l,
        n(h) the plain normalisation), so that a token stopping before ``first`` gets all its later keys and values
        from one matrix product. None with ``propagation="learned"`` (its maps come before the norm)."""
        if self.propagate_maps is not None:
            return None
        C, ws, bs = self.cfg.n_embd, [], []
        for block in self.blocks[first - 1:]:
            w, b = block.attn.c_attn.weight[C:], block.attn.c_attn.bias[C:]  # (2C, C), (2C,): keys then values
            ws.append(w * block.ln_1.weight)
            bs.append(w @ block.ln_1.bias + b)
        return torch.cat(ws), torch.cat(bs)

    def forward(self, idx: Tensor) -> Tensor:
        """Full-depth logits of every position of idx (B, T): (B, T, V)."""
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _identity_linear(n: int) -> nn.Linear:
    layer = nn.Linear(n, n)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(n))
        layer.bias.zero_()
    layer.is_identity_map = True  # kept as the identity by GPT._init
    return layer


class StepwiseGPT(nn.Module):
    """The step-wise view of a :class:`GPT` for scoring sequences: step t runs the blocks up to exit layer t on every
    position still going; the readout is the shared head at every position (a stopped one keeps its exit's logits).

    Inputs are token ids (B, T); the state is ``{"h": (B, T, C), "going": (B, T) bool}``. With no position stopped,
    step T's readout is the GPT's own logits, bit for bit. :meth:`stop` marks positions stopped after a step: the
    blocks after it skip them, and the positions after them attend to their propagated keys and values. The core's
    loop stops whole rows (sequences); stopping single positions is :func:`score_with_exits`.
    """

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt
        self.exit_layers = gpt.cfg.exit_layers
        self.num_steps = len(self.exit_layers)

    @property
    def exit_costs(self) -> list[float]:
        """Blocks run to exit at t = 1..T (the shared head's cost aside)."""
        return [float(k) for k in self.exit_layers]

    def layers_of(self, t: int) -> range:
        """The 1-based layers step t runs."""
        return range(self.exit_layers[t - 2] + 1 if t > 1 else 1, self.exit_layers[t - 1] + 1)

    def initial_state(self, idx: Tensor) -> dict[str, Tensor]:
        return {"h": self.gpt.embed(idx), "going": torch.ones(idx.shape, dtype=torch.bool, device=idx.device)}

    def step(self, t: int, state: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
        h, going = state["h"], state["going"]
        all_going = bool(going.all())
        for layer in self.layers_of(t):
            h = self.gpt.blocks[layer - 1](h) if all_going else self._mixed_block(layer, h, going)
        return {"h": h, "going": going}

    def head(self, h: Tensor) -> Tensor:
        """The readout shared by every exit, (..., C) -> (..., V)."""
        return self.gpt.head(h)

    def readout(self, t: int, state: dict[str, Tensor], idx: Tensor) -> Tensor:
        return self.gpt.head(state["h"])  # (B, T, V)

    @staticmethod
    def stop(state: dict[str, Tensor], stops: Tensor) -> dict[str, Tensor]:
        """The state with the positions of (B, T) bool ``stops`` stopped (they keep their hidden state from now)."""
        return {"h": state["h"], "going": state["going"] & ~stops}

    def _mixed_block(self, layer: int, h: Tensor, going: Tensor) -> Tensor:
        """Block ``layer`` on the going positions of h (B, T, C) alone; the stopped ones give their propagated keys
        and values and keep their hidden state."""
        block, B, T = self.gpt.blocks[layer - 1], h.shape[0], h.shape[1]
        rows, cols = going.nonzero(as_tuple=True)  # (N,) the going positions, row-major
        rank = going.cumsum(1)[rows, cols] - 1  # (N,) each one's place among its row's going positions
        n_max = int(going.sum(1).max()) if rows.numel() else 0
        if n_max == 0:
            return h
        q_go, k_go, v_go = block.attn.qkv(block.ln_1(h[rows, cols]).unsqueeze(0))  # (1, H, N, d) each
        H, d = q_go.shape[1], q_go.shape[3]
        k, v = h.new_empty(B, H, T, d), h.new_empty(B, H, T, d)  # the going positions' own, the others propagated
        k[rows, :, cols], v[rows, :, cols] = k_go[0].transpose(0, 1), v_go[0].transpose(0, 1)
        s_rows, s_cols = (~going).nonzero(as_tuple=True)
        if s_rows.numel():  # layer >= 2 here: the first step runs layer 1 on every position
            k_s, v_s = self.gpt.propagated_kv(layer, h[s_rows, s_cols].unsqueeze(0))  # (1, H, N_stopped, d)
            k[s_rows, :, s_cols], v[s_rows, :, s_cols] = k_s[0].transpose(0, 1), v_s[0].transpose(0, 1)
        q = h.new_zeros(B, H, n_max, d)  # the going queries of each row, packed left; the rest are padding
        q[rows, :, rank] = q_go[0].transpose(0, 1)
        q_pos = torch.full((B, n_max), T - 1, device=h.device)  # padding attends to all (its output is dropped)
        q_pos[rows, rank] = cols
        mask = torch.arange(T, device=h.device) <= q_pos[:, :, None]  # (B, n_max, T) causal, per query
        y = block.attn.attend(q, k, v, mask.unsqueeze(1))[rows, rank]  # (N, C)
        out = h.clone()
        out[rows, cols] = block.finish(h[rows, cols], y)
        return out


def score_with_exits(view: StepwiseGPT, idx: Tensor, exit_rule) -> tuple[Tensor, Tensor]:
    """Score every position of idx (B, T), each token stopping at the first exit where ``exit_rule`` says so.

    ``exit_rule(t, logits, h, h_prev)`` takes step t, the (B, T, V) logits there (None for a rule that does not read
    them, :func:`~.rules.reads_logits`: the head then runs only where positions stop), the (B, T, C) hidden states
    there and at the exit before (the embeddings at t = 1) and returns (B, T) bool (stop now); it is asked at
    t = 1..T-1, and what still goes stops at T. A rule that stops every position at one step
    (:func:`~.rules.fixed_depth`) runs that many steps as a truncated model, asking nothing. Returns the (B, T, V)
    logits of each position at its exit and its (B, T) 1-based exit step.
    """
    exit_rule = as_exit_rule(exit_rule)
    state = view.initial_state(idx)
    depth = fixed_depth(exit_rule, view.num_steps)
    if depth is not None:
        for t in range(1, depth + 1):
            state = view.step(t, state, idx)
        return view.readout(depth, state, idx), torch.full(idx.shape, depth, dtype=torch.long, device=idx.device)
    exits = torch.full(idx.shape, view.num_steps, dtype=torch.long, device=idx.device)
    every_exit, h_prev, logits = reads_logits(exit_rule), state["h"], None
    for t in range(1, view.num_steps + 1):
        state = view.step(t, state, idx)
        if t == view.num_steps:
            going = state["going"]
            last = view.readout(t, state, idx)
            return (last if logits is None else torch.where(going[..., None], last, logits)), exits
        out = view.readout(t, state, idx) if every_exit else None
        stops = exit_rule(t, out, state["h"], h_prev) & state["going"]
        h_prev = state["h"]
        if stops.any():
            here = out[stops] if out is not None else view.head(state["h"][stops])  # (N_stopped, V)
            if logits is None:
                logits = here.new_zeros(*idx.shape, here.shape[-1])
            logits[stops] = here
            exits[stops] = t
            state = view.stop(state, stops)

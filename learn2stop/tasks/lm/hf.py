"""Hugging Face causal language models as step-wise models, with an exit after every ``exit_every`` blocks.

``attach_exits(model)`` gives :class:`HFStepwise`, the interface of :class:`~.models.StepwiseGPT` for a transformers
causal LM: step t runs the blocks up to exit layer t on the positions still going, and the readout at every exit is
the model's own final norm and LM head (shared by every exit, as in CALM and LayerSkip). With no position stopped, the
last readout is the model's own logits. A position that stops keeps its exit hidden state; the later blocks skip it
(they run on the going positions alone, packed per row), and the going positions attend to its keys and values made by
CALM's state propagation: each later layer's own input norm and key/value projection of the exit hidden state, with
the rotary embedding of its position where the model has one.

Two layouts are recognised by structure, not by class name: GPT-2's (``transformer.h`` blocks of ``ln_1``, ``attn``
with a fused ``c_attn``, ``ln_2``, ``mlp``; ``wte``, ``wpe``, ``ln_f``) and the Llama family's (``model.layers`` of
``input_layernorm``, ``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``post_attention_layernorm``,
``mlp``; ``embed_tokens``, ``norm``, ``rotary_emb``; grouped-query attention included). A block is re-run from its own
sub-modules and the model's own attention function (``eager`` or ``sdpa``), so nothing here imports transformers;
a block that does more than its parts (Granite's residual multipliers) is caught by a check on a probe when attached.
Generation with a cache: :mod:`.hf_generate`.
B is the batch, T the sequence length, C the width, H the query heads, G the key/value heads, d the head width.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

_GPT2_BLOCK = {"ln_1", "attn", "ln_2", "mlp"}
_GPT2_ATTN = {"c_attn", "c_proj", "attn_dropout", "resid_dropout"}
_LLAMA_BLOCK = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_LLAMA_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(f"{type(model).__name__}: {why}. The step-wise view knows GPT-2's layout (transformer.h, "
                      f"transformer.ln_f, lm_head; blocks of {sorted(_GPT2_BLOCK)}) and the Llama family's "
                      f"(model.layers, model.norm, model.rotary_emb, lm_head; blocks of {sorted(_LLAMA_BLOCK)})")


class _Layout:
    """Where a model keeps its parts and how one block's pieces are called: embeddings, the blocks, the final norm,
    the LM head, and per block its input norm, projections, attention and the rest (residuals and MLP)."""

    def __init__(self, model: nn.Module):
        head = getattr(model, "lm_head", None)
        if not isinstance(head, nn.Module):
            raise _unsupported(model, "no lm_head module")
        gpt2, llama = getattr(model, "transformer", None), getattr(model, "model", None)
        if gpt2 is not None and isinstance(getattr(gpt2, "h", None), nn.ModuleList):
            self.kind, base, blocks, self.norm = "gpt2", gpt2, gpt2.h, getattr(gpt2, "ln_f", None)
            block_parts, attn_parts, attn_of = _GPT2_BLOCK, _GPT2_ATTN, "attn"
            if not all(isinstance(getattr(gpt2, n, None), nn.Embedding) for n in ("wte", "wpe")):
                raise _unsupported(model, "transformer.h found but no transformer.wte and transformer.wpe")
        elif llama is not None and isinstance(getattr(llama, "layers", None), nn.ModuleList):
            self.kind, base, blocks, self.norm = "llama", llama, llama.layers, getattr(llama, "norm", None)
            block_parts, attn_parts, attn_of = _LLAMA_BLOCK, _LLAMA_ATTN, "self_attn"
            if not isinstance(getattr(llama, "rotary_emb", None), nn.Module):
                raise _unsupported(model, "model.layers found but no model.rotary_emb")
            if not isinstance(getattr(llama, "embed_tokens", None), nn.Embedding):
                raise _unsupported(model, "model.layers found but no model.embed_tokens")
        else:
            raise _unsupported(model, "found neither transformer.h nor model.layers (a ModuleList of blocks)")
        if self.norm is None or len(blocks) == 0:
            raise _unsupported(model, "no final norm or no blocks")
        for i, block in enumerate(blocks):
            extra = (_children(block) ^ block_parts) | (_children(getattr(block, attn_of, nn.Module())) - attn_parts)
            if extra:  # a part the view would not run (a cross-attention, a q/k norm, a sandwich norm), or one missing
                raise _unsupported(model, f"block {i} has parts outside the known layout: {sorted(extra)}")
        impl = getattr(model.config, "_attn_implementation", "eager") or "eager"
        if impl not in ("eager", "sdpa"):
            raise ValueError(f"{type(model).__name__}: attn_implementation {impl!r} is not supported by the step-wise "
                             f"view (per-query masks need 'eager' or 'sdpa')")
        self.model, self.base, self.blocks, self.head, self.impl = model, base, blocks, head, impl
        self.config = model.config
        attn = getattr(blocks[0], attn_of)
        self.lib = sys.modules[type(attn).__module__]  # the model's own modeling module
        needs = ["eager_attention_forward" if impl == "eager" else "ALL_ATTENTION_FUNCTIONS"] + \
            (["apply_rotary_pos_emb"] if self.kind == "llama" else [])
        missing = [n for n in needs if not hasattr(self.lib, n)]
        if missing:
            raise _unsupported(model, f"its modeling module {self.lib.__name__} has no {', '.join(missing)}")
        self.attention_fn = self.lib.eager_attention_forward if impl == "eager" else \
            self.lib.ALL_ATTENTION_FUNCTIONS[impl]
        self.max_positions = base.wpe.num_embeddings if self.kind == "gpt2" else None
        self.window = getattr(self.config, "sliding_window", None)

    def attn(self, layer: int) -> nn.Module:
        block = self.blocks[layer - 1]
        return block.attn if self.kind == "gpt2" else block.self_attn

    def embed(self, idx: Tensor, start: int = 0) -> Tensor:
        """Tokens idx (B, N) at positions start..start + N - 1: (B, N, C)."""
        if self.kind == "llama":
            return self.base.embed_tokens(idx)
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.base.drop(self.base.wte(idx) + self.base.wpe(pos))

    def norm_in(self, layer: int, h: Tensor) -> Tensor:
        block = self.blocks[layer - 1]
        return block.ln_1(h) if self.kind == "gpt2" else block.input_layernorm(h)

    def _rope(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.base.rotary_emb(x, position_ids=pos)  # cos, sin (1 or B, N, d)

    def qkv(self, layer: int, h: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, N, d), keys and values (B, G, N, d) of hidden states h (B, N, C) at positions pos (1 or B, N),
        rotary applied where the model has it."""
        attn, x = self.attn(layer), self.norm_in(layer, h)
        if self.kind == "gpt2":
            q, k, v = attn.c_attn(x).split(attn.split_size, dim=2)
            return tuple(t.view(*t.shape[:-1], -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = self.lib.apply_rotary_pos_emb(q, k, *self._rope(x, pos))
        return q, k, v

    def kv(self, layer: int, h: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values alone (B, G, N, d) of hidden states h (B, N, C) at positions pos: no query, no block."""
        attn, x = self.attn(layer), self.norm_in(layer, h)
        if self.kind == "gpt2":
            C = attn.split_size
            kv = torch.addmm(attn.c_attn.bias[C:], x.reshape(-1, x.shape[-1]), attn.c_attn.weight[:, C:])
            k, v = kv.view(*x.shape[:-1], 2 * C).split(C, dim=-1)
            return tuple(t.reshape(*t.shape[:-1], -1, attn.head_dim).transpose(1, 2) for t in (k, v))
        shape = (*x.shape[:-1], -1, attn.head_dim)
        k, v = (p(x).view(shape).transpose(1, 2) for p in (attn.k_proj, attn.v_proj))
        return self.lib.apply_rotary_pos_emb(k, k, *self._rope(x, pos))[1], v

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
        """The attention of queries q (B, H, N, d) over keys and values (B, G, S, d) of block ``layer``, query i seeing
        key j where ``allowed`` (B or 1, N, S) (None: every key), heads concatenated: (B, N, H d), not projected."""
        attn = self.attn(layer)
        mask = None if allowed is None else torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~allowed, torch.finfo(q.dtype).min).unsqueeze(1)  # (B or 1, 1, N, S), additive
        p = (attn.attn_dropout.p if self.kind == "gpt2" else attn.attention_dropout) if attn.training else 0.0
        if self.kind == "gpt2" and self.impl == "eager" and attn.reorder_and_upcast_attn:
            y = attn._upcast_and_reordered_attn(q, k, v, mask)[0]
        else:
            y = self.attention_fn(attn, q, k, v, mask, dropout=p, scaling=attn.scaling)[0]  # (B, N, H, d)
        return y.reshape(*y.shape[:-2], -1).contiguous()

    def finish(self, layer: int, h: Tensor, y: Tensor) -> Tensor:
        """The rest of block ``layer`` after its attention y (..., H d) of hidden states h (..., C): the output
        projection and residual, then the MLP and its residual."""
        attn, block = self.attn(layer), self.blocks[layer - 1]
        if self.kind == "gpt2":
            h = h + attn.resid_dropout(attn.c_proj(y))
            return h + block.mlp(block.ln_2(h))
        h = h + attn.o_proj(y)
        return h + block.mlp(block.post_attention_layernorm(h))

    def block(self, layer: int, h: Tensor, pos: Tensor) -> Tensor:
        """Block ``layer`` on every position of h (B, N, C) at positions pos, each seeing those before it."""
        q, k, v = self.qkv(layer, h, pos)
        n = h.shape[1]  # SDPA with no mask is causal, as the model's own forward runs it
        return self.finish(layer, h, self.attend(layer, q, k, v, None if self.impl == "sdpa" or n == 1 else
                                                 causal(n, h.device)))

    def check_length(self, n: int, what: str = "sequence") -> None:
        if self.max_positions is not None and n > self.max_positions:
            raise ValueError(f"{what} length ({n}) exceeds the model's positions ({self.max_positions})")
        if self.window is not None and n > self.window:
            raise ValueError(f"{what} length ({n}) exceeds the model's sliding window ({self.window}), which this "
                             f"view does not apply")


def causal(n: int, device=None) -> Tensor:
    """(1, n, n) bool: query i sees keys 0..i."""
    i = torch.arange(n, device=device)
    return (i <= i[:, None]).unsqueeze(0)


class HFStepwise(nn.Module):
    """The step-wise view of a transformers causal LM for scoring sequences (the interface of StepwiseGPT).

    Inputs are token ids (B, T); the state is ``{"h": (B, T, C), "going": (B, T) bool}``; step t runs the blocks up
    to exit layer t, the readout is the model's final norm and LM head at every position (B, T, V). :meth:`stop`
    marks positions stopped: later blocks skip them, and the positions after them attend to their propagated keys
    and values (:meth:`propagated_kv`). Example::

        view = attach_exits(AutoModelForCausalLM.from_pretrained(path).eval(), exit_every=2)
        logits, exits = score_with_exits(view, idx, lambda t, z, h, h_prev: z.softmax(-1).amax(-1) > 0.9)
    """

    def __init__(self, model: nn.Module, exit_every: int = 1, verify: bool = True):
        super().__init__()
        self.layout = _Layout(model)
        self.model = model
        n = len(self.layout.blocks)
        if isinstance(exit_every, bool) or not isinstance(exit_every, int) or not 1 <= exit_every <= n:
            raise ValueError(f"exit_every must be an integer in 1..{n} (the model's blocks); got {exit_every!r}")
        layers = list(range(exit_every, n + 1, exit_every))
        self.exit_layers = layers if layers[-1] == n else layers + [n]
        self.num_steps = len(self.exit_layers)
        self.n_layer = n
        if verify:
            self._verify()

    @torch.no_grad()
    def _verify(self) -> None:
        """Refuse a model whose forward this view does not reproduce (a layout found by structure whose blocks do
        more, such as residual multipliers or logit soft-capping): full depth on a short probe against its logits."""
        model, was_training = self.model, self.model.training
        n = min(8, self.layout.max_positions or 8, self.layout.window or 8)
        probe = (torch.arange(n, device=self.layout.head.weight.device) % self.layout.head.out_features)[None]
        model.eval()
        try:
            theirs = model(input_ids=probe).logits
            ours = self.initial_state(probe)
            for t in range(1, self.num_steps + 1):
                ours = self.step(t, ours, probe)
            ours = self.readout(self.num_steps, ours, probe)
        finally:
            model.train(was_training)
        gap, scale = float((ours - theirs).abs().max()), float(theirs.abs().max())
        tol = (1e-2 if theirs.dtype in (torch.float16, torch.bfloat16) else 1e-4) * (1.0 + scale)
        if not gap <= tol:
            raise ValueError(f"{type(model).__name__}: its blocks were found ({self.layout.kind} layout) but the "
                             f"step-wise view does not reproduce its logits (largest gap {gap:.3g} on a probe, "
                             f"allowed {tol:.3g}); its forward does something the layout does not (pass verify=False "
                             f"to skip this check at your own risk)")

    @property
    def exit_costs(self) -> list[float]:
        """Blocks run to exit at t = 1..T (the shared head's cost aside)."""
        return [float(k) for k in self.exit_layers]

    def layers_of(self, t: int) -> range:
        """The 1-based layers step t runs."""
        return range(self.exit_layers[t - 2] + 1 if t > 1 else 1, self.exit_layers[t - 1] + 1)

    def head(self, h: Tensor) -> Tensor:
        """The readout shared by every exit: the model's final norm and LM head, (..., C) -> (..., V)."""
        return self.layout.head(self.layout.norm(h))

    def propagated_kv(self, layer: int, h: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, G, N, d) at 1-based ``layer`` of tokens that stopped before it, from their exit hidden
        states h (B, N, C) at positions pos (1 or B, N): CALM's state propagation."""
        return self.layout.kv(layer, h, pos)

    def initial_state(self, idx: Tensor) -> dict[str, Tensor]:
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.long or idx.shape[1] == 0:
            raise ValueError(f"inputs must be a (batch, length >= 1) tensor of token ids (torch.long); got "
                             f"{type(idx).__name__} {tuple(getattr(idx, 'shape', ()))} {getattr(idx, 'dtype', '')}")
        self.layout.check_length(idx.shape[1])
        return {"h": self.layout.embed(idx), "going": torch.ones(idx.shape, dtype=torch.bool, device=idx.device)}

    def step(self, t: int, state: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
        h, going = state["h"], state["going"]
        all_going = bool(going.all())
        for layer in self.layers_of(t):
            if all_going:
                h = self.layout.block(layer, h, torch.arange(h.shape[1], device=h.device)[None])
            else:
                h = self._mixed_block(layer, h, going)
        return {"h": h, "going": going}

    def readout(self, t: int, state: dict[str, Tensor], idx: Tensor) -> Tensor:
        return self.head(state["h"])  # (B, T, V)

    @staticmethod
    def stop(state: dict[str, Tensor], stops: Tensor) -> dict[str, Tensor]:
        """The state with the positions of (B, T) bool ``stops`` stopped (they keep their hidden state from now)."""
        return {"h": state["h"], "going": state["going"] & ~stops}

    def _mixed_block(self, layer: int, h: Tensor, going: Tensor) -> Tensor:
        """Block ``layer`` on the going positions of h (B, T, C) alone, packed per row; the stopped ones give their
        propagated keys and values and keep their hidden state."""
        B, T = going.shape
        rows, cols = going.nonzero(as_tuple=True)  # (N,) the going positions, row-major
        if rows.numel() == 0:
            return h
        rank = going.cumsum(1)[rows, cols] - 1  # (N,) each one's place among its row's going positions
        n_max = int(going.sum(1).max())
        q_go, k_go, v_go = self.layout.qkv(layer, h[rows, cols].unsqueeze(0), cols[None])  # (1, H or G, N, d)
        H, G, d = q_go.shape[1], k_go.shape[1], q_go.shape[3]
        k, v = h.new_empty(B, G, T, d), h.new_empty(B, G, T, d)
        k[rows, :, cols], v[rows, :, cols] = k_go[0].transpose(0, 1), v_go[0].transpose(0, 1)
        s_rows, s_cols = (~going).nonzero(as_tuple=True)
        k_s, v_s = self.propagated_kv(layer, h[s_rows, s_cols].unsqueeze(0), s_cols[None])  # (1, G, N_stopped, d)
        k[s_rows, :, s_cols], v[s_rows, :, s_cols] = k_s[0].transpose(0, 1), v_s[0].transpose(0, 1)
        q = h.new_zeros(B, H, n_max, d)  # the going queries of each row, packed left; the rest are padding
        q[rows, :, rank] = q_go[0].transpose(0, 1)
        q_pos = torch.full((B, n_max), T - 1, device=h.device)  # padding attends to all (its output is dropped)
        q_pos[rows, rank] = cols
        allowed = torch.arange(T, device=h.device) <= q_pos[:, :, None]  # (B, n_max, T) causal, per query
        out = h.clone()
        y = self.layout.attend(layer, q, k, v, allowed)[rows, rank]  # (N, H d) the going queries' attention
        out[rows, cols] = self.layout.finish(layer, h[rows, cols], y)
        return out


def attach_exits(model: nn.Module, exit_every: int = 1, verify: bool = True) -> HFStepwise:
    """The step-wise view of a transformers causal LM (GPT-2 or Llama layout) with an exit after every ``exit_every``
    blocks and after the last; the model is not changed (its own norm and head read every exit). ``verify`` checks
    once, on an 8-token probe, that the view at full depth gives the model's own logits."""
    return HFStepwise(model, exit_every, verify)

"""LayerSkip's self-speculative decoding: draft tokens with an early exit, verify them with the full model in one
pass, keep the longest agreeing prefix and the full model's next token; the output is full-depth greedy decoding's.

The draft and the verification share one KV cache. The draft runs layers 1..k (the exit at layer k, the shared head)
one token at a time, caching those layers; the verification runs layers k+1..L on the drafted positions at once,
from the draft's layer-k hidden states (LayerSkip's reuse: layers 1..k are not run twice). Positions past the
accepted prefix are left in the cache to be overwritten. Shapes as in :mod:`.models`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...core.timing import seconds
from .generate import ContextWindow, KVCache, check_prompt, prefill
from .models import GPT


@dataclass
class SpeculativeResult:
    """The tokens (1, T0 + n), and how the draft fared: tokens drafted, drafts accepted, verification passes."""

    tokens: Tensor
    drafted: int
    accepted: int
    verify_passes: int

    @property
    def acceptance(self) -> float:
        """The share of drafted tokens the full model agreed with (1.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 1.0


@torch.no_grad()
def self_speculative_decode(gpt: GPT, prompt: Tensor, max_new_tokens: int, draft_layer: int,
                            num_draft: int = 4) -> SpeculativeResult:
    """Greedy continuation of prompt (1, T0) by ``max_new_tokens`` tokens, drafting up to ``num_draft`` at a time with
    the exit after ``draft_layer`` (1..L-1) and verifying them with layers draft_layer+1..L in one pass. Past the
    context, the cache restarts where greedy decoding's does (:class:`~.generate.ContextWindow`: a round never
    crosses a full cache), so the tokens stay greedy decoding's."""
    check_prompt(gpt, prompt, max_new_tokens, window=True)
    L = gpt.cfg.n_layer
    if prompt.shape[0] != 1:
        raise ValueError(f"self-speculative decoding runs one sequence at a time (prompt batch 1); got batch "
                         f"{prompt.shape[0]} (accepted prefixes differ from row to row)")
    if isinstance(draft_layer, bool) or not isinstance(draft_layer, int) or not 1 <= draft_layer < L:
        raise ValueError(f"draft_layer must be an integer in 1..{L - 1} (an exit before the last layer); "
                         f"got {draft_layer!r}")
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an integer >= 1; got {num_draft!r}")
    cache = KVCache(gpt, 1, gpt.wte.weight)
    if prompt.shape[1] > 1:
        prefill(gpt, cache, prompt[:, :-1])
    window = ContextWindow(gpt, cache, prompt[:, :-1])
    token, out = prompt[:, -1], []  # token (1,): the next one to feed, at position cache.length
    drafted = accepted = passes = 0
    while len(out) < max_new_tokens:
        window.make_room()
        n = cache.length  # every layer holds positions 0..n-1
        m = min(num_draft, max_new_tokens - len(out) - 1, gpt.cfg.context - 1 - n)  # drafts this round
        hidden, drafts = _draft(gpt, cache, token, n, m, draft_layer)  # (1, m + 1, C), m tokens
        for layer in range(draft_layer, L):  # verify: the later layers on every drafted position at once
            hidden = gpt.blocks[layer].cached(hidden, cache.store(layer, None, n))
        full = gpt.head(hidden)[0].argmax(-1)  # (m + 1,) the full model's next token after each position
        j = 0
        while j < m and int(drafts[j]) == int(full[j]):
            j += 1
        out.extend([*drafts[:j].tolist(), int(full[j])])
        drafted, accepted, passes = drafted + m, accepted + j, passes + 1
        cache.length = n + j + 1  # token and the accepted drafts, at every layer
        window.fed(torch.cat([token, drafts[:j]])[None])
        token = full[j:j + 1]
    tokens = torch.cat([prompt, torch.tensor([out], dtype=torch.long, device=prompt.device)], 1)
    return SpeculativeResult(tokens, drafted, accepted, passes)


def _draft(gpt: GPT, cache: KVCache, token: Tensor, n: int, m: int, k: int) -> tuple[Tensor, Tensor]:
    """Feed token (1,) at position n and m greedy drafts after it through layers 1..k (cached there): their layer-k
    hidden states (1, m + 1, C) and the m drafts (m,), each the exit's argmax after the one before."""
    hidden, drafts = [], []
    for j in range(m + 1):
        h = gpt.embed(token[:, None], n + j)  # (1, 1, C)
        for layer in range(k):
            h = gpt.blocks[layer].cached(h, cache.store(layer, None, n + j))
        hidden.append(h)
        if j < m:
            token = gpt.head(h[:, 0]).argmax(-1)  # (1,)
            drafts.append(token)
    return torch.cat(hidden, 1), torch.cat(drafts) if drafts else token.new_empty(0)


def draft_plans(agreement: dict[int, float], n_layer: int, max_draft: int = 8) -> list[tuple[int, int, float]]:
    """Every draft layer k and draft length m, best first by the tokens per layer run they are expected to make,
    from ``agreement``: exit layer k (< ``n_layer``) -> the share of tokens whose exit-k greedy token is the full
    model's (measured on validation).

    A round runs layers 1..k on the input token and m drafts, then layers k+1..L once on all m + 1 positions,
    (m + 1) k + L - k layer runs, counting a layer on m + 1 positions as one run; with each draft accepted with
    probability a, it yields 1 + a + ... + a^m tokens. Greedy decoding runs L layers a token. Returns
    [(k, m, the expected speed-up over greedy decoding in layer runs), ...]. On a CPU at batch 1 a layer on m + 1
    positions costs more than one run, so :func:`fastest_draft` times the first few."""
    if not agreement:
        raise ValueError("draft_plans needs the agreement of at least one exit before the last layer")
    plans = []
    for k, a in sorted(agreement.items()):
        if not 1 <= k < n_layer:
            raise ValueError(f"draft_plans: exit layer {k} is not before the last layer ({n_layer})")
        for m in range(1, max_draft + 1):
            tokens = sum(a ** i for i in range(m + 1))
            plans.append((k, m, tokens * n_layer / ((m + 1) * k + n_layer - k)))
    return sorted(plans, key=lambda p: -p[2])


def fastest_draft(gpt: GPT, prompt: Tensor, plans: list[tuple[int, int, float]], tokens: int,
                  rounds: int = 3) -> tuple[int, int, float]:
    """Of ``plans`` (:func:`draft_plans`), the (k, m) whose self-speculative decoding of prompt (1, T0) by ``tokens``
    tokens runs fastest, each timed beside greedy decoding (``rounds`` interleaved passes, the best of each): (k, m,
    its speed over greedy decoding's on that prompt)."""
    if not plans:
        raise ValueError("fastest_draft needs at least one draft plan")
    from .generate import generate  # the greedy decoding it is timed against
    from .models import StepwiseGPT

    view, best = StepwiseGPT(gpt), {(k, m): math.inf for k, m, _ in plans}
    greedy = math.inf
    with torch.inference_mode():
        for _ in range(rounds):
            greedy = min(greedy, seconds(lambda: generate(view, prompt, tokens)))
            for k, m in best:
                best[(k, m)] = min(best[(k, m)], seconds(lambda: self_speculative_decode(gpt, prompt, tokens, k, m)))
    (k, m), secs = min(best.items(), key=lambda kv: kv[1])
    return k, m, greedy / secs


def recorded_draft_plan(path: Path) -> tuple[int, int] | None:
    """The draft plan (draft layer, drafts) that the deployment record at ``path`` (``deployed.json``) holds, None
    where there is no record or it holds no valid plan."""
    try:
        plan = json.loads(Path(path).read_text(encoding="utf-8"))["speculative"]
        draft, n_draft = plan["draft_layer"], plan["num_draft"]
    except (ValueError, OSError, KeyError, TypeError):
        return None
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (draft, n_draft))
    return (draft, n_draft) if ok else None

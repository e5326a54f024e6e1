"""Model selection's scores: the validation loss at the last step, at the best step (the oracle), and with early
exit under the inference rule evaluation uses."""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .distributions import exit_costs
from .inference import InferenceConfig
from .model import StoppingModel
from .rules import first_crossing, signal_trace


@torch.no_grad()
def validation_scores(sm: StoppingModel, batches: Iterable[tuple[Any, Any]], loss_fn,
                      inference: InferenceConfig | None = None, seed: int = 0, price: float = 0.0) -> dict[str, float]:
    """Mean validation loss at the last step, at the best step (oracle), and with early exit by the
    policy under ``inference``: the same rule evaluation uses (default: :class:`InferenceConfig`).

    With a ``price`` on computation, the oracle and policy scores are the priced objective
    loss + price * c_t (c_t: the model's normalised cost of stopping at t), so that selection does not
    favour never stopping.
    """
    inference = inference or InferenceConfig()
    costs = exit_costs(sm.model) * price if price else None
    was_training = sm.training
    sm.eval()
    totals: dict[str, float] = {"last": 0.0, "oracle": 0.0, "policy": 0.0, "depth": 0.0}
    n = 0
    gen = torch.Generator().manual_seed(seed)
    for inputs, target in batches:
        # One full rollout scores all three: early exit returns exactly the full-depth output at
        # the rule's stop time, so its loss is read off the per-step losses.
        r = sm.unroll(inputs, target, loss_fn, keep_outputs=not inference.uses_policy)
        b = r.losses.shape[0]
        totals["last"] += float(r.losses[:, -1].sum())
        priced = r.losses if costs is None else r.losses + costs.to(r.losses)[None]
        totals["oracle"] += float(priced.min(dim=1).values.sum())
        if sm.policy is not None:
            if inference.uses_policy:
                stop = inference.stop_times(r, gen)
            else:
                signal = inference.signal(sm.policy)
                stop = first_crossing(signal_trace(signal, r.step_outputs, inputs), signal.from_param(inference.param))
            totals["policy"] += float(priced.gather(1, stop[:, None] - 1).sum())
            totals["depth"] += float(stop.float().sum())
        n += b
    sm.train(was_training)
    if n == 0:
        raise ValueError("the validation set is empty: validation_batches() yielded no samples, so no weights "
                         "can be selected; give it data or set select: none")
    out = {k: v / n for k, v in totals.items()}
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"validation scores {', '.join(bad)} are NaN or inf: the model's outputs or the "
                                 f"loss are not finite on the validation set")
    if sm.policy is None:
        out.pop("policy"), out.pop("depth")
    return out

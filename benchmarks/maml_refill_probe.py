"""Would refilling the batch make MAML's learned stop pay at batch 100? An offline probe on a trained quick run.

    python benchmarks/maml_refill_probe.py --run-dir runs/maml-scalars --threads 1

At 100 sinusoid tasks an inner step costs about what it costs at 10 (dispatch, not arithmetic), so a batch that
shrinks as tasks stop runs as many steps as its slowest task, and the learned stop (quantile rule, about 3 of 10
steps) is slower than a fixed depth of its quality. MAML's step is the same function at every t, so rows at
different steps can share one call: this probe keeps ``--batch`` rows in flight, steps them all at once, asks the
policy with one t per row, and refills the rows that stop with waiting tasks (their initial states, and so the
posterior-mean estimate, made ``--batch`` at a time, as the shrinking batch makes them). It checks that every task
stops where the loop stops it, then times, side by side (round-robin passes, the best each):

- ``fixed d``: the stop model at fixed depths 3 and 4, batches of ``--batch`` (the loop);
- ``policy, shrinking``: the quantile rule in the loop, batches of ``--batch``;
- ``policy, refilled``: the same rule, rows refilled as they stop;
- ``refilled, cheap ask``: on a run whose policy reads the support loss of each step's weights
  (``model.policy_support_loss: readout``), the same with the readout made without the support-set forward, as
  ``step`` (the quick preset's since 2026-11-29) reads it: timing only, its stop times are not the rule's.

The model must keep an answer (``model.answer: nearest``, the quick preset's). Only the quick preset's sinusoid runs
are supported.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="a trained MAML quick run (after frontier: its policy curve)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=100, help="rows per step call")
    ap.add_argument("--budget-point", type=int, default=0, help="which point of frontier.json's policy curve")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=1,
                    help="queue the test tasks this many times over (a longer stream: the last batch's drain counts less)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from learn2stop.core.loop import run_with_early_exit
    from learn2stop.core.pipeline import load_stage, shuffled
    from learn2stop.core.rules import FixedDepth, SignalRule, make_signal
    from learn2stop.core.trees import batch_size, tree_cat, tree_select
    from learn2stop.tasks.maml.app import APP, PRESETS, MAMLConfig
    from learn2stop.tasks.maml.models import ANSWER
    from learn2stop.utils.config import resolve

    run = Path(args.run_dir)
    front = run / "frontier.json"
    if not front.is_file():
        raise SystemExit(f"{front} is missing: run `learn2stop maml frontier --run-dir {run}` first")
    cfg = resolve(MAMLConfig, PRESETS["quick"])
    sm = load_stage(APP, cfg, run, APP.stop_stage, None)
    model, policy = sm.model, sm.policy
    if not getattr(model, "answering", False):
        raise SystemExit("the probe needs the kept answer (model.answer: nearest, the quick preset's since d02f480)")
    point = json.loads(front.read_text())["curves"]["policy"][args.budget_point]
    thr, T, B = point["threshold"], model.num_steps, args.batch
    inputs = shuffled(APP.speed_inputs(cfg, None))
    if args.repeat > 1:
        inputs = tree_cat([inputs] * args.repeat)
    N = batch_size(inputs)

    def fresh(inp: dict) -> dict:
        """Initial states with an empty kept answer, so that new rows join running ones (same keys)."""
        st = model.initial_state(inp)
        est = st[ANSWER + "estimate"]
        st.update({ANSWER + "score": est.new_full((est.shape[0],), math.inf), ANSWER + "pred": torch.zeros_like(est),
                   ANSWER + "step": torch.zeros(est.shape[0], dtype=torch.long)})
        return st

    def refilled(readout=model.readout) -> tuple[torch.Tensor, int]:
        stops = torch.zeros(N, dtype=torch.long)
        pool_in = pool_st = act_in = act_st = None
        pool_ids, ids = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        t, survival, nxt, calls = torch.zeros(0, dtype=torch.long), torch.zeros(0), 0, 0
        while nxt < N or pool_ids.numel() or t.numel():
            room = B - t.numel()
            if room and (nxt < N or pool_ids.numel()):
                if not pool_ids.numel():  # the next tasks' initial states, B at a time
                    hi = min(nxt + B, N)
                    pool_in = tree_select(inputs, slice(nxt, hi))
                    pool_st, pool_ids, nxt = fresh(pool_in), torch.arange(nxt, hi), hi
                m = min(room, pool_ids.numel())
                new_in, new_st = tree_select(pool_in, slice(0, m)), tree_select(pool_st, slice(0, m))
                pool_in, pool_st = tree_select(pool_in, slice(m, None)), tree_select(pool_st, slice(m, None))
                if t.numel():
                    act_in = tree_cat([act_in, new_in])
                    act_st = tree_cat([{k: act_st[k] for k in new_st}, new_st])
                else:
                    act_in, act_st = new_in, new_st
                ids, pool_ids = torch.cat([ids, pool_ids[:m]]), pool_ids[m:]
                t, survival = torch.cat([t, t.new_zeros(m)]), torch.cat([survival, survival.new_zeros(m)])
            t = t + 1
            st = model.step(-1, act_st, act_in)  # the step ignores t; -1 marks the rows whose kept answer is new
            st[ANSWER + "step"] = torch.where(st[ANSWER + "step"] == -1, t, st[ANSWER + "step"])
            survival = survival + F.logsigmoid(-policy(act_in, readout(0, st, act_in), t).float())  # one t per row
            stop = (-survival >= thr) | (t >= T)  # the quantile rule: -log prod (1 - pi) reaches its threshold
            calls += 1
            keep = (~stop).nonzero().squeeze(1)
            stops[ids[stop]] = t[stop]
            act_in, act_st, t, ids, survival = tree_select(act_in, keep), tree_select(st, keep), t[keep], ids[keep], survival[keep]
        return stops, calls

    def cheap_readout(t, state, inp):
        model.policy_features = False
        try:
            out = model.readout(t, state, inp)
        finally:
            model.policy_features = True
        out["support_loss"] = out["answer_score"]  # a stand-in of the right shape: timing only
        return out

    rule = lambda: SignalRule(make_signal("quantile", policy), thr)

    def shrinking(factory) -> None:
        for i in range(0, N, B):
            run_with_early_exit(model, tree_select(inputs, slice(i, i + B)), factory())

    with torch.no_grad():
        loop = torch.cat([run_with_early_exit(model, tree_select(inputs, slice(i, i + B)), rule()).stop_times
                          for i in range(0, N, B)])
        got, calls = refilled()
        if not torch.equal(loop, got):
            raise SystemExit(f"refilled stop times differ from the loop's at {int((loop != got).sum())} of {N} tasks")
        jobs = {"fixed 3": lambda: shrinking(lambda: FixedDepth(3)), "fixed 4": lambda: shrinking(lambda: FixedDepth(4)),
                "policy, shrinking": lambda: shrinking(rule), "policy, refilled": refilled}
        if not model.support_loss_from_step:  # its readout runs a support-set forward at every ask
            jobs["refilled, cheap ask"] = lambda: refilled(cheap_readout)
        best = {k: math.inf for k in jobs}
        for _ in range(args.passes):
            for k, f in jobs.items():
                t0 = time.perf_counter()
                f()
                best[k] = min(best[k], time.perf_counter() - t0)
    print(f"{N} tasks, {B} rows per call, {args.threads} thread(s); quantile threshold {thr:.4g}: mean stop step "
          f"{loop.float().mean():.2f}, the same for every task refilled ({calls} step calls refilled, "
          f"{math.ceil(N / B) * T} at most shrinking)\n")
    print("| job | tasks/s | × fixed 4 |\n|---|---|---|")
    for k, v in best.items():
        print(f"| {k} | {N / v:,.0f} | {best['fixed 4'] / v:.2f} |")


if __name__ == "__main__":
    main()

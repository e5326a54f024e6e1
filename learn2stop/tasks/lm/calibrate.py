"""``learn2stop lm calibrate``: Stage I's rules fitted to a new target on the validation split and deployed.

``--epsilon E [--delta D]`` certifies each rule by Learn-then-Test on real early exit (the deployed model: a stopped
token's later layers propagated) to keep the per-token risk over the plain GPT's full depth within E
(``calibration.risk``: loss or agreement); ``--budget B`` takes the least aggressive threshold whose real early
exit runs at most B of the layers. ``--rule R`` fits one rule (default: the policy) and deploys it; ``--fastest``
fits every rule, times each beside the plain GPT at ``--speed-batch`` (default 1), and deploys the fastest among
those within epsilon of the GPT's validation loss (any of them under a budget), ties within the timing's spread
going to fewer layers. ``deployed.json`` is rewritten; the one it replaces is kept in ``deployed.previous.json``,
and its self-speculative draft plan (timed by ``evaluate`` on Stage I, which calibration does not change) carried
over.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ...utils.config import ConfigError
from ...utils.outputs import check_previous_file, keep_previous_file
from ...utils.report import markdown_table, write_json
from ..base import RunContext, as_run
from .config import LmConfig
from .evaluate import STAGE1_RULES, deployable, draft_plan, prompts_of, stage1_row, time_rows
from .metric import MeasuredRisk, budget_rule, calibrate_rule, costs_of, trace_split, windows
from .speculative import recorded_draft_plan

DEPLOYED = "deployed.json"


def _not_ours(path: Path) -> str | None:
    """Why ``path`` is not a deployment record of this task (None: it is one)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return "not JSON"
    return None if isinstance(data, dict) and {"rule", "thresholds"} <= set(data) else "not a deployment record"


def calibrate(cfg: LmConfig, run: RunContext | str | Path) -> dict:
    """Certify (--epsilon) or fit (--budget) Stage I's rules by real early exit on validation; deploy one

    --rule R (default the policy), or the --fastest; the deployment it replaces is kept (see the module's text)."""
    from .commands import load_run

    run = as_run(run)
    o = run.options
    target = o.target
    if o.fastest and o.rule is not None:
        raise ConfigError("--rule: --fastest fits every rule and keeps the fastest; give one or the other")
    if o.rule is not None and o.rule not in STAGE1_RULES:
        raise ConfigError(f"--rule: the language model's rules are {', '.join(STAGE1_RULES)}; got {o.rule!r}")
    if o.speed_batch is not None and (not o.fastest or o.speed_batch < 1):
        raise ConfigError("--speed-batch: only --fastest times the rules, at a batch size >= 1; got "
                          f"{o.speed_batch!r}" + ("" if o.fastest else " without --fastest"))
    least = cfg.model.exit_layers[0] / cfg.model.n_layer
    if target.budget is not None and target.budget < least:
        raise ConfigError(f"--budget: the least any rule runs is the first exit, {least:.3g} of the layers; got "
                          f"{target.budget:g}")
    path = Path(run.run_dir) / DEPLOYED
    check_previous_file(path, _not_ours, "calibrate")  # before any work: the record this replaces can be kept
    c = cfg.calibration if target.budget is not None else replace(cfg.calibration, epsilon=target.epsilon,
                                                                    delta=target.risk_level)
    cfg = replace(cfg, calibration=c)
    _, splits, models = load_run(cfg, run, "calibrate")
    base, (s1, policy) = models["baseline"][0], models["stage2"]
    val = windows(splits.val, cfg.model.context)
    run.log(f"calibrating on {val[0].numel()} validation tokens (real early exit) for "
            + (f"a budget of {target.budget:g} of the layers" if target.budget is not None else
               f"{c.risk} risk <= {c.epsilon:g} at delta {c.delta:g}") + " ...")
    trace, gpt_trace = trace_split(s1, *val, policy), trace_split(base, *val)
    measured = MeasuredRisk(s1, *val, policy, gpt_trace if c.reference == "gpt" else trace, c.risk)
    costs, L = costs_of(s1), s1.cfg.n_layer
    rules = list(STAGE1_RULES) if o.fastest else [o.rule or "policy"]
    cals = {r: (budget_rule(trace, r, costs, target.budget, measured, c.candidates) if target.budget is not None
                else calibrate_rule(trace, r, costs, c.risk, c.epsilon, c.delta, c.max_tokens, measured=measured,
                                    candidates=c.candidates)) for r in rules}
    gpt_val = float(gpt_trace.losses[:, -1].mean())
    timed = [("full depth (GPT)", "baseline", base, "full", math.inf, None),
             *(stage1_row(s1, r, cal.threshold, policy) for r, cal in cals.items())]
    rows = [{"row": "full depth (GPT)", "backbone": "baseline", "rule": "full", "val_loss": gpt_val,
             "mean_layers": float(L), "threshold": math.inf}]
    for (label, _, _, r, threshold, _), cal in zip(timed[1:], cals.values()):
        risk, _ = measured(r, cal.threshold)
        rows.append({"row": label, "backbone": "stage1", "rule": r, "threshold": threshold,
                     "val_loss": float(measured.reference.losses[:, -1].mean() + risk.mean())
                     if c.risk == "loss" else None, "mean_layers": cal.calibration["mean_cost"] * L})
    plan = recorded_draft_plan(path)  # Stage I's, so the one the replaced record timed still holds
    draft, n_draft = plan if plan is not None else draft_plan(cfg, s1, trace, splits.val)[:2]
    batch = o.speed_batch or 1
    if o.fastest:
        run.log(f"timing generation at batch {batch} ...")
        timing = time_rows(replace(cfg, eval=replace(cfg.eval, timing_batches=[batch])), timed,
                           prompts_of(cfg, splits.test), windows(splits.test, cfg.model.context))
        keeps = gpt_val + c.epsilon if target.budget is None and c.risk == "loss" else math.inf
        candidates = {"baseline": rows[0], **{r["rule"]: r for r in rows[1:]
                                              if r["val_loss"] is None or r["val_loss"] <= keeps}}
        chosen, tie = deployable(candidates, timing, L, batch, layers="mean_layers")
    else:
        timing, chosen, tie = None, rows[1], None
        if target.budget is None and c.risk == "loss" and chosen["val_loss"] > gpt_val + c.epsilon:
            run.log(f"warning: {chosen['row']} loses {chosen['val_loss'] - gpt_val:.4f} nats on validation to the "
                    f"plain GPT, more than epsilon ({c.epsilon:g}): Stage I's own full depth is that far behind; "
                    f"'--fastest' deploys the GPT itself where nothing of Stage I keeps its quality")
    deployed = {"backbone": chosen["backbone"], "rule": chosen["rule"], "row": chosen["row"],
                "chosen_by": (f"calibrate --fastest: the fastest generation at batch {batch} (ties within "
                              f"{100 * tie:.1f} %, the timing's spread, to fewer layers, then the GPT)" if o.fastest
                              else f"calibrate --rule {chosen['rule']}"),
                "target": ({"epsilon": c.epsilon, "delta": c.delta, "risk": c.risk} if target.budget is None
                           else {"budget": target.budget}),
                "thresholds": {r: (None if not math.isfinite(x.threshold) else x.threshold) for r, x in cals.items()},
                "speculative": {"draft_layer": draft, "num_draft": n_draft},
                "calibration": {"stage1": {r: x.to_dict() for r, x in cals.items()}}}
    if tie is not None:
        deployed["tie"] = tie
    kept = keep_previous_file(path, _not_ours, "calibrate")
    write_json(deployed, path)
    table = _table(rows, timing, batch, chosen)
    kept_note = f" (the one it replaces kept in {kept})" if kept else ""
    run.log(table + f"\ndeployed: {chosen['row']} -> {path}{kept_note}")
    return {"deployed": deployed, "rows": rows, "table": table}


def _table(rows: list[dict], timing: dict | None, batch: int, chosen: dict) -> str:
    headers = ["rule", "lambda", "val loss", "mean layers (val)"] + ([f"gen tok/s b={batch}"] if timing else [])
    body = []
    for r in rows:
        lam = "-" if not math.isfinite(r["threshold"]) else f"{r['threshold']:.4g}"
        speed = [f"{timing[r['row']]['generate'][batch]:.0f}"] if timing else []
        mark = " (deployed)" if r is chosen else ""
        body.append([r["row"] + mark, lam, "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
                     f"{r['mean_layers']:.2f}"] + speed)
    return markdown_table(headers, body)

"""The language model's evaluation: every rule calibrated on validation tokens, then scored with real early exit on
the test split, its greedy generations compared with its backbone's full depth, and generation and scoring timed
side by side (torch.inference_mode, best of ``eval.timing_rounds`` passes, the same prompts for every row).

Rows: the plain GPT at full depth; deep supervision at full depth and with CALM's margin rule (certified); Stage I
at full depth, with the policy, CALM's margin and saturation rules and the cheapest certified fixed exit (each
certified); Stage I's oracle exits (a bound: they need the labels); LayerSkip's self-speculative decoding on
Stage I (batch 1; of the draft plans that the exits' agreement with full depth on validation ranks first, the
fastest on a validation prompt, :func:`draft_plan`; its tokens are Stage I's full-depth ones exactly).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from ...core.rules import first_crossing
from ...core.timing import fastest_certified, pass_spread, seconds, speed_tie
from ...utils.report import write_json
from .config import LmConfig
from .generate import generate
from .metric import (MeasuredRisk, calibrate_rule, costs_of, oracle_exits, rule_for, score_split, trace_split,
                     windows)
from .models import StepwiseGPT
from .speculative import draft_plans, fastest_draft, self_speculative_decode


def prompts_of(cfg: LmConfig, ids: torch.Tensor) -> torch.Tensor:
    """``eval.prompts`` prompts of ``eval.prompt_length`` tokens from seeded positions of the test split."""
    n = cfg.eval.prompt_length
    starts = torch.randint(ids.numel() - n, (cfg.eval.prompts,), generator=torch.Generator().manual_seed(cfg.seed + 7))
    return ids[starts[:, None] + torch.arange(n)]


#: the draft plans timed (the first by expected tokens per layer run, :func:`~.speculative.draft_plans`)
DRAFT_CANDIDATES = 8


def draft_plan(cfg: LmConfig, s1, val_trace, val_ids: torch.Tensor) -> tuple[int, int, float]:
    """The draft layer and length of Stage I's self-speculative decoding: of the plans that its exits' agreement with
    its full depth on the validation trace ranks first, the fastest on the first validation prompt (k, m, its speed
    over greedy decoding there)."""
    agree = {k: float((val_trace.greedy[:, e] == val_trace.greedy[:, -1]).float().mean())
             for e, k in enumerate(s1.cfg.exit_layers[:-1])}
    plans = draft_plans(agree, s1.cfg.n_layer)[:DRAFT_CANDIDATES] if agree else [(1, 1, 1.0)]
    prompt = prompts_of(cfg, val_ids)[:1]
    return fastest_draft(s1, prompt, plans, cfg.eval.timing_tokens, cfg.eval.timing_rounds)


def _generate_all(view, prompts, n, rule, batch: int = 64):
    """Greedy continuations of every prompt (in batches) and the exit layers of their new tokens."""
    layers = torch.tensor(view.gpt.cfg.exit_layers)
    toks, used = [], []
    with torch.inference_mode():
        for i in range(0, prompts.shape[0], batch):
            out = generate(view, prompts[i:i + batch], n, rule)
            toks.append(out.tokens[:, prompts.shape[1]:])
            used.append(layers[out.exit_steps - 1])
    return torch.cat(toks), torch.cat(used).float()


#: Stage I's certified rules, in the order of the tables
STAGE1_RULES = ("policy", "margin", "saturation", "fixed")


def stage1_row(s1, rule: str, threshold: float, policy) -> tuple:
    """The (label, backbone, model, rule, threshold, policy) row of Stage I's ``rule`` at its certified threshold;
    the fixed rule's threshold is its exit step (full depth's where nothing earlier is certified)."""
    if rule == "fixed":
        step = int(threshold) if math.isfinite(threshold) else len(s1.cfg.exit_layers)
        return f"Stage I + fixed exit {s1.cfg.exit_layers[step - 1]}", "stage1", s1, "fixed", float(step), None
    label = {"policy": "Stage I + policy", "margin": "Stage I + CALM margin", "saturation": "Stage I + CALM saturation"}
    return label[rule], "stage1", s1, rule, threshold, policy if rule == "policy" else None


def _certify(c, trace, gpt, rules, measured) -> dict:
    """Each rule's Learn-then-Test calibration under calibration settings ``c`` (:class:`LmCalibrationConfig`),
    its risk measured by real early exit (``measured``, a :class:`~.metric.MeasuredRisk`)."""
    return {r: calibrate_rule(trace, r, costs_of(gpt), c.risk, c.epsilon, c.delta, c.max_tokens,
                              measured=measured, candidates=c.candidates) for r in rules}


def evaluate_run(cfg: LmConfig, run, vocab, splits, models) -> dict:
    from .report import write_reports

    run_dir, log, ctx = Path(run.run_dir), run.log, cfg.model.context
    val, test = windows(splits.val, ctx), windows(splits.test, ctx)
    base, deep, (s1, policy) = models["baseline"][0], models["deep"][0], models["stage2"]
    log("calibrating on the validation split ...")
    val_trace = trace_split(s1, *val, policy)  # Stage I's validation trace: calibration, oracle exits, agreement
    deep_trace, gpt_trace = trace_split(deep, *val), trace_split(base, *val)
    exit_losses = {"GPT": gpt_trace.losses.mean(0).tolist(), "deep supervision": deep_trace.losses.mean(0).tolist(),
                   "Stage I": val_trace.losses.mean(0).tolist()}
    gpt_ref, kind = cfg.calibration.reference == "gpt", cfg.calibration.risk
    measured = {"deep": MeasuredRisk(deep, *val, None, gpt_trace if gpt_ref else deep_trace, kind),
                "stage1": MeasuredRisk(s1, *val, policy, gpt_trace if gpt_ref else val_trace, kind)}
    backbones = {"deep": (deep_trace, deep, ["margin"]),
                 "stage1": (val_trace, s1, list(STAGE1_RULES))}
    cal = {k: _certify(cfg.calibration, trace, gpt, rules, measured[k]) for k, (trace, gpt, rules) in backbones.items()}
    lam = {k: {r: c.threshold for r, c in v.items()} for k, v in cal.items()}
    by_epsilon = _certified_by_epsilon(cfg, backbones, measured)
    inf = math.inf
    rows = [("full depth (GPT)", "baseline", base, "full", inf, None),
            ("deep supervision, full depth", "deep", deep, "full", inf, None),
            ("deep supervision + CALM margin", "deep", deep, "margin", lam["deep"]["margin"], None),
            ("Stage I, full depth", "stage1", s1, "full", inf, None),
            *(stage1_row(s1, r, lam["stage1"][r], policy) for r in STAGE1_RULES)]
    test_trace = trace_split(s1, *test, policy)
    planned = oracle_exits(cfg, s1, test_trace, test[0].shape)
    val_planned = oracle_exits(cfg, s1, val_trace, val[0].shape)
    prompts = prompts_of(cfg, splits.test)
    n_new = cfg.eval.new_tokens
    reference = {k: _generate_all(StepwiseGPT(m), prompts, n_new, None)[0]
                 for k, m in (("baseline", base), ("deep", deep), ("stage1", s1))}
    results, token_losses = [], {}
    for label, key, gpt, name, lm, pol in rows:
        log(f"scoring {label} ...")
        rule = rule_for(gpt, name, lm, pol)
        v, t = score_split(gpt, *val, rule), score_split(gpt, *test, rule)
        toks, used = _generate_all(StepwiseGPT(gpt), prompts, n_new, rule)
        token_losses[label] = t.pop("token_losses")
        t.pop("exit_layers"), v.pop("token_losses"), v.pop("exit_layers")
        c = cal.get(key, {}).get(name)
        results.append({"row": label, "backbone": key, "rule": name, "threshold": None if not math.isfinite(lm) else lm,
                        "certified": c.calibration if c is not None else None,
                        "val_loss": v["loss"], **{f"test_{k}": x for k, x in t.items()},
                        "generation_agreement": float((toks == reference[key]).float().mean()),
                        "generation_mean_layers": float(used.mean())})
    v = score_split(s1, *val, None, planned=val_planned)
    t = score_split(s1, *test, None, planned=planned)
    token_losses["Stage I oracle"] = t.pop("token_losses")
    results.append({"row": "Stage I oracle exits (bound: needs labels)", "backbone": "stage1", "rule": "oracle",
                    "threshold": None, "certified": None, "val_loss": v["loss"],
                    **{f"test_{k}": x for k, x in t.items() if k != "exit_layers"},
                    "generation_agreement": None, "generation_mean_layers": None})
    log("timing the draft plans of self-speculative decoding on a validation prompt ...")
    draft, n_draft, gain = draft_plan(cfg, s1, val_trace, splits.val)
    spec = f"self-speculative (draft layer {draft}, {n_draft} drafts)"
    log(f"timing generation and scoring ... ({spec}: {gain:.2f}x greedy decoding on the validation prompt)")
    timing = time_rows(cfg, rows, prompts, test, spec, lambda p, n: self_speculative_decode(s1, p, n, draft, n_draft))
    spec_ok = all(torch.equal(self_speculative_decode(s1, prompts[i:i + 1], n_new, draft, n_draft)
                              .tokens[0, prompts.shape[1]:], reference["stage1"][i]) for i in range(min(10, prompts.shape[0])))
    full_row = next(r for r in results if r["row"] == "Stage I, full depth")
    results.append({**{k: full_row[k] for k in full_row if k.startswith(("test_", "val_"))},
                    "row": spec, "backbone": "stage1", "rule": "speculative", "validation_speedup": gain,
                    "threshold": None, "certified": None, "test_mean_layers": None,
                    "generation_agreement": 1.0 if spec_ok else 0.0, "generation_mean_layers": None})
    fastest, tie = deployable(within_epsilon(cfg, results), timing, s1.cfg.n_layer)
    deployed = {"backbone": fastest["backbone"], "rule": fastest["rule"], "row": fastest["row"],
                "chosen_by": "the fastest batch-1 generation among the plain GPT at full depth, Stage I's "
                             "certified rules and its self-speculative decoding within epsilon of its validation loss "
                             f"(ties within {100 * tie:.1f} %, the timing's spread, to fewer layers, then the GPT)",
                "tie": tie,
                "thresholds": {r: (None if not math.isfinite(x) else x) for r, x in lam["stage1"].items()},
                "speculative": {"draft_layer": draft, "num_draft": n_draft},
                "calibration": {k: {r: c.to_dict() for r, c in v.items()} for k, v in cal.items()}}
    write_json(deployed, run_dir / "deployed.json")
    h2h = _head_to_head(cfg, test_trace, costs_of(s1)) if cfg.eval.head_to_head else None
    propagation = _propagation_against_recompute(results, test_trace, s1.cfg.exit_layers)
    out = {"results": results, "timing": timing, "deployed": deployed, "head_to_head": h2h, "exit_losses": exit_losses,
           "by_epsilon": by_epsilon, "propagation": propagation,
           "prompts": int(prompts.shape[0]), "new_tokens": n_new, "test_tokens": int(test[0].numel()),
           "val_tokens": int(val[0].numel())}
    write_reports(cfg, run_dir, out, test_trace, s1)
    log(f"deployed: {deployed['row']} (the fastest at batch 1 that keeps the plain GPT's quality)")
    return out


#: the quality losses (nats, or disagreement) at which every rule's certified depth is reported beside the run's own
EPSILONS = (0.005, 0.01, 0.02, 0.05, 0.1)


def _certified_by_epsilon(cfg: LmConfig, backbones: dict, measured: dict) -> list[dict]:
    """Each rule's certified mean layers on validation at each of :data:`EPSILONS` (and the run's epsilon): how much
    of the depth a user gives up quality for, rule by rule (each threshold's real early exit scored once for all)."""
    out = []
    for eps in sorted({*EPSILONS, cfg.calibration.epsilon}):
        c, at = replace(cfg.calibration, epsilon=eps), {}
        for key, (trace, gpt, rules) in backbones.items():
            for r, cal in _certify(c, trace, gpt, rules, measured[key]).items():
                at[f"{key}-{r}"] = cal.calibration["mean_cost"] * gpt.cfg.n_layer
        out.append({"epsilon": eps, "mean_layers": at})
    return out


def within_epsilon(cfg: LmConfig, results: list[dict]) -> dict[str, dict]:
    """The rows a user may deploy, by rule name: the plain GPT at full depth ("baseline", ``results[0]``), and Stage
    I's certified rules and its self-speculative decoding (Stage I's full-depth tokens) whose validation loss is
    within epsilon of the GPT's (a rule certified against Stage I's own full depth may still lose to the GPT)."""
    gpt_row = results[0]
    keeps = gpt_row["val_loss"] + (cfg.calibration.epsilon if cfg.calibration.risk == "loss" else 0.0)
    return {"baseline": gpt_row, **{r["rule"]: r for r in results if r["backbone"] == "stage1" and r["rule"] in
                                    ("policy", "margin", "saturation", "fixed", "speculative")
                                    and r["val_loss"] <= keeps}}


def deployable(rows: dict[str, dict], timing: dict, L: int, batch: int = 1,
               layers: str = "test_mean_layers") -> tuple[dict, float]:
    """Of ``rows`` (rule name -> row; "baseline" the plain GPT), the one a user serving at ``batch`` deploys, and
    the tie margin used: the fastest generation there (:func:`~learn2stop.core.timing.fastest_certified`), speeds
    closer than the timing's own spread (:func:`~learn2stop.core.timing.speed_tie`) counting as a tie that goes to
    fewer layers (the row's ``layers``), then to the GPT."""
    timed = {n: timing[r["row"]] for n, r in rows.items() if r["row"] in timing}
    speeds = {n: t["generate"].get(batch) for n, t in timed.items()}
    costs = {n: None if r.get(layers) is None else r[layers] / L for n, r in rows.items()}  # speculative: None
    tie = speed_tie([t["spread"].get(batch) for t in timed.values()])
    return rows[fastest_certified(speeds, costs, tie) or "baseline"], tie


def _propagation_against_recompute(results: list[dict], trace, exit_layers: list[int]) -> list[dict]:
    """What state propagation costs in quality: each early-exit rule of Stage I at its certified threshold on the
    test split, with a stopped token's later keys and values propagated (real early exit, what is deployed) and
    recomputed in full (the trace: every token runs every block for its cache, the exit only reads out early;
    no block is saved). The stops may differ: later tokens' states differ with the cache they attend to."""
    layers = torch.tensor(exit_layers, dtype=torch.float32)
    out = []
    for r in results:
        if r["backbone"] != "stage1" or r["rule"] not in ("policy", "margin", "saturation") or r["threshold"] is None:
            continue
        stops = first_crossing(trace.signals[r["rule"]], r["threshold"])
        out.append({"row": r["row"], "threshold": r["threshold"],
                    "propagated_loss": r["test_loss"], "propagated_layers": r["test_mean_layers"],
                    "recomputed_loss": float(trace.losses.gather(1, (stops - 1)[:, None]).mean()),
                    "recomputed_layers": float(layers[stops - 1].mean())})
    return out


def time_rows(cfg: LmConfig, rows, prompts, test, spec: str | None = None, speculative=None) -> dict:
    """Generation tokens/s at each of ``eval.timing_batches`` and scoring tokens/s, every row in each round (the
    rounds are the passes): the best pass of each, and at each batch size the spread of its passes
    (:func:`~learn2stop.core.timing.pass_spread`), the timing's own noise. ``speculative(prompt, n)``, timed at
    batch 1 as row ``spec``, where given."""
    n, rounds = cfg.eval.timing_tokens, cfg.eval.timing_rounds
    batches = {b: prompts[torch.arange(b) % prompts.shape[0]] for b in cfg.eval.timing_batches}
    x = test[0][:16]
    secs = {label: {"generate": {b: [] for b in batches}, "score": []} for label, *_ in rows}
    if spec is not None:
        secs[spec] = {"generate": {1: []}, "score": []}
    with torch.inference_mode():
        for _ in range(rounds):
            for label, key, gpt, name, lm, pol in rows:
                rule, view = rule_for(gpt, name, lm, pol), StepwiseGPT(gpt)
                for b, p in batches.items():
                    secs[label]["generate"][b].append(seconds(lambda: generate(view, p, n, rule)))
                secs[label]["score"].append(seconds(lambda: score_split(gpt, x, x, rule)))
            if spec is not None:
                secs[spec]["generate"][1].append(seconds(
                    lambda: speculative(batches[1][:1] if 1 in batches else prompts[:1], n)))
    out = {}
    for label, d in secs.items():
        speeds = {b: [b * n / s for s in ts] for b, ts in d["generate"].items()}
        out[label] = {"generate": {b: max(v) for b, v in speeds.items()},
                      "score": x.numel() / min(d["score"]) if d["score"] else None,
                      "spread": {b: pass_spread(v) for b, v in speeds.items()}}
    return out


def _head_to_head(cfg: LmConfig, trace, costs, resamples: int = 200) -> list[dict]:
    """The policy against CALM's rules at equal mean layers (30 .. 90 % of L) on the test trace: the mean
    per-token loss difference (policy minus rule) with a paired bootstrap 95 % interval."""
    from ...core.head_to_head import stops_at_cost

    N = trace.losses.shape[0]
    g = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(N, (resamples, N), generator=g)
    out = []
    for budget in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        at = {}
        for rule in ("policy", "margin", "saturation"):
            stops = stops_at_cost(trace.signals[rule], costs, budget, torch.Generator().manual_seed(1))
            at[rule] = trace.losses.gather(1, (stops - 1)[:, None])[:, 0]
        for rule in ("margin", "saturation"):
            d = at["policy"] - at[rule]
            boot = d[idx].mean(1)
            lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975])).tolist()
            out.append({"budget": budget, "against": rule, "policy_loss": float(at["policy"].mean()),
                        "rule_loss": float(at[rule].mean()), "diff": float(d.mean()), "low": lo, "high": hi})
    return out

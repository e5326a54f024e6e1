"""The language model's reports in the run directory: ``results.md`` / ``.json`` (quality and depth of every row),
``in_time.md`` / ``.json`` (tokens/s of generation at each timed batch and of scoring, in the format
``benchmarks/results.py`` records), ``head_to_head.md`` and ``frontier.png`` (test loss against mean layers: each
rule's threshold sweep on the test trace, and the real early-exit rows; and against batch-1 generation time)."""
from __future__ import annotations

from pathlib import Path

import torch

from ...core.calibration import candidate_thresholds
from ...core.rules import first_crossing
from ...core.timing import fastest_certified
from ...utils.report import markdown_table, new_figure, save_figure, write_json, write_text_atomic

#: the short rule names of the rows (in_time.json's ``rule``)
SHORT = {"full depth (GPT)": "baseline", "deep supervision, full depth": "deep-full",
         "deep supervision + CALM margin": "deep-margin", "Stage I, full depth": "stage1-full",
         "Stage I + policy": "policy", "Stage I + CALM margin": "margin", "Stage I + CALM saturation": "saturation"}


def short_name(row: dict) -> str:
    if row["rule"] == "fixed":
        return "fixed"
    if row["rule"] == "speculative":
        return "speculative"
    if row["rule"] == "oracle":
        return "oracle"
    return SHORT[row["row"]]


def _f(x, digits: int = 3):
    return "-" if x is None else f"{x:.{digits}f}"


def results_table(out: dict, L: int) -> str:
    headers = ["model / rule", "lambda", "val loss", "test loss", "test ppl", "next-token acc", "mean layers",
               "gen. agreement", "gen. mean layers"]
    rows = [[r["row"], _f(r["threshold"], 4), _f(r["val_loss"]), _f(r["test_loss"]), _f(r["test_perplexity"], 2),
             _f(r["test_accuracy"]), _f(r["test_mean_layers"], 2), _f(r["generation_agreement"]),
             _f(r["generation_mean_layers"], 2)] for r in out["results"]]
    return markdown_table(headers, rows)


def in_time_table(out: dict) -> str:
    sizes = sorted({b for t in out["timing"].values() for b in t["generate"]})
    headers = ["model / rule", "test loss", "mean layers"] + [f"gen tok/s b={b}" for b in sizes] + ["score tok/s"]
    rows = []
    for r in out["results"]:
        t = out["timing"].get(r["row"])
        if t is None:
            continue
        rows.append([r["row"], _f(r["test_loss"]), _f(r["test_mean_layers"], 2)]
                    + [_f(t["generate"].get(b), 0) for b in sizes] + [_f(t["score"], 0)])
    return markdown_table(headers, rows)


def in_time_record(cfg, out: dict, L: int) -> dict:
    """in_time.json in the shape ``benchmarks/results.py`` records: speedups over the plain GPT at full depth."""
    sizes = sorted({b for t in out["timing"].values() for b in t["generate"]})
    base_row = out["results"][0]
    base_t = out["timing"][base_row["row"]]["generate"]
    c = cfg.calibration
    keeps = base_row["val_loss"] + (c.epsilon if c.risk == "loss" else 0.0)  # the plain GPT's quality, on validation
    rows = [{"rule": "baseline", "metric": base_row["test_loss"], "mean_steps": float(L)}]
    fastest = {}
    for r in out["results"][1:]:
        t = out["timing"].get(r["row"])
        if t is None:
            continue
        layers = r["test_mean_layers"] if r["test_mean_layers"] is not None else float(L)
        speed = {str(b): (t["generate"][b] / base_t[b]) if b in t["generate"] else None for b in sizes}
        param = r["threshold"]  # the fixed rule's is its exit step: reported as the exit's layer, like mean_steps
        if r["rule"] == "fixed" and param is not None:
            param = float(cfg.model.exit_layers[int(param) - 1])
        rows.append({"rule": short_name(r), "reached": r["val_loss"] <= keeps, "param": param,
                     "metric": r["test_loss"],
                     "mean_steps": layers, "mean_cost": layers / L, "speedup": speed, "label": r["row"],
                     "tokens_per_s": {str(b): v for b, v in t["generate"].items()}, "score_tokens_per_s": t["score"],
                     **({"description": "self-speculative decoding of Stage I's full depth, matched on validation"}
                        if r["rule"] == "speculative" else {})})
    # a row with no layer count (self-speculative decoding) has no cost: its speed does not follow from its layers
    costs = {"baseline": 1.0, **{short_name(r): None if r["test_mean_layers"] is None else r["test_mean_layers"] / L
                                 for r in out["results"][1:] if r["row"] in out["timing"]}}
    for b in sizes:  # the rule deployment would pick with no tie: a full-depth rule's lead is the timing's noise
        speeds = {"baseline": 1.0, **{x["rule"]: x["speedup"][str(b)] for x in rows[1:]
                                      if x["speedup"].get(str(b)) is not None and x["reached"]}}
        fastest[str(b)] = fastest_certified(speeds, costs, 0.0)
    return {"metric": "test loss (nats/char)", "reference": "GPT, full depth", "batch_sizes": sizes,
            "calibration": f"Learn-then-Test per token, {c.risk} risk over "
                           f"{'the GPT' if c.reference == 'gpt' else 'the same backbone'}'s full depth <= "
                           f"{c.epsilon} at delta {c.delta}; fastest: validation loss within {c.epsilon} of the GPT's",
            "deployed": ("baseline" if out["deployed"]["backbone"] == "baseline" else
                         short_name(next(r for r in out["results"] if r["row"] == out["deployed"]["row"]))),
            "fastest": fastest, "rows": rows}


def propagation_table(rows: list[dict]) -> str:
    """Each Stage I rule at its threshold on the test split: the cache of a stopped token's later layers
    propagated (deployed) against recomputed in full (every block run for it)."""
    headers = ["rule", "lambda", "loss, propagated", "layers, propagated", "loss, recomputed", "layers, recomputed",
               "loss difference"]
    return markdown_table(headers, [[r["row"], _f(r["threshold"], 4), _f(r["propagated_loss"]),
                                     _f(r["propagated_layers"], 2), _f(r["recomputed_loss"]),
                                     _f(r["recomputed_layers"], 2), _f(r["propagated_loss"] - r["recomputed_loss"])]
                                    for r in rows])


def exits_table(exit_losses: dict[str, list[float]], layers: list[int]) -> str:
    """Each backbone's mean validation loss at every exit (every token read out there, the context at full depth)."""
    headers = ["backbone"] + [f"exit {k}" for k in layers]
    return markdown_table(headers, [[name] + [_f(x) for x in losses] for name, losses in exit_losses.items()])


def by_epsilon_table(by_epsilon: list[dict], L: int) -> str:
    """Each rule's certified mean layers on validation (of L) at each allowed quality loss epsilon."""
    names = list(by_epsilon[0]["mean_layers"])
    headers = ["epsilon"] + [LABELS.get(n, n) for n in names]
    return markdown_table(headers, [[f"{r['epsilon']:g}"] + [_f(r["mean_layers"][n], 2) for n in names]
                                    for r in by_epsilon])


#: the columns of the certified-depth table
LABELS = {"deep-margin": "deep sup. + margin", "stage1-policy": "Stage I + policy", "stage1-margin": "Stage I + margin",
          "stage1-saturation": "Stage I + saturation", "stage1-fixed": "Stage I + fixed exit"}


def head_to_head_table(h2h: list[dict]) -> str:
    headers = ["budget (share of layers)", "against", "policy loss", "rule loss", "policy - rule", "95 % interval"]
    rows = [[f"{100 * r['budget']:.0f} %", r["against"], _f(r["policy_loss"], 4), _f(r["rule_loss"], 4),
             _f(r["diff"], 4), f"[{r['low']:.4f}, {r['high']:.4f}]"] for r in h2h]
    return markdown_table(headers, rows)


def sweep(trace, rule: str, costs: torch.Tensor, points: int = 40) -> tuple[list[float], list[float]]:
    """(mean layers as a share of L, mean test loss) of ``rule`` over its thresholds, on the test trace."""
    xs, ys = [], []
    for thr in candidate_thresholds(trace.signals[rule], points).tolist():
        stops = first_crossing(trace.signals[rule], thr)
        xs.append(float(costs[stops - 1].mean()))
        ys.append(float(trace.losses.gather(1, (stops - 1)[:, None]).mean()))
    return xs, ys


def write_reports(cfg, run_dir: Path, out: dict, trace, gpt) -> None:
    L = gpt.cfg.n_layer
    costs = torch.tensor(gpt.cfg.exit_layers, dtype=torch.float32) / L
    note = (f"\n\n{out['test_tokens']} test tokens, {out['val_tokens']} validation tokens (calibration); "
            f"generation: {out['prompts']} test prompts x {out['new_tokens']} new tokens, agreement with the same "
            f"backbone's full-depth greedy tokens. Deployed: {out['deployed']['row']}.\n")
    write_text_atomic(run_dir / "results.md", "# Early-exit language model: test split\n\n"
                      + results_table(out, L) + note + "\n## Tokens per second (best of "
                      f"{cfg.eval.timing_rounds}, torch.inference_mode)\n\n" + in_time_table(out) + "\n")
    write_json(out["results"], run_dir / "results.json")
    write_text_atomic(run_dir / "exits.md", "# Validation loss (nats/char) at every exit\n\n"
                      + exits_table(out["exit_losses"], gpt.cfg.exit_layers) + "\n")
    write_json(out["exit_losses"], run_dir / "exits.json")
    c = cfg.calibration
    write_text_atomic(run_dir / "certified.md", f"# Certified mean layers (of {L}) on validation at each epsilon "
                      f"({c.risk} risk over {'the GPT' if c.reference == 'gpt' else 'each backbone'}'s full depth, "
                      f"delta {c.delta})\n\n" + by_epsilon_table(out["by_epsilon"], L) + "\n")
    write_json(out["by_epsilon"], run_dir / "certified.json")
    write_text_atomic(run_dir / "in_time.md", "# Tokens per second (best of "
                      f"{cfg.eval.timing_rounds}, torch.inference_mode)\n\n" + in_time_table(out) + "\n")
    write_json(in_time_record(cfg, out, L), run_dir / "in_time.json")
    write_json(out["timing"], run_dir / "timing.json")
    if out["propagation"]:
        write_text_atomic(run_dir / "propagation.md", "# State propagation against recomputing the skipped layers "
                          "(test split, each rule at its certified threshold)\n\n"
                          + propagation_table(out["propagation"]) + "\n")
    write_json(out["propagation"], run_dir / "propagation.json")
    if out["head_to_head"]:
        write_text_atomic(run_dir / "head_to_head.md", "# The policy against CALM's rules at equal mean layers "
                          "(test trace, paired bootstrap)\n\n" + head_to_head_table(out["head_to_head"]) + "\n")
        write_json(out["head_to_head"], run_dir / "head_to_head.json")
    fig, (ax1, ax2) = new_figure(1, 2, figsize=(11, 4.2))
    curves = {}
    for rule in ("policy", "margin", "saturation", "fixed"):
        xs, ys = sweep(trace, rule, costs)
        curves[rule] = {"mean_cost": xs, "loss": ys}
        ax1.plot([x * L for x in xs], ys, label=f"{rule} (threshold sweep, trace)",
                 marker="." if rule == "fixed" else None)
    for r in out["results"]:
        if r["test_mean_layers"] is not None:
            ax1.scatter([r["test_mean_layers"]], [r["test_loss"]], s=18)
            ax1.annotate(short_name(r), (r["test_mean_layers"], r["test_loss"]), fontsize=7)
        t = out["timing"].get(r["row"])
        if t is not None and 1 in t["generate"]:
            ax2.scatter([1000.0 / t["generate"][1]], [r["test_loss"]], s=18)
            ax2.annotate(short_name(r), (1000.0 / t["generate"][1], r["test_loss"]), fontsize=7)
    ax1.set_xlabel("mean layers per token")
    ax1.set_ylabel("test loss (nats/char)")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("generation ms per token (batch 1)")
    ax2.set_ylabel("test loss (nats/char)")
    save_figure(fig, run_dir / "frontier.png")
    write_json(curves, run_dir / "frontier.json")

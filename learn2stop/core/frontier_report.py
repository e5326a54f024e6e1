"""The frontier's report: its markdown tables (the curves, the head-to-head comparison, the speed at a reference
quality per backend) and its figures in steps or cost and in wall-clock time."""
from __future__ import annotations

from .curves import fastest_at_quality
from .timing import SPEED_KEYS


def head_to_head_markdown(h2h: dict, metric_name: str) -> str:
    """The head-to-head table: a row per policy point, a column per rule, "diff [low, high]" (positive: the policy
    better), and a verdict per cell: ahead / behind when the interval excludes 0, else tie."""
    from ..utils.report import markdown_table

    rules = list(h2h["rows"][0]["rules"]) if h2h["rows"] else []
    rows = []
    for row in h2h["rows"]:
        cells = []
        for r in rules:
            c = row["rules"][r]
            verdict = "ahead" if c["low"] > 0 else "behind" if c["high"] < 0 else "tie"
            dearer = f" (at {100 * c['cost']:.1f} %)" if abs(c["cost"] - row["cost"]) > 0.005 else ""
            cells.append(f"{c['diff']:+.3g} [{c['low']:+.3g}, {c['high']:+.3g}] {verdict}{dearer}")
        rows.append([f"{100 * row['cost']:.1f}", row["metric"], *cells])
    axis = "FLOPs" if h2h["by"] == "cost" else "steps"
    return (f"\n\n## The learned rule against each rule at its cost\n\n"
            f"The policy ({h2h['policy']}) at each of its points, and each rule set on the test samples to spend the "
            f"same ({axis}; a randomised mix of two thresholds where none spends it exactly): the policy's lead in "
            f"{metric_name} (positive: the policy better) and its {100 * h2h['level']:.0f} % paired bootstrap interval "
            f"over the {h2h['samples']} test samples ({h2h['resamples']} resamples). \"tie\": the interval holds 0; "
            f"\"(at x %)\": the rule cannot spend as little, and is compared where it can.\n\n"
            + markdown_table([f"{axis} %", f"policy {metric_name}", *rules], rows, digits=4))


def frontier_markdown(result: dict, x: str = "mean_steps") -> str:
    from ..utils.report import markdown_table

    name = result["metric"]
    rows = []
    for curve, pts in result["curves"].items():
        for p in pts:
            rows.append([curve, p.get("budget", p.get("param", p.get("depth", p.get("price")))), p["mean_steps"],
                         100 * p["mean_cost"], p["metric"], p.get("samples_per_s_batch1"), p.get("samples_per_s_batchN")])
    s = result["summary"]
    frac = s["fraction_to_match_full_depth"]
    gain = s["gain_over_fixed_depth_best"]
    head = (f"# Accuracy-compute frontier ({name}, {'lower' if result['lower_is_better'] else 'higher'} is better)\n\n"
            f"Full depth ({result['num_steps']} steps): {result['full_depth']['metric']:.4g}. "
            f"Policy matches full depth with {'-' if frac is None else f'{100 * frac:.1f} %'} of its steps; "
            f"best gain over fixed depth at equal mean steps: {'-' if gain is None else f'{gain:+.4g}'}"
            + ("" if gain is None else f" (at {100 * s['gain_over_fixed_depth_best_at']:.0f} % of the steps)") + ".\n"
            f"Speeds: samples/s at batch 1 and batch {result['batch_n']}, measured side by side in one process"
            f" on {result['device']} (best of {result.get('speed_passes', 3)} passes"
            + (f", {result['speed_passes_batch1']} at batch 1" if "speed_passes_batch1" in result else "") + ")."
            + ("" if not result.get("policy_overhead") else
               f" The policy's own cost at full depth: +{100 * result['policy_overhead']['batch1']:.0f} % time at batch 1, "
               f"+{100 * result['policy_overhead']['batchN']:.0f} % at batch {result['batch_n']}.")
            + "\n\n")
    table = markdown_table(["curve", "budget / param", "mean steps", "cost %", name, "samples/s @1",
                            f"samples/s @{result['batch_n']}"], rows, digits=3)
    if result.get("head_to_head"):
        table += head_to_head_markdown(result["head_to_head"], name)
    at = result.get("speed_at_quality")
    if not at:
        return head + table
    ref = result["speed_reference"]
    return head + table + "".join(_time_table(result, at, ref, backend)
                                  for backend, at in [(result.get("backend", "torch"), at),
                                                      *result.get("speed_at_quality_by_backend", {}).items()])


def _time_table(result: dict, at: dict, ref: dict, backend: str) -> str:
    """The "In time" table of one backend: each curve's speed where it reaches the reference quality."""
    from ..utils.report import markdown_table

    lines = []  # (speed-up at batch N for the order, row)
    for curve, r in at.items():
        if r["reaches"] and r.get("lower_bound"):  # better than the reference at its cheapest point already
            bound = lambda v: None if v is None else f">= {v:.3g}"
            lines.append((r.get("speedup_batchN"), [f"{curve} (cheapest point)", f"<= {r['mean_steps']:.3g}",
                          bound(r.get("speedup_batch1")), bound(r.get("speedup_batchN")), r.get("samples_per_s_batch1"),
                          r.get("samples_per_s_batchN")]))
        elif r["reaches"]:
            lines.append((r.get("speedup_batchN"), [curve, r["mean_steps"], r.get("speedup_batch1"),
                          r.get("speedup_batchN"), r.get("samples_per_s_batch1"), r.get("samples_per_s_batchN")]))
        else:
            lines.append((None, [curve, f"never (best {r['best_metric']:.4g})", None, None, None, None]))
    lines = [row for _, row in sorted(lines, key=lambda l: -(l[0] or 0))]
    first = result.get("backend", "torch")
    where = "" if backend == first and not result.get("speed_at_quality_by_backend") else \
        f", backend {backend}" + ("" if backend == first else f" (speed-ups against {ref['name']} in {first})")
    fastest = fastest_at_quality(at)
    said = [f"at batch {1 if size == 'batch1' else result['batch_n']} {f['curve']} "
            f"({'>= ' if f['lower_bound'] else ''}{f['speedup']:.3g}x)" for size, f in fastest.items()]
    return (f"\n\n## In time: speed at the quality of {ref['name']} ({ref['metric']:.4g}){where}\n\n"
            + (f"Fastest there: {'; '.join(said)}.\n\n" if said else "")
            + markdown_table(["curve", "mean steps", "speed-up @1", f"speed-up @{result['batch_n']}", "samples/s @1",
                              f"samples/s @{result['batch_n']}"], lines, digits=3))


def frontier_plot(result: dict, path, x: str = "mean_steps") -> None:
    from ..utils.report import new_figure, save_figure

    fig, ax = new_figure(figsize=(6.5, 4.2))
    styles = {"oracle": dict(color="k", ls=":", marker="."), "policy": dict(color="tab:red", marker="o", lw=2),
              "fixed_depth": dict(color="tab:blue", marker="s", ms=3), "baseline_fixed_depth": dict(color="tab:green", marker="^", ms=3)}
    scale = 100.0 if x == "mean_cost" else 1.0
    for name, pts in result["curves"].items():
        pts = sorted(pts, key=lambda p: p[x])
        ax.plot([scale * p[x] for p in pts], [p["metric"] for p in pts], label=name, **styles.get(name, dict(marker="x", ms=4)))
    f = result["full_depth"]
    ax.axhline(f["metric"], color="gray", lw=0.8, ls="--", label="full depth")
    ax.set_xlabel("mean cost (% of full)" if x == "mean_cost" else "mean steps")
    ax.set_ylabel(result["metric"])
    ax.set_title(result.get("title", "accuracy-compute frontier"), fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plt_null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def frontier_time_plot(result: dict, path) -> None:
    """The frontier in wall-clock time: metric against milliseconds per sample, at batch 1 and the large batch."""
    from ..utils.report import new_figure, save_figure

    fig, axes = new_figure(figsize=(10, 4.2), ncols=2)
    for ax, key, label in zip(axes, SPEED_KEYS, ("batch 1", f"batch {result['batch_n']}")):
        for name, pts in result["curves"].items():
            pts = sorted((p for p in pts if p.get(key)), key=lambda p: p["mean_steps"])  # in the curve's order
            if pts:
                ax.plot([1e3 / p[key] for p in pts], [p["metric"] for p in pts], label=name, marker=".", ms=4,
                        lw=2 if name == "policy" else 1)
        ref = result.get("speed_reference")
        if ref:
            ax.axhline(ref["metric"], color="gray", lw=0.8, ls="--", label=ref["name"])
        ax.set_xlabel(f"ms per sample ({label}, {result['device']})")
        ax.set_ylabel(result["metric"])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt_null_formatter())
    axes[0].legend(fontsize=6)
    save_figure(fig, path)

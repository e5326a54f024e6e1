"""The pieces of MAML's ``evaluate`` report: mean and 95% CI per method, stop step by shot count, ``results.md`` and
the ``stop_by_shot.png`` figure."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .metric import confidence_interval


def summarize(values: Tensor, scale: float = 1.0) -> dict[str, float]:
    """Mean and 95% half-width of per-task values (times ``scale``, e.g. 100 for accuracy in %)."""
    mean, half = confidence_interval(values * scale)
    return {"mean": mean, "ci95": half}


def stop_steps_by_shot(shots: Tensor, stop_times: Tensor) -> dict[int, dict[str, Any]]:
    """Per shot count K: tasks, mean stop step and the histogram of stop steps 1..max."""
    out = {}
    for k in sorted(set(shots.tolist())):
        s = stop_times[shots == k]
        out[int(k)] = {"tasks": int(s.numel()), "mean_stop": float(s.float().mean()),
                       "hist": torch.bincount(s, minlength=int(stop_times.max()) + 1)[1:].tolist()}
    return out


#: the paper's Omniglot accuracies (%, 95 % CI) by (N-way, k_min, k_max): Table 4 (task-imbalanced) and Table 5 (vanilla)
PAPER_OMNIGLOT = {
    (20, 1, 5): {"table": "Table 4", "MAML": (97.96, 0.3), "MAML-stop": (98.45, 0.2)},
    (5, 1, 1): {"table": "Table 5", "MAML": (98.7, 0.4), "MAML-stop": (99.62, 0.22)},
    (5, 5, 5): {"table": "Table 5", "MAML": (99.1, 0.1), "MAML-stop": (99.68, 0.12)},
    (20, 1, 1): {"table": "Table 5", "MAML": (95.8, 0.3), "MAML-stop": (96.05, 0.35)},
    (20, 5, 5): {"table": "Table 5", "MAML": (98.9, 0.2), "MAML-stop": (98.94, 0.10)},
}


def paper_reference(source: str, n_way: int, k_min: int, k_max: int) -> dict | None:
    """The paper's MAML and MAML-stop accuracies for this Omniglot setting, or None where the paper has none."""
    return PAPER_OMNIGLOT.get((n_way, k_min, k_max)) if source.startswith("omniglot") else None


def _paper_cell(method: str, paper: dict | None) -> str:
    """The paper's number for a table row: MAML's for the baseline row, MAML-stop's for the learned stop's."""
    if paper is None:
        return ""
    key = "MAML" if method.startswith("MAML (") else "MAML-stop" if method.startswith("MAML-stop (") else None
    return "" if key is None else f"{paper[key][0]:.2f} +- {paper[key][1]:.2f}"


def results_markdown(result: dict, title: str, num_steps: int) -> str:
    """``results.md``: the methods' table with 95% CIs (the paper's beside where it has the setting), the rule and
    steps computed, stop step by shot."""
    from ...utils.report import markdown_table

    name = f"{result['metric']} ({'lower' if result['lower_is_better'] else 'higher'} is better)"
    paper = result.get("paper")
    headers = ["method", name, "95% CI +-"] + ([f"paper ({paper['table']})"] if paper else [])
    table = markdown_table(headers, [[k, v["mean"], v["ci95"]] + ([_paper_cell(k, paper)] if paper else [])
                                     for k, v in result["rows"].items()], digits=3 if result["lower_is_better"] else 2)
    shots = markdown_table(["K (shots)", "tasks", "mean stop step"],
                           [[k, v["tasks"], v["mean_stop"]] for k, v in result["stop_by_shot"].items()])
    steps = result["inner_steps_computed"]
    return (f"# MAML vs MAML-stop: {title}\n\n{table}\n\nMAML-stop stops with the {result['rule']}. Inner steps "
            f"computed: MAML {steps['maml']}, MAML-stop {steps['maml_stop']} (mean stop step "
            f"{result['mean_stop_step']:.2f} of {num_steps}).\n\n## Stop step by shot count\n\n{shots}\n")


def plot_stop_by_shot(by_shot: dict, num_steps: int, path: Path) -> Path:
    """Stacked distribution of the stop step for each shot count, with the mean marked."""
    from ...utils.report import new_figure, save_figure

    fig, ax = new_figure(figsize=(6, 3.5))
    ks = sorted(by_shot)
    hists = torch.tensor([by_shot[k]["hist"] + [0] * (num_steps - len(by_shot[k]["hist"])) for k in ks], dtype=torch.float)
    frac = hists / hists.sum(dim=1, keepdim=True).clamp_min(1)  # (K values, T)
    bottom = torch.zeros(len(ks))
    cmap = __import__("matplotlib").colormaps["viridis"]
    for t in range(num_steps):
        ax.bar(ks, frac[:, t], bottom=bottom, color=cmap(t / max(num_steps - 1, 1)), label=f"t={t + 1}")
        bottom += frac[:, t]
    ax2 = ax.twinx()
    ax2.plot(ks, [by_shot[k]["mean_stop"] for k in ks], "k-o", label="mean stop step")
    ax2.set_ylim(0.5, num_steps + 0.5)
    ax2.set_ylabel("mean stop step")
    ax.set_xlabel("shots K of the task")
    ax.set_ylabel("fraction of tasks")
    ax.set_title("MAML-stop: stop step by shot count")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    return save_figure(fig, path)

"""Sparse recovery's report: Tables 1 and 2 beside the paper's numbers, the training curves, Figure 4."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ...utils.report import markdown_table
from .config import SparseConfig
from .data import SparseBatch
from .metric import db_ratio

PAPER_TABLE1 = {  # Table 1 of the paper: NMSE (dB) mixed / 20 / 30 / 40
    "FISTA (T=100)": (-18.96, -16.75, -20.46, -20.97),
    "ISTA (T=100)": (-14.66, -13.99, -14.99, -15.07),
    "ISTA (T=20)": (-9.17, -9.12, -9.24, -9.16),
    "FISTA (T=20)": (-11.12, -10.98, -11.19, -11.19),
    "LISTA (T=20)": (-17.53, -16.53, -18.07, -18.20),
    "LISTA-stop (T<=20)": (-22.41, -20.29, -23.90, -24.21),
}
PAPER_TABLE2 = {  # Table 2: training algorithms for LISTA-stop
    "AEVB": (-21.92, -19.92, -23.27, -23.58),
    "Stage I+II": (-22.41, -20.29, -23.90, -24.21),
    "Stage I+II+III": (-22.78, -20.59, -24.29, -24.73),
}


def _curve(errs: torch.Tensor, data: SparseBatch) -> list[float]:
    """NMSE (dB) of every step over the whole set."""
    return db_ratio(errs.sum(0), data.x.pow(2).sum()).tolist()


def _tables(results: dict, cfg: SparseConfig) -> tuple[str, str]:
    """Tables 1 and 2, each cell "ours (paper)"; the paper's columns are mixed, SNR 20, 30, 40."""
    snrs = [f"{s:g}" for s in cfg.problem.snrs]
    paper_cols = {"mixed": 0, "20": 1, "30": 2, "40": 3}
    headers = ["model", "mixed (paper)", *[f"SNR {s} (paper)" for s in snrs], "mean depth"]

    def cell(value, paper, key):
        if value is None:
            return None
        return f"{value:.2f}" + (f" ({paper[paper_cols[key]]:.2f})" if paper and key in paper_cols else "")

    def row(label, paper_key):
        r = results["rows"][label]
        paper = PAPER_TABLE1.get(paper_key) or PAPER_TABLE2.get(paper_key)
        depth = results["depth"].get(label, {}).get("mean")
        return [label, cell(r["mixed"], paper, "mixed"), *[cell(r.get(s), paper, s) for s in snrs], depth]

    T = cfg.lista.num_steps
    deep_first = sorted(cfg.classical.depths, reverse=True)  # the paper's order: FISTA-100, ISTA-100, ISTA-20, FISTA-20
    order = [f"{a} (T={d})" for i, d in enumerate(deep_first) for a in (("FISTA", "ISTA") if i % 2 == 0 else ("ISTA", "FISTA"))]
    rows1 = [row(k, k) for k in order]
    rows1.append(row(f"LISTA (T={T})", "LISTA (T=20)"))
    if f"LISTA (T={T}), equal budget" in results["rows"]:
        rows1.append(row(f"LISTA (T={T}), equal budget", None))
    rows1.append(row(f"LISTA-stop (T<={T})", "LISTA-stop (T<=20)"))
    rows1 += [row(k, None) for k in results["rows"] if k.startswith("LISTA-stop, ")]
    rows2 = [row(k, k) for k in ("AEVB", "Stage I+II", "Stage I+II+III") if k in results["rows"]]
    return markdown_table(headers, rows1), markdown_table(headers, rows2)


def training_curves(cfg: SparseConfig, run_dir: str | Path, energy: float) -> dict[str, list[list[float]]]:
    """Validation NMSE (dB) against cumulative training seconds, from ``metrics.jsonl`` (``energy``: the mean
    ||x*||^2 of the validation set, which turns the logged mean squared errors into dB).

    ``LISTA``: the baseline, then (with ``equal_budget``) ``lista_equal``. ``LISTA-stop``: the shared
    baseline, Stage I at full depth, then the policy's early exit from Stage II on (and Stage III's).
    ``LISTA-stop oracle``: Stage I's best step per sample, the bound the policy is trained towards.
    Each curve is a list of [seconds, dB]; with a price on steps the oracle and policy scores are priced,
    so only full-depth points are drawn. Records without ``seconds`` (older runs) give empty curves.
    """
    from ...utils.report import read_jsonl

    by_stage: dict[str, list[dict]] = {}
    for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if "seconds" in r:
            by_stage.setdefault(r["stage"], []).append(r)
    priced = any(getattr(cfg, s).inherit(cfg.method).price for s in ("stage1", "stage2", "stage3"))

    def points(stage, key, offset):
        return [[offset + r["seconds"], 10 * math.log10(r[key] / energy)] for r in by_stage.get(stage, [])
                if r.get(key) is not None and r[key] > 0]

    def end(stage):
        return by_stage[stage][-1]["seconds"] if by_stage.get(stage) else 0.0

    t_base = end("baseline")
    base = points("baseline", "val_last", 0.0)
    curves = {"LISTA": base + points("lista_equal", "val_last", t_base),
              "LISTA-stop": base + points("stage1", "val_last", t_base), "LISTA-stop oracle": []}
    if not priced:
        t2 = t_base + end("stage1")
        curves["LISTA-stop"] += points("stage2", "val_policy", t2) + points("stage3", "val_policy", t2 + end("stage2"))
        curves["LISTA-stop oracle"] = points("stage1", "val_oracle", t_base)
    return curves


def _training_figure(curves: dict, out_dir: Path) -> None:
    from ...utils.report import new_figure, save_figure

    if not any(curves.values()):
        return
    fig, ax = new_figure(figsize=(5.5, 3.5))
    for name, style in (("LISTA", "tab:orange"), ("LISTA-stop", "tab:red"), ("LISTA-stop oracle", "tab:gray")):
        pts = curves.get(name) or []
        if pts:
            ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], label=name, color=style,
                    linestyle=":" if "oracle" in name else "-", marker=".")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("validation NMSE (dB)")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, out_dir / "training_curve.png")


def _figure4(q: torch.Tensor | None, errs: torch.Tensor | None, data: SparseBatch, curves: dict, out_dir: Path) -> None:
    """Figure 4: (a) mean stop-time distribution over the test set; (b) NMSE vs iteration."""
    from ...utils.report import new_figure, save_figure

    if q is None:
        return
    T = q.shape[1]
    fig, ax = new_figure(figsize=(5, 3.5))
    ax.bar(range(1, T + 1), q.mean(0).numpy(), color="tab:red")
    ax.set_xlabel("stop step t")
    ax.set_ylabel("mean q_phi(t) over test set")
    ax.set_title("LISTA-stop stop-time distribution")
    save_figure(fig, out_dir / "fig4_stop_distribution.png")

    fig, ax = new_figure(figsize=(5, 3.5))
    for name, style in (("ISTA", "tab:blue"), ("FISTA", "tab:green"), ("LISTA", "tab:orange")):
        if name in curves:
            c = curves[name]
            ax.plot(range(1, len(c) + 1), c, label=name, color=style)
    # LISTA-stop: q-weighted NMSE at each step where it puts mass (paper Fig. 4b)
    w = q.sum(0)
    mean_sq = data.x.pow(2).sum(1).mean()
    weighted = (q * errs).sum(0) / w.clamp_min(1e-12) / mean_sq
    mask = w / q.shape[0] > 1e-3
    steps = torch.arange(1, T + 1)[mask]
    ax.scatter(steps.numpy(), (10 * torch.log10(weighted[mask])).numpy(), color="tab:red", label="LISTA-stop (q-weighted)", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("NMSE (dB)")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, out_dir / "fig4_convergence.png")

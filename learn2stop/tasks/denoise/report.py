"""The evaluation's report: per-sigma summaries, BM3D scores, wall-clock per image, Table 6 and the crops figure
(PSNR itself is in :mod:`.metric`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ...core import run_with_early_exit
from ...utils.report import markdown_table, new_figure, save_figure
from .metric import psnr
from .models import bm3d_available, bm3d_denoise

#: paper Table 6 (BSD68, PSNR dB) at sigma 35, 45, 55, 65, 75.
PAPER_TABLE6 = {
    "sigmas": (35, 45, 55, 65, 75),
    "DnCNN-stop": (27.61, 26.59, 25.79, 23.56, 18.62),
    "DnCNN": (27.60, 26.56, 25.71, 22.19, 17.90),
    "BM3D": (26.81, 25.97, 25.21, 24.60, 24.08),
}


def summarise(per_image: list[dict], sigmas: Sequence[float]) -> list[dict]:
    """Mean of every numeric field per sigma, then over all samples (the row "mean")."""
    def mean_row(label: str, rows: list[dict]) -> dict:
        keys = dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "sigma")
        return {"sigma": label, "images": len(rows),
                **{k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}}
    return [mean_row(f"{s:g}", [r for r in per_image if r["sigma"] == s]) for s in sigmas] + [mean_row("mean", per_image)]


def bm3d_scores(items: Sequence, enabled: bool, max_images: int, log: Callable[[str], None]) -> tuple[dict, str]:
    """BM3D (noise level given) on the samples of the first ``max_images`` images (0 = all).

    Returns ({sample index: {"psnr_bm3d", "sec_bm3d"}}, a note for the table).
    """
    if not enabled:
        return {}, "BM3D: off"
    if not bm3d_available():
        log("denoise: the optional 'bm3d' package is not installed (pip install bm3d): BM3D column skipped")
        return {}, "BM3D: not run (package 'bm3d' not installed)"
    names = list(dict.fromkeys(s.name for s in items))
    keep = set(names if max_images == 0 else names[:max_images])
    out = {}
    for i, s in enumerate(items):
        if s.name in keep:
            t0 = time.perf_counter()
            den = bm3d_denoise(s.noisy[0, 0].cpu().numpy(), s.sigma)
            out[i] = {"sec_bm3d": time.perf_counter() - t0,
                      "psnr_bm3d": float(psnr(torch.from_numpy(den)[None, None], s.clean.cpu()))}
    return out, "BM3D: noise level given" + ("" if len(keep) == len(names) else f", first {max_images} images only")


@torch.no_grad()
def ms_per_image(models: dict, images: list[Tensor], batch: int = 1, rounds: int = 3) -> dict[str, float]:
    """Wall-clock ms per image of each ``name: (model, rule factory)`` with real early exit.

    ``images``: (1, C, H, W) tensors; consecutive images of one size go together in batches of up to
    ``batch``. The models take turns over ``rounds`` and each keeps its fastest round: on a shared
    machine other jobs only ever slow a round down, and taking turns exposes every model to the
    same load.
    """
    groups, cur = [], [images[0]]
    for x in images[1:]:
        if x.shape == cur[0].shape and len(cur) < batch:
            cur.append(x)
        else:
            groups.append(torch.cat(cur))
            cur = [x]
    groups.append(torch.cat(cur))
    best = {name: float("inf") for name in models}
    cuda = images[0].is_cuda
    for _ in range(rounds):
        for name, (model, factory) in models.items():
            run_with_early_exit(model, groups[0], factory())  # warm-up
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x in groups:
                run_with_early_exit(model, x, factory())
            if cuda:
                torch.cuda.synchronize()
            best[name] = min(best[name], 1000 * (time.perf_counter() - t0) / len(images))
    return best


@torch.no_grad()
def comparison_examples(items: Sequence, sigmas: Sequence[float], models: dict, with_bm3d: bool) -> dict:
    """The first test image at each of ``sigmas``: clean, noisy, BM3D, DnCNN and DnCNN-stop outputs (numpy)."""
    examples = {}
    for s in items:
        if s.name != items[0].name or s.sigma not in sigmas:
            continue
        ex = {"clean": s.clean[0, 0].cpu().numpy(), "noisy": s.noisy[0, 0].cpu().numpy(), "bm3d": None}
        if with_bm3d:
            ex["bm3d"] = bm3d_denoise(ex["noisy"], s.sigma)
        for key, name in (("dncnn", "DnCNN"), ("stop", "DnCNN-stop")):
            model, factory = models[name]
            r = run_with_early_exit(model, s.noisy.to(next(model.parameters()).device), factory())
            ex[key] = r.outputs[0, 0].cpu().numpy()
            if key == "stop":
                ex["depth"] = f"{model.layers_at(int(r.stop_times[0]))}/{model.depth} layers"
        examples[s.sigma] = ex
    return examples


def table6(summary: list[dict], depth: int, bm3d_note: str, ms_per_image: dict | None = None, paper: bool = True,
           timed: int | None = None) -> str:
    """Paper-Table-6-style markdown: mean PSNR per sigma of each method, DnCNN-stop's depth and cost,
    its last and best (oracle) exit; the paper's numbers beside on BSD68; then the time per image
    (``ms_per_image``: {batch size: {method: ms}}, over the first ``timed`` test samples)."""
    has3 = any("psnr DnCNN-stop (III)" in s for s in summary)
    headers = ["sigma", "DnCNN-stop", "DnCNN", "BM3D", *(["Stage III"] if has3 else []), "stop layers",
               "stop MACs %", "stop: last / oracle exit", "ms/img BM3D"]
    if paper:
        headers += ["paper DnCNN-stop", "paper DnCNN", "paper BM3D"]
    rows = []
    for s in summary:
        row = [s["sigma"], s["psnr DnCNN-stop"], s["psnr DnCNN"], s.get("psnr_bm3d"),
               *([s.get("psnr DnCNN-stop (III)")] if has3 else []), f"{s['stop_layers']:.2f} / {depth}",
               100 * s["stop_cost"], f"{s['psnr_stop_last']:.2f} / {s['psnr_stop_oracle']:.2f}",
               None if "sec_bm3d" not in s else 1000 * s["sec_bm3d"]]
        if paper:
            sigma = int(s["sigma"]) if s["sigma"].isdigit() else None
            k = PAPER_TABLE6["sigmas"].index(sigma) if sigma in PAPER_TABLE6["sigmas"] else None
            row += [None if k is None else PAPER_TABLE6[m][k] for m in ("DnCNN-stop", "DnCNN", "BM3D")]
        rows.append(row)
    over = "" if timed is None else f", the first {timed} test samples"
    timing = "".join(f"\n\nms per image at batch {b} (fastest of interleaved rounds{over}): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()) for b, ms in (ms_per_image or {}).items())
    return (f"PSNR (dB, data range 1, clamped), mean over test images; {bm3d_note}; stop MACs in % of "
            f"DnCNN-stop's full depth\n\n" + markdown_table(headers, rows, digits=2) + timing)


def comparison_figure(examples: dict, crop: int, path: Path) -> Path:
    """Crops of ground truth, noisy, BM3D, DnCNN and DnCNN-stop, one row per sigma."""
    cols = [("clean", "ground truth"), ("noisy", "noisy"), ("bm3d", "BM3D"), ("dncnn", "DnCNN"), ("stop", "DnCNN-stop")]
    fig, axes = new_figure(len(examples), len(cols), figsize=(2.4 * len(cols), 2.5 * len(examples)), squeeze=False)
    for r, (sigma, ex) in enumerate(sorted(examples.items())):
        h, w = ex["clean"].shape
        c = min(crop, h, w)
        y0, x0 = (h - c) // 2, (w - c) // 2
        for k, (key, title) in enumerate(cols):
            ax = axes[r][k]
            ax.axis("off")
            img = ex[key]
            if img is None:
                ax.set_title(f"{title}\n(not run)", fontsize=8)
                continue
            ax.imshow(np.clip(img[y0:y0 + c, x0:x0 + c], 0, 1), cmap="gray", vmin=0, vmax=1)
            label = f"{title} sigma={sigma:g}" if key == "noisy" else title
            if key != "clean":
                p = 10 * np.log10(1.0 / max(float(np.mean((np.clip(img, 0, 1) - ex["clean"]) ** 2)), 1e-12))
                label += f"\n{p:.2f} dB" + (f", {ex['depth']}" if key == "stop" else "")
            ax.set_title(label, fontsize=8)
    return save_figure(fig, path)

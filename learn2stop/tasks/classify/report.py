"""Early-exit recognition's report: ``table7.md``, every training's accuracy per exit, the exit rules at equal FLOPs
and the deployed operating point, beside the paper's Table 7."""
from __future__ import annotations

from ...utils.report import markdown_table

PAPER_TABLE7 = {"VGG16": 58.60, "SDN training (best IC)": 77.78, "Stage I (oracle exit)": 83.26}


def table7_markdown(result: dict, cfg, num_images: int) -> str:
    """``table7.md`` of an ``evaluate`` result (cfg: the run's ClassifyConfig; ``num_images``: test images)."""
    rows, rule_rows, deployed = result["table"], result["rules_at_equal_flops"], result["deployed"]
    full_flops = result["full_network_flops"]
    stop_line = ""
    if "stop_model" in deployed:  # the network alone is deployed: the stop model's own operating point beside it
        stop_row = deployed["stop_model"]
        stop_line = (f" The stop model with its configured rule ({cfg.inference.rule} {cfg.inference.param:g}): "
                     f"{stop_row['accuracy']:.2f} % at {100 * stop_row['flops_fraction']:.1f} %.")
    table = markdown_table(["training", "final classifier %", "best single exit %", "best exit", "oracle exit %"], rows)
    rules = markdown_table(["rule", "budget (FLOPs share, validation)", "test accuracy %", "test FLOPs % of network",
                            "mean exit"], rule_rows)
    paper = ", ".join(f"{k} {v:.2f}" for k, v in PAPER_TABLE7.items())
    return (f"# Table 7: early-exit recognition ({cfg.model.arch}, {cfg.data.kind}, {num_images} test images)\n\n"
            f"{table}\n\nPaper (VGG16-BN, Tiny-ImageNet): {paper}.\n\n## Exit rules at equal FLOPs\n\n{rules}\n\n"
            f"Deployed ({deployed['rule']}): {deployed['accuracy']:.2f} % at {100 * deployed['flops_fraction']:.1f} % "
            f"of the network's FLOPs ({full_flops / 1e6:.1f} MFLOPs per image).{stop_line}\n")

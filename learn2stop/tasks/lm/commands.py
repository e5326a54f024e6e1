"""The language model's commands: train, evaluate, reproduce, generate (the CLI calls exactly these).

Every input is checked before the run directory is touched: the corpus (missing, empty, not UTF-8, a split shorter
than the context + 1), the prompt (empty, longer than the context, characters outside the run's vocabulary) and
the generation length; a refusal names the field and writes nothing.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ...utils.config import ConfigError
from ...utils.report import write_json
from ..base import RunContext, as_run
from .config import LmConfig
from .data import CharVocab, Splits, read_text, split_by_position
from .generate import check_prompt, generate
from .metric import score_split, windows
from .models import StepwiseGPT
from .tokenizer import Vocab
from .train import STAGES, checkpoint_path, train_stages


def load_data(cfg: LmConfig, vocab: Vocab | None = None) -> tuple[Vocab, Splits]:
    """The corpus of ``data.path`` and its vocabulary (the run's when given, else the text's characters or a BPE
    learned from the training part of it, ``data.tokenizer``), each split checked against the context."""
    path = Path(cfg.data.path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no text file at {path} (give --data.path FILE)")
    text = read_text(path)
    if vocab is None and cfg.data.tokenizer == "bpe":
        from .tokenizer import BPEVocab

        vocab = BPEVocab.train(text[:int(len(text) * cfg.data.train_fraction)], cfg.data.vocab_size)
    vocab = vocab or CharVocab.of(text)
    splits = split_by_position(vocab.encode(text, what=f"data.path {path}"), cfg.data.train_fraction)
    need = cfg.model.context + 1
    for name in ("train", "val", "test"):
        n = getattr(splits, name).numel()
        if n < need:
            raise ValueError(f"data.path: the {name} split of {path} has {n} tokens, fewer than the context + 1 "
                             f"({need}); give a longer corpus or a smaller --model.context")
    return vocab, splits


#: where a run keeps its vocabulary: the characters, or the BPE tokenizer's JSON
VOCAB_FILES = {"char": "vocab.json", "bpe": "tokenizer.json"}


def save_vocab(vocab: Vocab, run_dir: Path) -> None:
    from .tokenizer import BPEVocab

    if isinstance(vocab, BPEVocab):
        vocab.save(run_dir / VOCAB_FILES["bpe"])
    else:
        write_json({"chars": vocab.chars}, run_dir / VOCAB_FILES["char"])


def run_vocab(run_dir: Path) -> Vocab:
    """The vocabulary a run was trained with (``vocab.json``, or ``tokenizer.json`` for a BPE)."""
    import json

    run_dir = Path(run_dir)
    if (run_dir / VOCAB_FILES["bpe"]).is_file():
        from .tokenizer import BPEVocab

        return BPEVocab.load(run_dir / VOCAB_FILES["bpe"])
    path = run_dir / VOCAB_FILES["char"]
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no vocab.json: not a trained lm run (run 'learn2stop lm train')")
    return CharVocab(json.loads(path.read_text(encoding="utf-8"))["chars"])


def has_vocab(run_dir: Path) -> bool:
    return any((Path(run_dir) / f).is_file() for f in VOCAB_FILES.values())


def _val_summary(cfg: LmConfig, splits: Splits):
    """The callback that scores a finished stage at full depth on (a part of) the validation split."""
    x, y = windows(splits.val, cfg.model.context, 200)

    def evaluate(stage, gpt, policy):
        full = score_split(gpt, x, y, lambda t, lg, h, hp: torch.zeros(lg.shape[:-1], dtype=torch.bool))
        return {"val_loss_full_depth": full["loss"]}

    return evaluate


def train(cfg: LmConfig, run: RunContext | str | Path) -> dict:
    """Train (or resume) the baseline, deep supervision, Stage I and Stage II; a finished stage is not run again."""
    run = as_run(run)
    vocab, splits = load_data(cfg)  # before the run directory is touched
    run.prepare(cfg, "train")
    run_dir = Path(run.run_dir)
    if has_vocab(run_dir) and run_vocab(run_dir) != vocab:
        raise ValueError(f"data.path: the corpus's vocabulary differs from the one {run_dir} was trained with")
    save_vocab(vocab, run_dir)
    t0 = time.perf_counter()
    out = train_stages(cfg, run_dir, splits.train, len(vocab), run.log, _val_summary(cfg, splits))
    for stage, s in out["summary"].items():
        if "val_loss_full_depth" in s:
            run.log(f"{stage}: validation loss at full depth {s['val_loss_full_depth']:.4f} nats/char")
    summary = {**out["summary"], "seconds": time.perf_counter() - t0}
    write_json(summary, run_dir / "training.json")
    return summary


def load_run(cfg: LmConfig, run: RunContext, command: str, with_data: bool = True):
    """The vocabulary, splits (None without ``with_data``: generation reads no corpus) and trained models of a
    finished run, for a reading command."""
    run.prepare(cfg, command)
    run_dir = Path(run.run_dir)
    vocab = run_vocab(run_dir)
    missing = [s for s in STAGES if not checkpoint_path(run_dir, s).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir}: stage(s) {', '.join(missing)} not trained yet (run 'learn2stop lm train')")
    splits = load_data(cfg, vocab)[1] if with_data else None
    train_ids = splits.train if splits is not None else torch.empty(0, dtype=torch.long)  # every stage is loaded
    models = train_stages(cfg, run_dir, train_ids, len(vocab), log=lambda m: None)["models"]
    return vocab, splits, models


def evaluate(cfg: LmConfig, run: RunContext | str | Path) -> dict:
    """Calibrate every rule on validation tokens, score and time them on the test split; write the tables."""
    from .evaluate import evaluate_run

    run = as_run(run)
    _check_eval(cfg)
    vocab, splits, models = load_run(cfg, run, "evaluate")
    return evaluate_run(cfg, run, vocab, splits, models)


def reproduce(cfg: LmConfig, run: RunContext | str | Path) -> dict:
    """Train (resuming), then evaluate: the tables, the time table and the frontier."""
    run = as_run(run)
    _check_eval(cfg)
    t0 = time.perf_counter()
    training = train(cfg, run)
    out = {"training": training, **evaluate(cfg, run)}
    run.log(f"total wall-clock: {time.perf_counter() - t0:.0f}s")
    return out


def _check_eval(cfg: LmConfig) -> None:
    if cfg.eval.prompt_length + cfg.eval.new_tokens - 1 > cfg.model.context:
        raise ConfigError(f"eval.prompt_length ({cfg.eval.prompt_length}) + eval.new_tokens ({cfg.eval.new_tokens}) "
                          f"- 1 exceeds model.context ({cfg.model.context})", "eval.new_tokens")


def deployed_rule(cfg: LmConfig, run_dir: Path, models: dict):
    """(label, backbone, rule) of ``cfg.exit_rule``: the run's deployed rule, or a named one at its certified threshold."""
    import json
    import math

    from .metric import rule_for

    path = Path(run_dir) / "deployed.json"
    if cfg.exit_rule in ("deployed", "policy", "margin", "saturation", "fixed", "speculative") and not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no deployed.json: run 'learn2stop lm evaluate' first "
                                f"(or --rule full)")
    gpt, policy = models["stage2"]
    if cfg.exit_rule == "full":
        return "full depth (Stage I)", gpt, rule_for(gpt, "full", math.inf)
    deployed = json.loads(path.read_text(encoding="utf-8"))
    if cfg.exit_rule == "deployed" and deployed["backbone"] == "baseline":  # the plain GPT kept the quality fastest
        base = models["baseline"][0]
        return "full depth (GPT)", base, rule_for(base, "full", math.inf)
    name = deployed["rule"] if cfg.exit_rule == "deployed" else cfg.exit_rule
    if name not in deployed["thresholds"]:
        raise ConfigError(f"{path} holds no threshold of the {name!r} rule (its last calibration fitted "
                          f"{', '.join(deployed['thresholds'])}): run 'learn2stop lm calibrate --rule {name}' "
                          f"(or --fastest)", "exit_rule")
    lam = deployed["thresholds"][name]
    lam = math.inf if lam is None else lam
    return f"Stage I + {name} (lambda {lam:.4g})", gpt, rule_for(gpt, name, lam, policy)


def generate_command(cfg: LmConfig, run: RunContext | str | Path) -> dict:
    """Stream a greedy continuation of ``prompt`` with the deployed rule; print mean exit layer and tokens/s."""
    run = as_run(run)
    run_dir = Path(run.run_dir)
    vocab = run_vocab(run_dir)
    prompt = vocab.encode(cfg.prompt, what="prompt")[None]
    if prompt.shape[1] > cfg.model.context:
        raise ConfigError(f"the prompt has {prompt.shape[1]} tokens, more than the model's context "
                          f"({cfg.model.context})", "prompt")
    _, _, models = load_run(cfg, run, "generate", with_data=False)
    plan = _speculative_plan(cfg, run_dir)
    if plan is not None:
        return _generate_speculative(cfg, run, vocab, prompt, models["stage1"][0], plan)
    label, gpt, rule = deployed_rule(cfg, run_dir, models)
    check_prompt(gpt, prompt, cfg.max_new_tokens, window=True)  # before anything is written
    layers = torch.tensor(gpt.cfg.exit_layers)
    out, used = sys.stdout, []

    def show(token: torch.Tensor, exit_step: torch.Tensor) -> None:
        used.append(int(layers[exit_step[0] - 1]))
        out.write(vocab.decode(token))
        out.flush()

    out.write(cfg.prompt)
    t0 = time.perf_counter()
    with torch.inference_mode():
        tokens = generate(StepwiseGPT(gpt), prompt, cfg.max_new_tokens, rule, on_token=show).tokens
    seconds = time.perf_counter() - t0
    mean_layers = sum(used) / len(used)
    out.write("\n")
    run.log(f"[{label}] {len(used)} tokens, mean exit layer {mean_layers:.2f} of {gpt.cfg.n_layer}, "
            f"{len(used) / seconds:.1f} tokens/s")
    return {"text": cfg.prompt + vocab.decode(tokens[0, prompt.shape[1]:]), "mean_layers": mean_layers,
            "tokens_per_s": len(used) / seconds, "rule": label}


def _speculative_plan(cfg: LmConfig, run_dir: Path) -> tuple[int, int] | None:
    """The (draft layer, drafts) of self-speculative decoding, where ``exit_rule`` asks for it or the run deployed
    it; else None."""
    import json

    from .speculative import recorded_draft_plan

    path = Path(run_dir) / "deployed.json"
    if cfg.exit_rule not in ("speculative", "deployed") or not path.is_file():
        return None
    if cfg.exit_rule == "deployed" and json.loads(path.read_text(encoding="utf-8"))["rule"] != "speculative":
        return None
    plan = recorded_draft_plan(path)
    if plan is None:
        raise ConfigError(f"{path} holds no valid self-speculative draft plan (run 'lm evaluate' again)", "exit_rule")
    return plan


def _generate_speculative(cfg: LmConfig, run: RunContext, vocab: Vocab, prompt: torch.Tensor, gpt,
                          plan: tuple[int, int]):
    """Stage I's full-depth greedy continuation by self-speculative decoding (batch 1): the text, its acceptance and
    tokens/s."""
    from .speculative import self_speculative_decode

    t0 = time.perf_counter()
    with torch.inference_mode():
        result = self_speculative_decode(gpt, prompt, cfg.max_new_tokens, *plan)
    seconds = time.perf_counter() - t0
    text = vocab.decode(result.tokens[0, prompt.shape[1]:])
    sys.stdout.write(cfg.prompt + text + "\n")
    label = f"self-speculative (draft layer {plan[0]}, {plan[1]} drafts)"
    n = cfg.max_new_tokens
    run.log(f"[{label}] {n} tokens, {result.accepted} of {result.drafted} drafts accepted, {n / seconds:.1f} tokens/s")
    return {"text": cfg.prompt + text, "tokens_per_s": n / seconds, "rule": label}

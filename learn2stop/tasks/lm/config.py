"""The language model's config: the GPT's shape, where it can exit, how a stopped token's later layers are filled,
and the task's config (data, stages, calibration, evaluation, generation) with its presets."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ...utils.config import (ConfigError, fraction, in_open_unit, int_at_least, non_negative, one_of, positive,
                             positive_int, require)
from ...utils.config_files import preset_config

#: how a token that stops at layer k gets the keys and values of layers k+1..L (CALM's state propagation):
#: ``copy`` feeds its exit hidden state to each later layer's own key/value projection; ``learned`` first maps it
#: by a per-layer linear map, fitted by least squares after each backbone's training (``train.fit_propagation``)
PROPAGATIONS = ("copy", "learned")

#: the per-token stopping policies (``tasks/lm/policy.py``): ``hidden`` reads the hidden state alone, ``signals``
#: the exit's confidence and the state's change
POLICIES = ("hidden", "signals")


@dataclass
class GPTShape:
    """The shape of a small GPT (nanoGPT's): ``n_layer`` pre-norm blocks of width ``n_embd``, and where it exits."""

    context: int = 128
    """The longest sequence the model reads (its position embeddings)."""
    n_layer: int = 6
    """Transformer blocks; a step runs ``exit_every`` of them."""
    n_head: int = 4
    """Attention heads per block (``n_embd`` must be a multiple)."""
    n_embd: int = 128
    """Width of the hidden state."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches while training."""
    exit_every: int = 1
    """An exit (final norm + shared LM head) after every this many blocks, and always after the last."""
    propagation: str = "copy"
    """How a stopped token's later layers get its keys and values: ``copy`` or ``learned`` (see PROPAGATIONS)."""

    def __post_init__(self):
        for name in ("context", "n_layer", "n_head", "n_embd", "exit_every"):
            positive_int(getattr(self, name), name)
        require(self.n_embd % self.n_head == 0, "n_embd",
                f"must be a multiple of n_head ({self.n_head}); got {self.n_embd}")
        require(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout",
                f"must be in [0, 1); got {self.dropout!r}")
        require(self.exit_every <= self.n_layer, "exit_every",
                f"must be at most n_layer ({self.n_layer}); got {self.exit_every}")
        one_of(self.propagation, PROPAGATIONS, "propagation")

    @property
    def exit_layers(self) -> list[int]:
        """The 1-based layers after which the model can exit: every ``exit_every`` blocks, and the last."""
        layers = list(range(self.exit_every, self.n_layer + 1, self.exit_every))
        return layers if layers[-1] == self.n_layer else layers + [self.n_layer]


@dataclass
class GPTConfig(GPTShape):
    """A small character-level GPT: its shape and its vocabulary."""

    vocab_size: int = 65
    """Distinct tokens (characters): 65 for Tiny Shakespeare."""

    def __post_init__(self):
        positive_int(self.vocab_size, "vocab_size")
        super().__post_init__()


@dataclass
class LmDataConfig:
    """The corpus: one UTF-8 text file, split by position into train / validation / test."""

    path: str = "../shared/data/tinyshakespeare/input.txt"
    """The text file."""
    train_fraction: float = 0.9
    """The first this share of the text trains; the rest is halved into validation then test."""
    tokenizer: str = "char"
    """char (the text's characters are the vocabulary) | bpe (a byte-level BPE learned from the training part of
    the text with the ``tokenizers`` library, for word-level corpora; ``pip install 'learn2stop[lm]'``)."""
    vocab_size: int = 1024
    """With ``tokenizer bpe``: the most tokens it learns (the 256 bytes and merges; at least 256)."""

    def __post_init__(self):
        require(isinstance(self.path, str) and self.path != "", "data.path", "must name a text file")
        in_open_unit(self.train_fraction, "data.train_fraction")
        one_of(self.tokenizer, ("char", "bpe"), "data.tokenizer")
        int_at_least(self.vocab_size, "data.vocab_size", 256)


@dataclass
class LmModelConfig(GPTShape):
    """The GPT's shape (its vocabulary size is the corpus's) and the stopping policy's width."""

    policy: str = "hidden"
    """The stopping policy: hidden (reads the hidden state alone) | signals (the exit's confidence and the state's
    change; needs the exit's readout at every exit asked). See ``tasks/lm/policy.py``."""
    policy_hidden: int = 16
    """Hidden units of the stopping policy's MLP (``hidden`` policy: 0 is a linear map per exit)."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except ConfigError as e:
            raise ConfigError(e.reason, f"model.{e.field}") from None
        one_of(self.policy, POLICIES, "model.policy")
        int_at_least(self.policy_hidden, "model.policy_hidden", 0 if self.policy == "hidden" else 1)

    def gpt(self, vocab_size: int) -> GPTConfig:
        """The GPT's config for a corpus of ``vocab_size`` tokens."""
        return GPTConfig(vocab_size=vocab_size, **{f.name: getattr(self, f.name) for f in fields(GPTShape)})


#: deep supervision's exit weights: equal, or LayerSkip's rising with depth (w_t proportional to t)
DEEP_WEIGHTS = ("uniform", "increasing")
STAGE2_TARGETS = ("oracle", "risk")


@dataclass
class LmStageConfig:
    """One training stage: AdamW with linear warm-up then cosine decay to ``lr * min_lr_ratio``."""

    iters: int = 1000
    """Optimiser steps (0 skips the stage)."""
    batch: int = 32
    """Windows of ``model.context`` tokens per step."""
    lr: float = 2e-3
    """Peak learning rate."""
    warmup: int = 100
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.05
    """The cosine decay ends at lr times this."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (matrices only)."""

    def __post_init__(self):
        int_at_least(self.iters, "iters", 0)
        positive_int(self.batch, "batch")
        positive(self.lr, "lr")
        int_at_least(self.warmup, "warmup", 0)
        fraction(self.min_lr_ratio, "min_lr_ratio")
        non_negative(self.weight_decay, "weight_decay")


@dataclass
class LmMethodConfig:
    """The oracle over exits per token: q*(t) proportional to exp(-(CE_t + price * c_t) / beta), c_t = layers / L."""

    beta: float = 1.0
    """Temperature of the oracle (nats). At 0.1 q* puts each token on one exit, and Stage I makes the early exits
    specialists: good on the tokens it sends there, several nats worse than deep supervision's on the others, so that
    any rule's mistake is costly; at 1 every exit keeps learning from every token."""
    price: float = 0.3
    """Price of the full depth in nats: a token may trade this much loss for skipping every layer."""
    full_depth_weight: float = 1.0
    """Stage I adds this times the last exit's CE, so that its full depth keeps the plain GPT's quality (without it
    q* can leave the later layers untrained, and full depth collapses)."""
    deep_weights: str = "uniform"
    """Deep supervision's exit weights: uniform | increasing (LayerSkip-style, w_t proportional to t)."""
    stage2_target: str = "oracle"
    """What Stage II fits: oracle (forward KL to q*, the paper's) | risk (a regression, per token and exit, of the
    risk Learn-then-Test certifies, ``calibration.risk``, against the calibration reference's full depth: the loss
    gain in nats by least squares, or agreement with its greedy token by logistic regression)."""

    def __post_init__(self):
        positive(self.beta, "method.beta")
        one_of(self.stage2_target, STAGE2_TARGETS, "method.stage2_target")
        non_negative(self.price, "method.price")
        non_negative(self.full_depth_weight, "method.full_depth_weight")
        one_of(self.deep_weights, DEEP_WEIGHTS, "method.deep_weights")


RISKS = ("loss", "agreement")


@dataclass
class LmCalibrationConfig:
    """Learn-then-Test on held-out validation tokens: each rule's threshold certified to keep the risk <= epsilon."""

    risk: str = "loss"
    """loss (the token's cross-entropy increase over full depth, nats) | agreement (1 - agreement with the full
    model's greedy token)."""
    reference: str = "gpt"
    """Whose full depth the risk is over: gpt (the plain GPT's, what the deployed model must keep) | own (each
    backbone's own)."""
    epsilon: float = 0.01
    """The allowed mean risk."""
    delta: float = 0.1
    """The bound holds with probability >= 1 - delta."""
    max_tokens: int = 0
    """Calibrate on at most this many validation tokens (0: all)."""
    candidates: int = 40
    """At most this many thresholds per rule (each one tested is a real early-exit pass over validation)."""

    def __post_init__(self):
        one_of(self.risk, RISKS, "calibration.risk")
        one_of(self.reference, ("gpt", "own"), "calibration.reference")
        positive(self.epsilon, "calibration.epsilon")
        in_open_unit(self.delta, "calibration.delta")
        int_at_least(self.max_tokens, "calibration.max_tokens", 0)
        int_at_least(self.candidates, "calibration.candidates", 2)


@dataclass
class LmEvalConfig:
    """The test split's scoring, greedy generation and timing."""

    prompts: int = 200
    """Prompts drawn from the test split for greedy-generation agreement with the full model."""
    prompt_length: int = 16
    """Characters per prompt."""
    new_tokens: int = 100
    """Tokens generated per prompt."""
    timing_batches: tuple[int, ...] = (1, 8, 64)
    """Batch sizes at which generation is timed."""
    timing_rounds: int = 5
    """Timings are the best of this many passes."""
    timing_tokens: int = 96
    """New tokens per timed generation pass."""
    head_to_head: bool = True
    """The policy against CALM's rules at equal mean layers, paired bootstrap."""

    def __post_init__(self):
        for name in ("prompts", "prompt_length", "new_tokens", "timing_rounds", "timing_tokens"):
            positive_int(getattr(self, name), f"eval.{name}")
        require(len(self.timing_batches) > 0 and all(isinstance(b, int) and b >= 1 for b in self.timing_batches),
                "eval.timing_batches", f"must be integers >= 1; got {self.timing_batches}")


@dataclass
class LmConfig:
    """Early-exit character language model: a GPT, deep supervision, Stage I (oracle-weighted exits), Stage II
    (a per-token policy), CALM's rules, all calibrated by Learn-then-Test."""

    #: read-only sections, left out of the run's fingerprint
    reader_fields: ClassVar[tuple[str, ...]] = ("calibration", "eval", "prompt", "max_new_tokens", "exit_rule")
    #: where the data lies
    location_fields: ClassVar[tuple[str, ...]] = ("data.path",)

    seed: int = 0
    """Seed of initialisation and batch order."""
    data: LmDataConfig = field(default_factory=LmDataConfig)
    """The corpus."""
    model: LmModelConfig = field(default_factory=LmModelConfig)
    """The GPT and its policy."""
    method: LmMethodConfig = field(default_factory=LmMethodConfig)
    """The oracle and deep supervision."""
    baseline: LmStageConfig = field(default_factory=lambda: LmStageConfig(iters=1500))
    """The plain GPT, trained at full depth."""
    deep: LmStageConfig = field(default_factory=lambda: LmStageConfig(iters=200, lr=1e-3, warmup=20))
    """Deep supervision, fine-tuned from the baseline's weights."""
    stage1: LmStageConfig = field(default_factory=lambda: LmStageConfig(iters=200, lr=1e-3, warmup=20))
    """Stage I, fine-tuned from deep supervision's weights."""
    stage2: LmStageConfig = field(default_factory=lambda: LmStageConfig(iters=400, batch=16, lr=1e-2, warmup=0,
                                                                        weight_decay=0.0))
    """Stage II: the policy fitted to ``method.stage2_target``, the backbone frozen."""
    calibration: LmCalibrationConfig = field(default_factory=LmCalibrationConfig)
    """Learn-then-Test."""
    eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """Evaluation on the test split."""
    exit_rule: str = "deployed"
    """generate: deployed (the run's certified default) or one of policy, margin, saturation, fixed, full, or
    speculative (Stage I's full-depth tokens by self-speculative decoding, batch 1)."""
    prompt: str = "ROMEO:"
    """generate: the text to continue."""
    max_new_tokens: int = 200
    """generate: tokens to add."""

    def __post_init__(self):
        for name in ("baseline", "deep", "stage1", "stage2"):
            try:
                getattr(self, name).__post_init__()
            except ConfigError as e:
                raise e.within(f"{name}.") from None
        int_at_least(self.seed, "seed", 0)
        one_of(self.exit_rule, ("deployed", "policy", "margin", "saturation", "fixed", "full", "speculative"),
               "exit_rule")
        positive_int(self.max_new_tokens, "max_new_tokens")
        require(isinstance(self.prompt, str) and self.prompt != "", "prompt", "must hold at least one character")
        require(math.isfinite(self.method.price), "method.price", "must be finite")


PRESETS: dict[str, dict] = {
    # a 6 x 128 character GPT on Tiny Shakespeare, exits every 2 blocks, about 17 minutes on two CPU threads; a flat
    # oracle (beta 10) trains every exit; the hidden-state policy regresses the loss that Learn-then-Test bounds
    "quick": {"model": {"exit_every": 2}, "method": {"beta": 10.0, "stage2_target": "risk"}},
    # a few seconds: a 2 x 32 GPT, a handful of steps (tests, smoke runs)
    "tiny": {"model": {"context": 32, "n_layer": 3, "n_head": 2, "n_embd": 32},
             "baseline": {"iters": 30, "batch": 8, "warmup": 5}, "deep": {"iters": 10, "batch": 8, "warmup": 2},
             "stage1": {"iters": 10, "batch": 8, "warmup": 2}, "stage2": {"iters": 30, "batch": 8},
             "eval": {"prompts": 8, "prompt_length": 8, "new_tokens": 12, "timing_batches": [1, 4],
                      "timing_rounds": 1, "timing_tokens": 8}, "max_new_tokens": 16},
}


def preset(name: str = "quick", **overrides: Any) -> LmConfig:
    """The config of preset ``name`` with dotted-field overrides."""
    return preset_config(LmConfig, PRESETS, name, "lm", **overrides)

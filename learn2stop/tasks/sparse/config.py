"""The sparse-recovery config: problem, LISTA, policy, classical baselines, stages, and the presets."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ...core import InferenceConfig, MethodConfig, StageConfig
from ...runtime.registry import get_rule
from ...core.objectives import stage_field
from ...utils.config import ints_at_least, merge, non_empty, one_of, positive, positive_int, require
from ...utils.config_files import preset_config


@dataclass
class ProblemConfig:
    """Sizes and noise of the problem; defaults are the paper's (m=250, n=500, p=0.1, SNR 20/30/40)."""

    m: int = 250
    """Measurements: rows of the matrix A."""
    n: int = 500
    """Signal length: columns of A."""
    sparsity: float = 0.1
    """Share of non-zero entries of each signal (Bernoulli-Gaussian), in (0, 1]."""
    snrs: tuple[float, ...] = (20.0, 30.0, 40.0)
    """Noise levels in dB of the training mix and of the test sets, one test set each."""
    matrix: str = "gaussian"
    """gaussian (i.i.d., unit-norm columns) or cond5 (its singular values re-spread to condition_number)."""
    condition_number: float = 5.0
    """With matrix cond5: the condition number of A, >= 1."""
    matrix_seed: int = 0
    """Seed of A."""
    test_per_snr: int = 1000
    """Test problems per noise level."""
    test_seed: int = 1
    """Seed of the test sets."""
    val_per_snr: int = 500
    """Validation problems per noise level (selection and calibration)."""
    val_seed: int = 2
    """Seed of the validation sets."""

    def __post_init__(self):
        ints_at_least(self, "m", "n", "test_per_snr", "val_per_snr")
        require(0 < self.sparsity <= 1, "sparsity", f"must be in (0, 1]; got {self.sparsity}")
        require(len(self.snrs) >= 1, "snrs", "needs at least one SNR level")
        one_of(self.matrix, ("gaussian", "cond5"), "matrix")
        positive(self.condition_number, "condition_number")
        require(self.condition_number >= 1, "condition_number", f"must be >= 1; got {self.condition_number}")


@dataclass
class LISTAConfig:
    """LISTA: ISTA unrolled for ``num_steps`` steps with learned weights and thresholds."""

    num_steps: int = 20
    """T: the unrolled LISTA steps (the policy picks one of 1..T)."""
    L: float = 3.0
    """ISTA's step size 1/L, from which LISTA's weights start."""
    rho: float = 0.1
    """ISTA's l1 weight, from which LISTA's thresholds start."""
    shrinkage: str = "soft"
    """soft (the paper's soft threshold) or smooth (the release's smoothed one)."""

    def __post_init__(self):
        positive_int(self.num_steps, "num_steps")
        positive(self.L, "L")
        require(self.rho >= 0, "rho", f"must be >= 0; got {self.rho}")
        one_of(self.shrinkage, ("soft", "smooth"), "shrinkage")


@dataclass
class PolicyConfig:
    """The stopping policy's architecture (how it is used at test time is ``inference``)."""

    features: str = "plan"
    """``plan`` (one call per sample plans the depth from the state at ``min_step``: :class:`SparseDepthPlanner`), or a
    policy asked at every step with ``sketch`` statistics or the release's ``full`` input."""
    sketch_dim: int = 32
    """With features sketch: rows of the random sketch of y and of the residual."""
    hidden: tuple[int, ...] = (64, 64)
    """Widths of the policy MLP's hidden layers."""
    min_mass: float = 0.001
    """steps before the first one whose mean validation oracle mass q*(t) exceeds this become ``min_step`` (the policy
    is not evaluated there); 0 disables it."""
    replan_mass: float = 0.0
    """with ``plan``, plan the samples still running once more, from the last move and a few norms of the state, at the
    first step before which the validation oracle holds this share of its mass (after the plan step, before T; 0.3
    gives step 10 of 16 on the quick problem); 0: one plan. Read by the price rule (``inference.rule price``); Stage
    III and AEVB train the first plan only."""

    def __post_init__(self):
        one_of(self.features, ("plan", "sketch", "full"), "features")
        positive_int(self.sketch_dim, "sketch_dim")
        for h in self.hidden:
            positive_int(h, "hidden")
        require(0 <= self.min_mass < 1, "min_mass", f"must be in [0, 1); got {self.min_mass}")
        require(0 <= self.replan_mass < 1, "replan_mass", f"must be in [0, 1) (0: one plan); got {self.replan_mass}")
        require(self.replan_mass == 0 or self.features == "plan", "replan_mass",
                f"plans again: it needs features 'plan'; got features {self.features!r}")


@dataclass
class ClassicalConfig:
    """Grid search of ISTA/FISTA's step size 1/L and l1 weight rho on training problems."""

    depths: tuple[int, ...] = (20, 100)
    """The fixed depths at which ISTA and FISTA are tuned and reported."""
    L_grid: tuple[float, ...] = (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0)
    """Candidate L (step size 1/L)."""
    rho_grid: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.14, 0.2, 0.3)
    """Candidate l1 weights rho."""
    tune_samples: int = 1000
    """Training problems the grid search scores on."""

    def __post_init__(self):
        for name in ("depths", "L_grid", "rho_grid"):
            non_empty(getattr(self, name), name)  # an empty grid would only fail after all training
        require(all(d >= 1 for d in self.depths), "depths", "must be >= 1")
        require(all(v > 0 for v in self.L_grid), "L_grid", "values must be > 0")
        require(all(v >= 0 for v in self.rho_grid), "rho_grid", "values must be >= 0")
        require(self.tune_samples >= 1, "tune_samples", "must be >= 1")


@dataclass
class SparseConfig:
    """Everything a sparse-recovery run needs. Defaults are the paper preset."""

    #: read-only sections, left out of the run's fingerprint: the test-time rule, the evaluation batch and the classical baselines' tuning
    reader_fields: ClassVar[tuple[str, ...]] = ('inference', 'eval_batch', 'classical')

    seed: int = 0
    """Seed of training: the weights' initialisation and the training problems."""
    problem: ProblemConfig = field(default_factory=ProblemConfig)
    """The sparse-recovery problem: sizes, noise levels, the matrix and the fixed sets."""
    lista: LISTAConfig = field(default_factory=LISTAConfig)
    """LISTA, the step-wise model."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=0.28))
    """beta (0.28 in the paper), depth prior and price on steps, inherited by every stage."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """the test-time stop rule (replaced by ``calibration.json`` once a run is calibrated)."""
    classical: ClassicalConfig = field(default_factory=ClassicalConfig)
    """Grid search of ISTA and FISTA, the classical baselines."""
    baseline: StageConfig = stage_field(objective="deep_supervision", gamma=1.0, iterations=100_000, batch_size=512,
                                   lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    """LISTA trained alone (deep supervision): the full-depth baseline."""
    stage1: StageConfig = stage_field(objective="stage1", variant="expected", iterations=50_000, batch_size=1024,
                                 lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    """Stage I: LISTA-stop's theta fitted under the oracle q*."""
    stage2: StageConfig = stage_field(objective="stage2", variant="forward_kl", iterations=40_000, batch_size=256,
                                 lr=1e-3, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    """Stage II: the policy fitted to the oracle, theta frozen."""
    stage3: StageConfig = stage_field(objective="stage3", iterations=10_000, batch_size=1024,
                                 lr=1e-5, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    """Stage III: theta and the policy fine-tuned together (beta-VAE objective)."""
    aevb: StageConfig = stage_field(objective="aevb", iterations=50_000, batch_size=1024,
                               lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    """AEVB: theta and the policy trained jointly from the start (the paper's comparison)."""
    stage1_init: str = "ista"
    """start Stage I / AEVB from ISTA's weights or from the trained LISTA baseline."""
    aevb_init: str = "ista"
    """start Stage I / AEVB from ISTA's weights or from the trained LISTA baseline."""
    equal_budget: bool = False
    """also train LISTA on from the baseline for Stage I's iterations, with Stage I's schedule (stage ``lista_equal``):
    the LISTA that had the same training budget as LISTA-stop's theta."""
    run_stage3: bool = True
    """Train Stage III after Stage II."""
    run_aevb: bool = True
    """Train the AEVB comparison."""
    eval_batch: int = 1000
    """Test problems per forward pass in evaluation."""

    def __post_init__(self):
        positive_int(self.eval_batch, "eval_batch")
        one_of(self.stage1_init, ("ista", "baseline"), "stage1_init")
        one_of(self.aevb_init, ("ista", "baseline"), "aevb_init")
        for name in ("baseline", "stage1", "stage2", "stage3", "aevb"):
            expected = {"baseline": "deep_supervision"}.get(name, name)
            got = getattr(self, name).objective
            require(got == expected, f"{name}.objective", f"must be {expected!r} for this stage; got {got!r}")
        require(self.lista.num_steps >= 2, "lista.num_steps", "a stopping policy needs T >= 2 steps")
        # a rule that reads no policy (tolerance, a fixed depth) works with any; of the policy's, the price rule alone
        require(self.policy.replan_mass == 0 or not get_rule(self.inference.rule).needs_policy
                or self.inference.rule == "price", "policy.replan_mass",
                f"a second plan is read by the price rule; inference.rule is {self.inference.rule!r}")
        require(self.policy.replan_mass == 0 or not self.inference.sampled, "policy.replan_mass",
                "a second plan is read by the price rule; inference.sampled samples one plan's q_phi")
        _check_memory(self)


def _check_memory(cfg: "SparseConfig") -> None:
    """Refuse, before any work, a problem whose fixed sets and largest batch cannot fit in this machine's memory."""
    import os

    p, T = cfg.problem, cfg.lista.num_steps
    floats = (2 * p.m * p.n  # A, plus the policy's copy
              + (p.test_per_snr + p.val_per_snr) * len(p.snrs) * (p.m + p.n)  # fixed validation and test sets
              + max(cfg.eval_batch, cfg.stage1.batch_size, cfg.baseline.batch_size) * (p.m + p.n) * (T + 2))  # unrolled batch
    need = 4 * floats
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    require(need < 0.8 * have, "problem", f"needs about {need / 2**30:.1f} GiB (m={p.m}, n={p.n}, "
            f"{p.test_per_snr + p.val_per_snr} samples per SNR, batch up to {max(cfg.eval_batch, cfg.stage1.batch_size)}) "
            f"but this machine has {have / 2**30:.1f} GiB; shrink problem.m/n, the sets or the batch sizes")


def equal_budget_config(cfg: "SparseConfig") -> StageConfig:
    """Stage ``lista_equal``: LISTA's own objective (the baseline's) on Stage I's schedule and batch."""
    return replace(cfg.stage1, objective="deep_supervision", variant=cfg.baseline.variant, gamma=cfg.baseline.gamma,
                   step_weights=cfg.baseline.step_weights, select="")


def _efficient_schedule(iterations: int, every: int, lr: float = 1e-3) -> dict:
    """Adam at a 10-20x higher rate with cosine decay, batch 256: far fewer iterations than the paper's
    constant 1e-4. Stage I fine-tunes the baseline's weights at half that rate; Stage III is a short,
    gentle fine-tuning (at 1e-4 it lost 0.2-0.5 dB: its q_phi-weighted loss pulls theta towards
    earlier steps that the deterministic policy rarely uses)."""
    common = {"batch_size": 256, "lr_schedule": "cosine", "lr_min_factor": 0.01, "eval_every": every, "checkpoint_every": every}
    model = {**common, "iterations": iterations, "lr": lr, "weight_decay": 0.0}
    return {
        "baseline": model, "aevb": model,
        "stage1": {**model, "lr": lr / 2},
        "stage2": {**common, "iterations": iterations, "lr": 3e-3},
        "stage3": {**common, "iterations": iterations // 4, "lr": lr / 100, "weight_decay": 0.0, "lr_schedule": "constant"},
    }


#: Presets are partial configs over the defaults above (the paper's settings).
PRESETS: dict[str, dict] = {
    "paper": {},
    # The paper's problem with an efficient schedule: the whole pipeline in about 30 min on 2 CPU cores.
    "fast": {"stage1_init": "baseline", **_efficient_schedule(1500, every=250)},
    # A smaller problem (m=125, n=250, T=16) so that everything, baselines included, runs in ~10 min.
    "quick": {
        "problem": {"m": 125, "n": 250, "test_per_snr": 1000, "val_per_snr": 300},
        "lista": {"num_steps": 16},
        "classical": {"tune_samples": 500},
        "stage1_init": "baseline",
        **merge(_efficient_schedule(1500, every=250, lr=2e-3), {"stage1": {"variant": "marginal"}}),
        # The oracle as fixed weights (marginal) keeps every step good (through q*, the expected form pushes
        # the steps worse than a sample's average up: -13.4 dB at step 11 against LISTA's -18.0); a price of
        # 0.5 per full depth moves the oracle's mass, and so the training, towards earlier steps.
        "method": {"beta": 0.28, "price": 0.5},
        # The depth is planned once per sample at the first step with 2 % of the oracle's mass (step 5 of 16):
        # late enough that the residual shows the noise level, early enough for every budget from 30 %. The
        # price rule re-prices that one plan for any budget (price 0: q_phi's most likely step).
        # ... and planned once more, for the samples still running, where the oracle has 30 % of its mass before
        # (step 10): from the last move, the tolerance test's own signal, which the plan at step 5 cannot see.
        # --policy.replan_mass 0 gives one plan.
        "policy": {"min_mass": 0.02, "replan_mass": 0.3},
        "inference": {"rule": "price", "param": 0.0},
    },
}
# The paper's problem at Table 1's accuracy on 2 CPU cores, all stages and baselines in about an hour:
# - LISTA: batch 512, Adam 1e-3 with cosine decay, 12k iterations. Length is what the 1500 iterations of
#   ``fast`` lacked (a larger rate diverges, a smaller one is slower).
# - Stage I from LISTA's weights, marginal form, beta 0.05: a sharp oracle lets the steps specialise by noise
#   level (SNR 20's best step moves to ~15 while the last steps sharpen for SNR 30/40).
# - ``lista_equal``: LISTA trained on for Stage I's iterations, the baseline at LISTA-stop's theta budget.
# - AEVB from LISTA's weights, so it is compared with Stage I+II from the same start.
# Measured (README): LISTA-stop -23.49 dB mixed (paper -22.41); SNR 20 -19.48 misses the paper's -20.29.
# - The planner as in ``quick``: one call per sample, at the first step with 2 % of the oracle's mass, and the
#   price rule re-pricing that plan for any budget.
PRESETS["paper-cpu"] = {
    "stage1_init": "baseline", "aevb_init": "baseline", "equal_budget": True,
    "method": {"beta": 0.05},
    "policy": {"min_mass": 0.02}, "inference": {"rule": "price", "param": 0.0},
    "baseline": {"iterations": 12_000, "batch_size": 512, "lr": 1e-3, "weight_decay": 0.0, "lr_schedule": "cosine",
                 "lr_min_factor": 0.01, "eval_every": 500, "checkpoint_every": 500},
    "stage1": {"variant": "marginal", "iterations": 3000, "batch_size": 512, "lr": 5e-4, "weight_decay": 0.0,
               "lr_schedule": "cosine", "lr_min_factor": 0.01, "eval_every": 250, "checkpoint_every": 500},
    "stage2": {"iterations": 3000, "batch_size": 256, "lr": 3e-3, "lr_schedule": "cosine", "lr_min_factor": 0.01,
               "eval_every": 250, "checkpoint_every": 500},
    "stage3": {"iterations": 750, "batch_size": 512, "lr": 1e-5, "weight_decay": 0.0, "eval_every": 250,
               "checkpoint_every": 250},
    "aevb": {"iterations": 2000, "batch_size": 512, "lr": 5e-4, "weight_decay": 0.0, "lr_schedule": "cosine",
             "lr_min_factor": 0.01, "eval_every": 500, "checkpoint_every": 500},
}
# The release's variants of the paper settings (REFERENCE.md), for comparison.
PRESETS["release"] = merge(PRESETS["paper"], {
    "problem": {"matrix": "cond5"}, "lista": {"shrinkage": "smooth"},
    "stage1": {"variant": "marginal"}, "stage2": {"variant": "map"}, "policy": {"features": "full", "hidden": [256, 128, 16]},
})


def preset(name: str = "quick", **overrides: Any) -> SparseConfig:
    """The config of a named preset, with optional nested overrides (dicts)."""
    return preset_config(SparseConfig, PRESETS, name, "sparse", **overrides)

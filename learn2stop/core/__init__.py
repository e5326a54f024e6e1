"""The learn2stop core: distributions, losses, the step loop, stage objectives and the trainer."""
from .distributions import (
    entropy,
    log_depth_prior,
    log_oracle_distribution,
    log_stop_time_distribution,
    map_stop_time,
    oracle_distribution,
    sample_stop_time,
    stop_time_distribution,
    survival_log_probability,
)
from .loop import (
    FixedDepth,
    PolicyRule,
    Rollout,
    StepView,
    StepwiseModel,
    StopAtTimes,
    StoppingModel,
    ToleranceRule,
    run_with_early_exit,
    unroll,
)
from .objectives import OBJECTIVES, StageConfig, StageObjective
from .trainer import StagedTrainer, derive_seed, validation_scores

__all__ = [
    "entropy",
    "log_depth_prior",
    "log_oracle_distribution",
    "log_stop_time_distribution",
    "map_stop_time",
    "oracle_distribution",
    "sample_stop_time",
    "stop_time_distribution",
    "survival_log_probability",
    "FixedDepth",
    "PolicyRule",
    "Rollout",
    "StepView",
    "StepwiseModel",
    "StopAtTimes",
    "StoppingModel",
    "ToleranceRule",
    "run_with_early_exit",
    "unroll",
    "OBJECTIVES",
    "StageConfig",
    "StageObjective",
    "StagedTrainer",
    "derive_seed",
    "validation_scores",
]

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
from .loop import Rollout, run_with_early_exit, unroll
from .stop_rule import StepView
from .protocols import StepwiseModel
from .policy_signals import PolicyRule, threshold_stop_times
from .rules import FixedDepth, StopAtTimes
from .signals import ToleranceRule
from .model import StoppingModel
from .planner import PlanMLPPolicy
from .policies import ExitPolicy, StepMLPPolicy, create_policy, list_policies, logit_signals, output_signals
from .calibration import calibrate_budget
from .calibration_file import Calibration, load_calibration, save_calibration
from .inference import InferenceConfig
from .risk_control import calibrate_risk
from .distributions import exit_costs, log_cost_prior
from .trace import Metric, Trace, collect_trace, evaluate_rule
from .exits import ExitNetwork, attach_exits, sdn_exit_points
from .objectives import OBJECTIVES, MethodConfig, StageConfig, StageObjective
from .task import Stage, StoppingApp
from .train import load_stage, run_pipeline
from .policy_signals import PolicySignal, QuantileSignal
from .rules import SignalRule, first_crossing, signal_trace
from .signals import ConfidenceSignal, EntropySignal, PatienceSignal, ToleranceSignal
from .stage_checkpoints import load_finished_stage
from .trainer import StagedTrainer
from ..utils.seeding import derive_seed
from .validation import validation_scores

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
    "ExitPolicy",
    "create_policy",
    "list_policies",
    "StepMLPPolicy",
    "PlanMLPPolicy",
    "logit_signals",
    "output_signals",
    "ToleranceRule",
    "run_with_early_exit",
    "threshold_stop_times",
    "unroll",
    "OBJECTIVES",
    "MethodConfig",
    "InferenceConfig",
    "Calibration",
    "calibrate_budget",
    "calibrate_risk",
    "load_calibration",
    "save_calibration",
    "exit_costs",
    "log_cost_prior",
    "Metric",
    "Trace",
    "collect_trace",
    "evaluate_rule",
    "Stage",
    "StoppingApp",
    "load_stage",
    "run_pipeline",
    "ConfidenceSignal",
    "EntropySignal",
    "PatienceSignal",
    "PolicySignal",
    "QuantileSignal",
    "SignalRule",
    "ToleranceSignal",
    "first_crossing",
    "signal_trace",
    "StageConfig",
    "StageObjective",
    "StagedTrainer",
    "derive_seed",
    "validation_scores",
    "load_finished_stage",
    "attach_exits",
    "ExitNetwork",
    "sdn_exit_points",
]

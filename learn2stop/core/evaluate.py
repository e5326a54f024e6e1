"""What every task's ``evaluate`` shares: a trained stage run with the run's deployed rule on the test set (real
early exit), the config's own rule beside a calibrated one, and the stop model's trace and q_phi for the figures.
A task's ``evaluate`` then computes its own table rows from an :class:`EvaluatedModel`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .deployment import Deployment, load_deployment
from .distributions import log_stop_time_distribution, replanned_log_q, stop_time_distribution
from .task import Run, StoppingApp, check_config, signal_key, stop_model_trace
from .trace import Trace, evaluate_rule


@dataclass
class EvaluatedModel:
    """A stage evaluated with the rule it is deployed with.

    ``deployment``: the stage's :class:`~learn2stop.core.deployment.Deployment` (model, online rule, how chosen).
    ``result``: :func:`~learn2stop.core.trace.evaluate_rule`'s record on the test set (``values`` (N,) the metric
    per sample at its stop, ``stop_times`` (N,), ``metric``, ``mean_steps``, ``mean_cost``, ``steps_computed``).
    ``configured``: the same for the config's ``inference`` rule, where the deployed rule is a calibration (the
    configured one is then a second operating point); else None. ``trace``: the stop model's per-step test trace
    (its policy rules' scores, no classical ones), when asked; :meth:`q_phi` its stop-time distribution.
    """

    deployment: Deployment
    result: dict
    configured: dict | None = None
    trace: Trace | None = None
    batches: list | None = None

    def q_phi(self) -> torch.Tensor | None:
        """(N, T) q_phi of the policy on the test set (:func:`stop_distribution`; None without a trace or a policy)."""
        sm = self.deployment.model
        if self.trace is None or sm.policy is None:
            return None
        return stop_distribution(sm, self.trace, self.batches)

    @property
    def values(self) -> torch.Tensor:
        return self.result["values"]

    @property
    def stop_times(self) -> torch.Tensor:
        return self.result["stop_times"]

    @property
    def mean_steps(self) -> float:
        return self.result["mean_steps"]

    @property
    def rule(self) -> Any:
        """The online rule the stage ran."""
        return self.deployment.online

    @property
    def desc(self) -> str:
        return self.deployment.description


def evaluate_deployed(app: StoppingApp, cfg: Any, run: Run, stage: str | None = None, *, generator=None,
                      configured: bool = False, trace: bool = False, run_dir: Any = "run") -> EvaluatedModel:
    """Run ``stage`` (default the stop stage) on the test set with the rule the run deploys for it
    (:func:`~learn2stop.core.deployment.load_deployment`), on the run's first backend.

    ``configured``: also the config's ``inference`` rule where the deployed one is a calibration. ``trace``: also
    the stop model's trace (and so :meth:`EvaluatedModel.q_phi`). ``run_dir``: where the rule is read from (default
    the run's; None: the config's rule alone). ``generator``: for the sampled policy.
    """
    check_config(cfg)
    dev, metric = run.device, app.metric(cfg)
    batches = app.eval_batches(cfg, "test", dev)
    dep = load_deployment(app, cfg, run.run_dir if run_dir == "run" else run_dir, stage=stage or app.stop_stage,
                          device=dev, generator=generator)
    kw = {"extras": app.trace_extras(cfg), "runner": run.runner}
    sm = dep.model
    out = EvaluatedModel(dep, evaluate_rule(sm.model, batches, lambda: dep.online, metric, dev, **kw), batches=batches)
    inf = app.inference(cfg)
    if configured and dep.calibrated and not inf.sampled:
        key = signal_key(app, cfg, inf.rule)
        out.configured = evaluate_rule(sm.model, batches, lambda: inf.make_rule(sm.policy, generator, key), metric,
                                       dev, **kw)
    if trace:
        out.trace = stop_model_trace(app, cfg, sm, "test", dev, with_classical=False)
    return out


def stop_distribution(sm: Any, trace: Trace, batches: list) -> torch.Tensor:
    """(N, T) q_phi of the stop model's policy on ``batches``: from its per-step stop probabilities (the ``threshold``
    scores of ``trace``), or, for a policy that plans twice, its two plans combined."""
    if "threshold" in trace.signals:
        return stop_time_distribution(trace.signals["threshold"].clamp_min(0))  # pi_t -> q_phi (-inf: not asked)
    with torch.no_grad():
        rolls = [sm.unroll(x) for x, _ in batches]
        return torch.cat([replanned_log_q(log_stop_time_distribution(r.stop_logits), r.replan_log_q,
                                          sm.policy.replan_step).exp().cpu() for r in rolls])

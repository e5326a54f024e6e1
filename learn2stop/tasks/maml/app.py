"""MAML-stop on the core pipeline: the :class:`~learn2stop.core.task.StoppingApp` that declares MAML's data, models,
stages, metric and rules.

``learn2stop maml reproduce --preset quick`` trains MAML and MAML-stop with equal meta-iterations on
task-imbalanced sinusoid regression (no data needed) and writes ``results.md``, ``results.json`` and
``stop_by_shot.png``; ``calibrate`` and ``frontier`` come from the core. The config and presets are in
:mod:`.config`, the commands and the task's registration in :mod:`.commands`. Python API::

    from learn2stop.tasks.maml import APP, preset, reproduce
    results = reproduce(preset("quick"), "runs/maml-quick")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import Metric, StoppingModel, ToleranceSignal
from ...core.signals import PatienceSignal
from ...core.task import Stage, StoppingApp
from ...utils.config import to_dict
from ...utils.seeding import derive_seed
from .config import MAMLConfig
from .data import Data, MetaLearningTask, fixed_batches, to_device
from .metric import risk_range, task_metric
from .models import build


# ----------------------------------------------------------------------------- the task for the core pipeline
class MAMLApp(StoppingApp):
    """MAML (baseline) and MAML-stop (Stage I, then Stage II) on the core pipeline."""

    baseline_label = "MAML"
    speed_batch = 100  # a natural large batch of tasks
    speed_samples = 50  # tasks timed one by one at batch 1 (each runs up to T inner loops)
    #: why ``export`` refuses this task (see :mod:`learn2stop.export` and the README's "Export and serve")
    export_unsupported = ("MAML's steps are inner gradient updates (torch.func.grad of the support loss); an ONNX "
                          "inference graph has no gradient operator, so the steps cannot run in ONNX Runtime")

    def data(self, cfg: MAMLConfig) -> Data:
        return self.cached(f"data {to_dict(cfg.data)}", lambda: Data(cfg.data))

    def build_models(self, cfg: MAMLConfig, device) -> dict[str, StoppingModel]:
        maml, stop = build(cfg, device)
        return {"baseline": maml, "stop": stop}

    def training_task(self, cfg: MAMLConfig, key: str, sm: StoppingModel) -> MetaLearningTask:
        data = self.data(cfg)
        return MetaLearningTask(sm.model, data.sampler, data.split["train"], None,
                                val_batches=self._fixed(cfg, "val"))

    def stages(self, cfg: MAMLConfig) -> list[Stage]:
        out = [Stage("baseline", "baseline", cfg.maml, describe="MAML: query loss after all T inner steps"),
               Stage("stage1", "stop", cfg.stage1, describe="MAML-stop Stage I (meta-learner, t ~ q*)")]
        if cfg.model.policy_posterior:
            out.append(Stage("posterior", "stop", cfg.posterior,
                             describe="MAML-stop's posterior-mean estimate (regression on query targets)"))
        answers = cfg.model.policy_posterior  # the estimate chooses the kept answer
        out.append(Stage("stage2", "stop", cfg.stage2, before=_stage2_hook if answers else None,
                         describe="MAML-stop Stage II (policy" + (", on the kept answers)" if answers else ")")))
        return out

    def _fixed(self, cfg: MAMLConfig, split: str) -> list:
        """Fixed CPU task batches of a split, drawn once with a seed of their own."""
        n = cfg.eval.tasks if split == "test" else cfg.eval.val_tasks
        data = self.data(cfg)

        def draw():
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, split))
            return fixed_batches(data.sampler, data.split[split], n, g, cfg.eval.chunk)
        return self.cached(f"{split} tasks {to_dict(cfg.data)} {(n, cfg.eval.chunk, cfg.seed)}", draw)

    def eval_batches(self, cfg: MAMLConfig, split: str, device) -> list:
        return [(to_device(i, device), to_device(t, device)) for i, t in self._fixed(cfg, split)]

    def metric(self, cfg: MAMLConfig) -> Metric:
        return task_metric(cfg)

    def classical_signals(self, cfg: MAMLConfig) -> dict:
        """The tolerance rule on the support loss: stop once an inner step changes it little. With a kept answer
        (``model.policy_posterior``) also patience on it: stop once the kept answer has not changed for k steps
        (early stopping that restores the best step)."""
        out = {"tolerance": lambda: ToleranceSignal(key=lambda out: out["support_loss"][:, None])}
        if cfg.model.policy_posterior:
            T = cfg.model.inner_steps
            out["patience"] = lambda: PatienceSignal(key=lambda o: F.one_hot(o["answer_step"], T + 1))
        return out

    def risk_losses(self, cfg: MAMLConfig, trace) -> tuple[torch.Tensor, tuple[float, float] | None]:
        losses, _ = super().risk_losses(cfg, trace)
        return losses, risk_range(cfg)


APP = MAMLApp()


def _stage2_hook(models: dict, app: MAMLApp, cfg: MAMLConfig, run) -> None:
    """Stage II's hook with a posterior-mean estimate: it was trained in its own stage and stays as it is, and
    MAML-stop answers with the kept answer it chooses from here on."""
    sm = models["stop"]
    sm.policy.fit_estimate = False
    sm.model.answering = True

"""The object users train and deploy: a step-wise model together with its stopping policy.

It saves and loads as one folder (:meth:`StoppingModel.save_pretrained` / :meth:`StoppingModel.from_pretrained`):
``weights.pt`` (model and policy), ``config.json`` (format version, the classes, T, the calibrated rule if any).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..utils.config import ConfigError
from ..utils.report import write_json
from .calibration_file import Calibration
from .inference import InferenceConfig
from .distributions import log_stop_time_distribution
from .loop import Rollout, run_with_early_exit, unroll
from .steps import check_stepwise
from .stop_rule import StopRule, check_rule
from .policy_signals import PolicyRule
from .rules import FixedDepth
from .trees import batch_size, tree_map

PRETRAINED_FORMAT = "learn2stop-pretrained"
#: the version of the folder :meth:`StoppingModel.save_pretrained` writes; another version is refused
PRETRAINED_VERSION = 1
WEIGHTS_FILE, CONFIG_FILE = "weights.pt", "config.json"


class StoppingModel(nn.Module):
    """A step-wise model together with its stopping policy: the object users train and deploy.

    ``calibration``: the calibrated rule (:func:`learn2stop.calibrate` sets it), used by :meth:`forward` when no
    other rule is asked for, and saved with the model.

    Example:
        >>> sm = StoppingModel(model, policy)               # doctest: +SKIP
        >>> result = sm(inputs)                  # early exit with the default rule  # doctest: +SKIP
        >>> result.outputs, result.stop_times, result.steps_computed                   # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, policy: nn.Module | None = None):
        super().__init__()
        check_stepwise(model)
        self.model = model
        self.policy = policy
        self.calibration: Calibration | None = None

    @property
    def num_steps(self) -> int:
        return self.model.num_steps

    def unroll(self, inputs: Any, target: Any = None, loss_fn=None, *, use_policy: bool = True,
               model_grad: bool = True, keep_outputs: bool = False, grad_steps=None) -> Rollout:
        """Full-depth rollout recording per-step losses and stop logits (see :func:`unroll`)."""
        if target is not None and batch_size(target) != batch_size(inputs):
            raise ValueError(f"target has batch size {batch_size(target)} but the inputs have {batch_size(inputs)}")
        return unroll(self.model, inputs, target=target, loss_fn=loss_fn,
                      policy=self.policy if use_policy else None, model_grad=model_grad, keep_outputs=keep_outputs,
                      grad_steps=grad_steps)

    def forward(self, inputs: Any, rule: StopRule | None = None, *, inference: Any = None,
                mode: str | None = None, threshold: float | None = None, generator: torch.Generator | None = None,
                record_probs: bool = False, compact_every: int | None = None, grad: bool = False) -> Rollout:
        """Inference that really stops.

        The rule is, in order: ``rule`` (any stop rule); the policy with ``mode`` ("threshold" / "sample") and
        ``threshold`` if either is given; ``inference`` (an :class:`~learn2stop.core.inference.InferenceConfig`);
        the model's ``calibration`` if it has one; else the rule the CLI and validation use by default (quantile,
        alpha 0.5). Without a policy (and no calibration): full depth. ``compact_every``: the device mode of
        :func:`run_with_early_exit` (no host synchronisation between compactions).

        Runs under ``torch.inference_mode`` (no autograd bookkeeping: at batch 1 a large share of a small model's
        time), so the outputs are inference tensors; ``grad=True`` runs with autograd as the caller has it, for
        outputs to differentiate. (Training does not come here: the stages call the loop themselves.)
        """
        if rule is None:
            if mode is not None or threshold is not None:
                if self.policy is None:
                    raise ValueError("mode / threshold ask the policy, but this StoppingModel has none")
                rule = PolicyRule(self.policy, mode=mode or "threshold",
                                  threshold=0.5 if threshold is None else threshold, generator=generator)
            elif inference is not None and (self.policy is not None or not inference.uses_policy):
                rule = inference.make_rule(self.policy, generator)
            elif self.calibration is not None:
                rule = self.calibration.make_rule(self.policy)
            elif self.policy is None:
                rule = FixedDepth()
            else:
                rule = InferenceConfig().make_rule(self.policy, generator)
        check_rule(rule)  # the inputs are checked by the loop, once
        with torch.inference_mode(not grad):
            return run_with_early_exit(self.model, inputs, rule, record_probs=record_probs, compact_every=compact_every)

    def stop_distribution(self, inputs: Any) -> Tensor:
        """q_phi(t | x) for t = 1..T from a full rollout; shape (B, T)."""
        if self.policy is None:
            raise ValueError("this StoppingModel has no policy")
        return log_stop_time_distribution(self.unroll(inputs).stop_logits).exp()

    # ------------------------------------------------------------------ one folder
    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the model as one folder: ``weights.pt`` (the state dict of model and policy) and ``config.json``
        (format version, the classes, T, the calibration). The folder appears complete or not at all: it is
        written beside the target and moved into place; an earlier saved model there is replaced, any other
        non-empty folder refused. Returns the folder."""
        out = Path(folder)
        if out.exists() and not (out / CONFIG_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"folder: {out} exists and is not a saved StoppingModel; give a new or empty folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        try:
            # tensors to the CPU; a module's extra state (plain values, e.g. a learned minimum step) passes through
            save_checkpoint({"weights": tree_map(lambda v: v.detach().cpu(), self.state_dict())}, tmp / WEIGHTS_FILE)
            write_json({"format": PRETRAINED_FORMAT, "format_version": PRETRAINED_VERSION, "num_steps": self.num_steps,
                        "model": type(self.model).__name__,
                        "policy": None if self.policy is None else type(self.policy).__name__,
                        "calibration": None if self.calibration is None else self.calibration.to_dict()},
                       tmp / CONFIG_FILE)
            os.chmod(tmp, 0o777 & ~_umask())
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    @classmethod
    def from_pretrained(cls, folder: str | Path, model: nn.Module, policy: nn.Module | None = None,
                        map_location: Any = "cpu") -> "StoppingModel":
        """A StoppingModel of ``model`` and ``policy`` (built as when saved) with the weights and calibration
        :meth:`save_pretrained` wrote to ``folder``. Another format version, another T, a policy missing or extra,
        or weights that do not fit are refused, naming the folder."""
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"folder: {folder} holds no saved StoppingModel ({path.name} is missing)")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); save the model again") from None
        if not isinstance(config, dict) or config.get("format") != PRETRAINED_FORMAT:
            raise ConfigError(f"{path} is not a saved StoppingModel's config")
        if config.get("format_version") != PRETRAINED_VERSION:
            raise ConfigError(f"{folder} is a saved StoppingModel of format version {config.get('format_version')!r}; "
                              f"this learn2stop reads version {PRETRAINED_VERSION} only: save it again with it")
        sm = cls(model, policy)
        if config.get("num_steps") != sm.num_steps:
            raise ConfigError(f"{folder} was saved with num_steps {config.get('num_steps')}; the model given has "
                              f"{sm.num_steps}")
        if (config.get("policy") is None) != (policy is None):
            raise ConfigError(f"{folder} was saved " + (f"with a policy ({config['policy']}); pass policy=..." if policy
                              is None else "without a policy; pass policy=None"))
        ck = load_checkpoint(Path(folder) / WEIGHTS_FILE, map_location=map_location)
        try:
            sm.load_state_dict(ck["weights"])
        except (KeyError, RuntimeError) as e:
            raise CheckpointError(f"{Path(folder) / WEIGHTS_FILE} does not fit the model and policy given: "
                                  f"{str(e).splitlines()[0]}") from None
        if config.get("calibration") is not None:
            sm.calibration = Calibration.from_dict(config["calibration"], where=f"{path}: calibration")
        return sm


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

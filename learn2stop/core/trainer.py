"""StagedTrainer: one training loop for every stage, task and scale (single process or torchrun/DDP).

A *training task* gives the trainer what it cannot know:

- ``loss_fn(output, target) -> (B,)`` per-sample loss l(y, x_t);
- ``sample_batch(batch_size, generator, device) -> (inputs, target)`` a random training batch drawn
  with the given CPU generator (the trainer seeds it from (seed, stage, iteration, rank), so a
  resumed run sees exactly the batches it would have seen);
- ``validation_batches(device) -> iterable of (inputs, target)``, fixed, for model selection;
- optionally ``stop_loss_fn(output, target) -> (B,)``: the loss whose oracle Stage II's policy fits and
  is selected on (default ``loss_fn``). Theta is frozen there, so it needs no gradient: a classifier's
  0/1 error, the metric a user deploys on, instead of the cross-entropy that trains the network.

Each stage keeps ``<run_dir>/checkpoints/<stage>.pt`` (resumable: weights, optimiser, iteration,
best score) and ``<stage>_best.pt`` (the weights with the best validation score); both are
written atomically every ``checkpoint_every`` iterations, so a kill loses at most that much work.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Iterable, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ..utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..utils.config import ConfigError, to_dict
from ..utils.report import append_jsonl
from ..utils.seeding import derive_seed
from ..utils.rundir import truncate_metrics
from ..utils.distributed import DistContext
from .inference import InferenceConfig
from .model import StoppingModel
from .objectives import NonFiniteError, StageConfig, StageObjective
from .protocols import member
from .stage_checkpoints import WeightAverage, check_stage_name, check_writable, same_stage_config
from .trees import tree_map
from .validation import validation_scores


class TrainingTask(Protocol):
    def loss_fn(self, output: Any, target: Any) -> torch.Tensor: ...

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> tuple[Any, Any]: ...

    def validation_batches(self, device: torch.device) -> Iterable[tuple[Any, Any]]: ...


def stage_loss_fn(task: Any, cfg: StageConfig):
    """The per-sample loss a stage's objective weighs: the task's ``stop_loss_fn`` for Stage II (when it has
    one), else its ``loss_fn``."""
    stop = member(task, "stop_loss_fn")
    return stop if (stop is not None and cfg.objective == "stage2") else task.loss_fn


#: the StoppingModel's attributes a stage trains, by ``StageConfig.trains``
TRAINED_PARTS = {"model": ("model",), "policy": ("policy",), "both": ("model", "policy")}


class StagedTrainer:
    """Runs the paper's stages (and the baselines) on one :class:`StoppingModel`.

    Args:
        stopping_model: the model and policy, already on ``ctx.device``.
        task: a :class:`TrainingTask`.
        run_dir: where checkpoints and ``metrics.jsonl`` go.
        seed: base seed of every random batch.
        ctx: distributed context (rank, world size, device); single process by default.
        progress: show a progress bar (rank 0 only).
        resume: continue a stage from its checkpoint if one exists (a finished stage is skipped).
    """

    def __init__(self, stopping_model: StoppingModel, task: TrainingTask, run_dir: str | Path, *, seed: int = 0,
                 ctx: DistContext | None = None, progress: bool = True, resume: bool = True,
                 inference: InferenceConfig | None = None):
        self.sm = stopping_model
        self.inference = inference or InferenceConfig()
        self.task = task
        self.run_dir = Path(run_dir)
        self.seed = seed
        self.ctx = ctx or DistContext()
        self.progress = progress
        self.resume = resume
        self.ckpt_dir = self.run_dir / "checkpoints"
        self._user_flags: list[tuple[nn.Parameter, bool]] = []  # each parameter's requires_grad before the stage
        if self.ctx.is_main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ helpers
    def _log(self, record: dict) -> None:
        if self.ctx.is_main:
            append_jsonl(self.run_dir / "metrics.jsonl", record)  # strict JSON: NaN/inf become null

    def _trainable(self, cfg: StageConfig) -> list[nn.Parameter]:
        """The stage's parameters (those of its trained parts the user has not frozen), the only ones left with
        ``requires_grad``; the user's own flags come back after the stage (:meth:`_restore_flags`)."""
        modules = {"model": self.sm.model, "policy": self.sm.policy}
        parts = [modules[name] for name in TRAINED_PARTS[cfg.trains]]
        if any(p is None for p in parts):
            raise ValueError(f"stage objective {cfg.objective!r} trains the policy, but the StoppingModel has none")
        self._user_flags = [(p, p.requires_grad) for p in self.sm.parameters()]
        frozen = {id(p) for p, wants in self._user_flags if not wants}  # frozen by the user: a pretrained backbone
        for p in self.sm.parameters():
            p.requires_grad_(False)
        params = [p for m in parts for p in m.parameters() if id(p) not in frozen]
        for p in params:
            p.requires_grad_(True)
        if not params:
            self._restore_flags()
            what = " (every one of them is frozen: requires_grad False)" if frozen else ""
            raise ValueError(f"stage objective {cfg.objective!r} found no parameters to train in the "
                             f"{' and '.join(TRAINED_PARTS[cfg.trains])}{what}")
        return params

    def _restore_flags(self) -> None:
        """Give every parameter back the ``requires_grad`` it had before the stage."""
        for p, wants in self._user_flags:
            p.requires_grad_(wants)

    def _set_modes(self, cfg: StageConfig) -> None:
        self.sm.model.train(cfg.trains in ("model", "both"))
        if self.sm.policy is not None:
            self.sm.policy.train(cfg.trains in ("policy", "both"))

    def _validate(self, cfg: StageConfig) -> dict[str, float]:
        return validation_scores(self.sm, self.task.validation_batches(self.ctx.device), stage_loss_fn(self.task, cfg),
                                 self.inference, seed=derive_seed(self.seed, "validation"), price=cfg.price or 0.0)

    def _state(self) -> dict:
        # Tensors are copied; a module's extra state (plain values) passes through.
        return tree_map(lambda v: v.detach().clone(), self.sm.state_dict())

    # ------------------------------------------------------------------ one stage
    def fit(self, name: str, cfg: StageConfig) -> dict[str, Any]:
        """Run (or resume, or skip if finished) stage ``name``; leaves the selected weights loaded.

        Parameters the user froze (``requires_grad`` False: a pretrained backbone under trained heads) are not
        trained and stay frozen after the stage. Returns a summary dict: the stage name, iterations run, best
        validation score and wall-clock seconds.
        """
        check_stage_name(name)
        if not isinstance(cfg, StageConfig):
            raise TypeError(f"fit: the stage config must be a StageConfig (e.g. StageConfig(objective='stage1', "
                            f"beta=0.1)); got {type(cfg).__name__}")
        cfg = cfg if cfg.resolved else cfg.inherit()
        self._user_flags = []
        try:
            return self._fit(name, cfg)
        finally:  # also when the stage fails: the parameters the user froze stay frozen, the others trainable
            self._restore_flags()

    def _fit(self, name: str, cfg: StageConfig) -> dict[str, Any]:
        path, best_path = self.ckpt_dir / f"{name}.pt", self.ckpt_dir / f"{name}_best.pt"
        params = self._trainable(cfg)
        opt = cfg.make_optimizer(params)
        prefixes = tuple(f"{name}." for name in TRAINED_PARTS[cfg.trains])
        average = WeightAverage({k: v for k, v in self.sm.state_dict(keep_vars=True).items()
                                 if k.startswith(prefixes)}) if cfg.ema > 0 else None
        start, best, elapsed, best_state = 0, float("inf"), 0.0, None
        if self.resume and path.is_file():
            ck = load_checkpoint(path, map_location=self.ctx.device)
            if not same_stage_config(ck.get("stage_config"), cfg):
                raise ConfigError(
                    f"{path} was written with a different config for stage {name!r}; "
                    f"use a new run directory or turn resume off")
            self._load_weights(ck, path)
            if ck.get("completed"):
                return ck["summary"]
            opt.load_state_dict(ck["optimizer"])
            if average is not None:
                average.load_state_dict(ck["ema"])
            start, best, elapsed = ck["iteration"], ck["best_score"], ck["elapsed"]
        saved_at = start if start > 0 else None  # the last good checkpoint of this stage, kept if it diverges

        if self.ctx.is_main and (self.run_dir / "metrics.jsonl").is_file():
            check_writable(self.ckpt_dir)  # a resume that cannot save its next checkpoint changes nothing
            # records logged after the checkpoint we resume from would otherwise appear twice
            truncate_metrics(self.run_dir / "metrics.jsonl", name, start)
        objective = StageObjective(self.sm, stage_loss_fn(self.task, cfg), cfg)
        step_fn: nn.Module = objective
        if self.ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            # The recomputed sampled Stage I can leave deep steps unused in a pass; deep supervision leaves the
            # readouts of its zero-weight steps (a network alone's exit heads) without gradients.
            unused = (cfg.variant == "sampled" and cfg.recompute) or (cfg.objective == "deep_supervision" and (
                cfg.variant == "last" or (cfg.variant == "weighted" and 0 in cfg.step_weights)))
            step_fn = DDP(objective, device_ids=dev_ids, find_unused_parameters=unused)
        local_batch = -(-cfg.batch_size // self.ctx.world_size)

        def checkpoint(iteration: int, completed: bool = False, summary: dict | None = None) -> None:
            nonlocal saved_at
            saved_at = iteration
            if self.ctx.is_main:
                save_checkpoint({"stage": name, "stage_config": to_dict(cfg), "iteration": iteration,
                                 "completed": completed, "best_score": best, "elapsed": elapsed,
                                 "weights": self._state(), "optimizer": opt.state_dict(),
                                 **({"ema": average.state_dict()} if average is not None and not completed else {}),
                                 "summary": summary or {}}, path)
            self.ctx.barrier()

        bar = tqdm(total=cfg.iterations, initial=start, desc=name, dynamic_ncols=True,
                   disable=not (self.progress and self.ctx.is_main), leave=True)
        self._set_modes(cfg)
        t0 = time.perf_counter()
        for it in range(start, cfg.iterations):
            gen = torch.Generator().manual_seed(derive_seed(self.seed, name, it, self.ctx.rank))
            inputs, target = self.task.sample_batch(local_batch, gen, self.ctx.device)
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(it)
            try:
                loss, metrics = step_fn(inputs, target, gen)
            except NonFiniteError as e:  # the objective names the per-step quantity and the steps
                raise self._diverged(name, it + 1, f"the loss is not finite ({e})", cfg, saved_at) from None
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                raise self._diverged(name, it + 1, f"the loss is {loss_value}", cfg, saved_at)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if not torch.isfinite(grad_norm):  # a finite loss can still have an inf gradient: never step with it
                raise self._diverged(name, it + 1, f"the gradient norm is {float(grad_norm)} (loss {loss_value:.4g})",
                                     cfg, saved_at)
            opt.step()
            if average is not None:
                average.update(cfg.ema_decay(it))
            bar.update(1)
            done = it + 1
            if done % 10 == 0 or done == cfg.iterations:
                bar.set_postfix(loss=f"{loss_value:.4g}")
            if done % cfg.eval_every == 0 or done == cfg.iterations:
                if average is not None:
                    average.swap()  # validated, selected and kept: the average's weights
                try:
                    scores = self._validate(cfg)
                except FloatingPointError as e:
                    raise self._diverged(name, done, f"validation failed: {e}", cfg, saved_at) from None
                self._set_modes(cfg)
                score = scores[cfg.select] if cfg.select != "none" else -done
                if score < best:
                    best, best_state = score, self._state()  # every rank keeps its own copy: no file race
                    if self.ctx.is_main:
                        save_checkpoint({"stage": name, "iteration": done, "weights": best_state}, best_path)
                if average is not None:
                    average.swap()
                self._log({"stage": name, "iteration": done, "train_loss": loss_value, **metrics,
                           **{f"val_{k}": v for k, v in scores.items()}, "lr": cfg.lr_at(it),
                           "seconds": round(elapsed + time.perf_counter() - t0, 2)})  # the stage's time so far
            if done % cfg.checkpoint_every == 0 and done < cfg.iterations:
                elapsed += time.perf_counter() - t0
                t0 = time.perf_counter()
                checkpoint(done)
        bar.close()
        elapsed += time.perf_counter() - t0
        if average is not None and cfg.select == "none":
            average.swap()  # the stage's weights are the average's
        if cfg.select != "none":
            if best_state is not None:
                self.sm.load_state_dict(best_state)
            elif best_path.is_file():  # resumed after the last improvement was saved
                self.ctx.barrier()
                self._load_weights(load_checkpoint(best_path, map_location=self.ctx.device), best_path)
        summary = {"stage": name, "iterations": cfg.iterations, "best_score": best, "select": cfg.select,
                   "seconds": round(elapsed, 2)}
        flush_denormals_(self.sm)  # what the stage hands on and saves: no subnormal weight to slow a CPU down
        checkpoint(cfg.iterations, completed=True, summary=summary)
        return summary

    def _diverged(self, name: str, iteration: int, what: str, cfg: StageConfig, saved_at: int | None) -> NonFiniteError:
        """The error of a stage that went non-finite: stage, iteration, quantity, and what is kept on disk."""
        if saved_at is None:
            kept = f"no checkpoint of this stage was written yet (checkpoint_every {cfg.checkpoint_every})"
        else:
            kept = (f"the last good checkpoint {self.ckpt_dir.name}/{name}.pt (iteration {saved_at}) is kept "
                    f"and nothing after it was written")
        hint = f"lower the stage's learning rate (lr {cfg.lr:g})" + ("" if cfg.grad_clip else " or set grad_clip")
        return NonFiniteError(f"stage {name!r}: {what} at iteration {iteration}; {kept}; {hint}")

    def _load_weights(self, ck: dict, path: Path) -> None:
        try:
            self.sm.load_state_dict(ck["weights"])
        except (KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path} does not fit this model: {e}") from None


@torch.no_grad()
def flush_denormals_(module: nn.Module) -> int:
    """Set every subnormal value of ``module``'s floating-point parameters and buffers to zero, in place; returns
    how many there were.

    Training leaves them in little-used weights (a policy's dead ReLU units under weight decay: 132 of the 4,096
    weights of a sparse planner's hidden layer in a ``paper-cpu`` run). A product with a subnormal operand takes a
    slow path on x86 CPUs, so such a (1000, 64) x (64, 64) layer ran 1.26 ms instead of 0.08 (2 threads; 2.47
    against 0.13 on one), and the plan that should cost a fifth of a LISTA step cost 0.7 of one.
    ``torch.set_flush_denormal`` is no fix: it sets the calling thread alone, not the threads of an intra-op
    pool. A subnormal weight (below 1.2e-38 in float32) times an activation of ordinary size adds nothing a
    float32 sum of such activations can hold, so the outputs stay as they were (checked bit for bit: the sparse quick
    and ``paper-cpu`` planners' plans and stop times, and README command 1's results); the trainer flushes each
    finished stage, and :func:`load_finished_stage
    <learn2stop.core.stage_checkpoints.load_finished_stage>` the checkpoints written before it did.
    """
    count = 0
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            small = (t.abs() < torch.finfo(t.dtype).tiny) & (t != 0)
            n = int(small.sum())
            if n:
                t.masked_fill_(small, 0.0)
                count += n
    return count

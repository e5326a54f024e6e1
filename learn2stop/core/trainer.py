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
import os
import re
import tempfile
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
from .calibration import InferenceConfig
from .distributions import exit_costs
from .fastpath import flush_denormals_
from .model import StoppingModel
from .trees import tree_map
from .objectives import NonFiniteError, StageConfig, StageObjective
from .rules import first_crossing, signal_trace


class TrainingTask(Protocol):
    def loss_fn(self, output: Any, target: Any) -> torch.Tensor: ...

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> tuple[Any, Any]: ...

    def validation_batches(self, device: torch.device) -> Iterable[tuple[Any, Any]]: ...


def stage_loss_fn(task: Any, cfg: StageConfig):
    """The per-sample loss a stage's objective weighs: the task's ``stop_loss_fn`` for Stage II (when it has
    one), else its ``loss_fn``."""
    stop = getattr(task, "stop_loss_fn", None)
    return stop if (stop is not None and cfg.objective == "stage2") else task.loss_fn


def check_stage_name(name: Any) -> None:
    """A stage name is a plain file name (``checkpoints/<name>.pt``): letters, digits, ``_ - .``, no path."""
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", name)):
        raise ValueError(f"stage name: must be a plain name of letters, digits, '_', '-' or '.' (it names "
                         f"checkpoints/<name>.pt), without a path; got {name!r}")


def check_writable(folder: Path) -> None:
    """Create and remove a file in ``folder``: a real test (os.access says yes to root on a read-only mount)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OSError(f"cannot write checkpoints to {folder} ({e.strerror or e}); make it writable or use another "
                      f"--run-dir (nothing was changed)") from None


def load_finished_stage(module: nn.Module, checkpoint_dir: str | Path, stage: str, map_location: Any = "cpu") -> dict:
    """Load the selected weights of a finished stage from ``<checkpoint_dir>/<stage>.pt`` into ``module``.

    Returns the stage's training summary. Raises CheckpointError, naming the file, if it is missing,
    corrupt, from an unfinished stage, or does not fit ``module``.
    """
    path = Path(checkpoint_dir) / f"{stage}.pt"
    ck = load_checkpoint(path, map_location=map_location)
    if not ck.get("completed"):
        raise CheckpointError(f"{path} is from an unfinished stage {stage!r}; run the train command again (it resumes)")
    try:
        module.load_state_dict(ck["weights"])
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not fit the configured model: {e}") from None
    return ck.get("summary", {})


@torch.no_grad()
def validation_scores(sm: StoppingModel, batches: Iterable[tuple[Any, Any]], loss_fn,
                      inference: InferenceConfig | None = None, seed: int = 0, price: float = 0.0) -> dict[str, float]:
    """Mean validation loss at the last step, at the best step (oracle), and with early exit by the
    policy under ``inference``: the same rule evaluation uses (default: :class:`InferenceConfig`).

    With a ``price`` on computation, the oracle and policy scores are the priced objective
    loss + price * c_t (c_t: the model's normalised cost of stopping at t), so that selection does not
    favour never stopping.
    """
    inference = inference or InferenceConfig()
    costs = exit_costs(sm.model) * price if price else None
    was_training = sm.training
    sm.eval()
    totals: dict[str, float] = {"last": 0.0, "oracle": 0.0, "policy": 0.0, "depth": 0.0}
    n = 0
    gen = torch.Generator().manual_seed(seed)
    for inputs, target in batches:
        # One full rollout scores all three: early exit returns exactly the full-depth output at
        # the rule's stop time, so its loss is read off the per-step losses.
        r = sm.unroll(inputs, target, loss_fn, keep_outputs=not inference.uses_policy)
        b = r.losses.shape[0]
        totals["last"] += float(r.losses[:, -1].sum())
        priced = r.losses if costs is None else r.losses + costs.to(r.losses)[None]
        totals["oracle"] += float(priced.min(dim=1).values.sum())
        if sm.policy is not None:
            if inference.uses_policy:
                stop = inference.stop_times(r, gen)
            else:
                signal = inference.signal(sm.policy)
                stop = first_crossing(signal_trace(signal, r.step_outputs, inputs), signal.from_param(inference.param))
            totals["policy"] += float(priced.gather(1, stop[:, None] - 1).sum())
            totals["depth"] += float(stop.float().sum())
        n += b
    sm.train(was_training)
    if n == 0:
        raise ValueError("the validation set is empty: validation_batches() yielded no samples, so no weights "
                         "can be selected; give it data or set select: none")
    out = {k: v / n for k, v in totals.items()}
    bad = [k for k, v in out.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"validation scores {', '.join(bad)} are NaN or inf: the model's outputs or the "
                                 f"loss are not finite on the validation set")
    if sm.policy is None:
        out.pop("policy"), out.pop("depth")
    return out


#: the StoppingModel's attributes a stage trains, by ``StageConfig.trains``
TRAINED_PARTS = {"model": ("model",), "policy": ("policy",), "both": ("model", "policy")}


class WeightAverage:
    """An exponential moving average of a stage's trained tensors: its parameters and float buffers.

    ``tensors`` are the live tensors by name (entries of the model's ``state_dict(keep_vars=True)``);
    :meth:`update` moves the average towards them (once per training step), :meth:`swap` exchanges the two
    in place (twice: back).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.names = [k for k, v in tensors.items() if v.is_floating_point()]
        self._live = [tensors[k].detach() for k in self.names]  # views of the model's storage
        self._avg = [v.clone() for v in self._live]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        torch._foreach_lerp_(self._avg, self._live, 1.0 - decay)

    @torch.no_grad()
    def swap(self) -> None:
        kept = [v.clone() for v in self._live]
        torch._foreach_copy_(self._live, self._avg)
        torch._foreach_copy_(self._avg, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in zip(self.names, self._avg)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            raise CheckpointError("the checkpoint's weight average does not fit this model's trained tensors")
        torch._foreach_copy_(self._avg, [state[k] for k in self.names])


def same_stage_config(stored: Any, cfg: StageConfig) -> bool:
    """Whether a checkpoint's stage config is ``cfg``'s (field for field: a checkpoint of another format is refused
    when it is loaded, so both sides have the same fields)."""
    return isinstance(stored, dict) and stored == to_dict(cfg)


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
        if self.ctx.is_main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ helpers
    def _log(self, record: dict) -> None:
        if self.ctx.is_main:
            append_jsonl(self.run_dir / "metrics.jsonl", record)  # strict JSON: NaN/inf become null

    def _trainable(self, cfg: StageConfig) -> list[nn.Parameter]:
        """The stage's parameters (those of its trained parts the user has not frozen), the only ones left with
        ``requires_grad``; the user's own flags come back after the stage (:meth:`_restore_flags`)."""
        parts = [getattr(self.sm, name) for name in TRAINED_PARTS[cfg.trains]]
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
        for p, wants in getattr(self, "_user_flags", ()):
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

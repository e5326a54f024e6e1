"""The task registry and what every application hands to the CLI.

An application registers a :class:`TaskSpec`: its config dataclass, its presets (partial dicts
over the config's defaults) and its commands, each a plain function ``command(cfg, run) -> dict``.
The CLI only resolves the config, makes the :class:`RunContext` and calls the command.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..utils.config import save_yaml
from ..utils.distributed import DistContext
from ..utils.registry import Registry


@dataclass
class RunContext:
    """Where a command writes, and how it runs: decided by the CLI (or a script), passed down."""

    run_dir: Path
    ctx: DistContext = field(default_factory=DistContext)
    progress: bool = True
    resume: bool = True
    options: dict = field(default_factory=dict)  # command-specific flags (--budget, --epsilon, ...)

    @property
    def device(self):
        return self.ctx.device

    def prepare(self, cfg: Any, command: str = "train") -> None:
        """Create the run directory and save the resolved config beside the checkpoints.

        Training commands write ``config.yaml``; any other command writes ``config.<command>.yaml``,
        so that evaluating with other flags never overwrites the record of how the run was trained.
        """
        self.run_dir = Path(self.run_dir)
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            name = "config.yaml" if command in ("train", "reproduce") else f"config.{command}.yaml"
            save_yaml(cfg, self.run_dir / name)
        self.ctx.barrier()

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)


@dataclass
class TaskSpec:
    """An application as the CLI sees it."""

    name: str
    description: str
    config_class: type
    presets: dict[str, dict]
    commands: dict[str, Callable[[Any, RunContext], dict]]
    default_preset: str = "quick"
    app: Any = None  # the task's StoppingApp: adds the core's calibrate and frontier commands


TASKS: Registry[TaskSpec] = Registry("task")

#: commands that only read a trained run (they never write config.yaml)
READ_ONLY = ("evaluate", "calibrate", "frontier")


def register_task(spec: TaskSpec) -> TaskSpec:
    """Register a task; a task with a :class:`StoppingApp` gets ``calibrate`` and ``frontier`` too."""
    if spec.app is not None:
        from ..core.pipeline import calibrate_command, frontier_command

        def calibrate(cfg, run):
            o = run.options
            return calibrate_command(spec.app, cfg, run, budget=o.get("budget"), epsilon=o.get("epsilon"),
                                     delta=o.get("delta", 0.1), rule=o.get("rule"))

        def frontier(cfg, run):
            return frontier_command(spec.app, cfg, run, speed=not run.options.get("no_speed", False))

        spec.commands.setdefault("calibrate", calibrate)
        spec.commands.setdefault("frontier", frontier)
    TASKS.register(spec.name)(spec)
    return spec


def get_task(name: str) -> TaskSpec:
    from . import load_all

    load_all()
    return TASKS.get(name)


def list_tasks() -> list[str]:
    from . import load_all

    load_all()
    return TASKS.names()

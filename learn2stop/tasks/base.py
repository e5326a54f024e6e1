"""The task registry and what every application hands to the CLI.

An application registers a :class:`TaskSpec`: its config dataclass, its presets (partial dicts
over the config's defaults) and its commands, each a plain function ``command(cfg, run) -> dict``.
The CLI only resolves the config, makes the :class:`RunContext` and calls the command.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..utils.config import to_dict
from ..utils.config_files import save_yaml
from ..utils.distributed import DistContext
from ..utils.registry import Registry

#: commands that create or extend a run; any other command needs an existing, matching run.
TRAINING_COMMANDS = ("train", "reproduce")


def run_fingerprint(cfg: Any) -> dict:
    """What a run's results depend on: the resolved config less the sections that only say how to read a
    trained run (rule, evaluation, inputs), which each task's config names in its ``reader_fields`` class
    attribute (default: ``inference``)."""
    readers = getattr(type(cfg), "reader_fields", ("inference",))
    return {k: v for k, v in to_dict(cfg).items() if k not in readers}


#: the command-line options that only some commands read: anywhere else they would be silently ignored
OPTION_READERS = {"budget": ("calibrate",), "epsilon": ("calibrate",), "delta": ("calibrate",), "rule": ("calibrate",),
                  "fastest": ("calibrate",), "speed_batch": ("calibrate",),
                  "no_speed": ("frontier",), "backend": ("evaluate", "frontier"), "out": ("export",)}


@dataclass(frozen=True)
class CommandOptions:
    """The options of one command beyond the config (``--budget``, ``--backend``, ...), checked once when made:
    an option the command does not read, a calibration target that is not exactly one, an unknown backend.
    Whether ``rule`` is one of the task's rules is for the task to say (:func:`~learn2stop.core.task.check_rule`)."""

    command: str = "train"
    budget: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    rule: str | None = None
    fastest: bool = False
    speed_batch: int | None = None
    no_speed: bool = False
    backend: str | None = None  # comma-separated backend names
    out: str | None = None

    def __post_init__(self) -> None:
        from ..utils.config import ConfigError

        for name, commands in OPTION_READERS.items():
            if getattr(self, name) not in (None, False) and self.command not in commands:
                raise ConfigError(f"--{name.replace('_', '-')}: only the {' and '.join(repr(c) for c in commands)} "
                                  f"command(s) read it; '{self.command}' would ignore it")
        if self.command == "calibrate":
            self.target  # noqa: B018 - exactly one target, in range
        if self.backend is not None and len(self.backends) > 1 and self.command == "evaluate":
            raise ConfigError(f"--backend: evaluate runs on one backend; got {self.backend!r} (frontier takes several)")

    @property
    def target(self):
        """What ``calibrate`` aims at (:class:`~learn2stop.core.calibration.CalibrationTarget`)."""
        from ..core.calibration import CalibrationTarget

        return CalibrationTarget(self.budget, self.epsilon, self.delta)

    @property
    def backends(self) -> tuple[str, ...]:
        """The backend names asked for, in order (default ``("torch",)``; refused if unknown or repeated)."""
        from ..backends import parse_backends

        return tuple(parse_backends(self.backend))


@dataclass
class RunContext:
    """Where a command writes, and how it runs: decided by the CLI (or a script), passed down (the core reads it
    through its :class:`~learn2stop.core.task.Run` protocol)."""

    run_dir: Path
    ctx: DistContext = field(default_factory=DistContext)
    progress: bool = True
    resume: bool = True
    options: CommandOptions = field(default_factory=CommandOptions)
    #: the runners built from ``options`` (once), the command that prepared the run, and its lock
    _runners: dict | None = field(default=None, init=False, repr=False)
    _prepared: str | None = field(default=None, init=False, repr=False)
    _lock: Any = field(default=None, init=False, repr=False)

    @property
    def device(self):
        return self.ctx.device

    @property
    def runners(self) -> dict[str, Callable]:
        """Backend name -> runner, from ``options.backend`` (``torch``, ``compile``, ``onnxruntime``,
        comma-separated for a frontier side by side; see :mod:`learn2stop.backends`). Built once."""
        if self._runners is None:
            import torch

            from ..backends import make_runner

            self._runners = {n: make_runner(n, threads=torch.get_num_threads())
                             for n in self.options.backends}
        return self._runners

    @property
    def runner(self) -> Callable:
        """The runner ``evaluate`` uses: the first backend asked for (eager torch by default)."""
        return next(iter(self.runners.values()))

    def prepare(self, cfg: Any, command: str = "train") -> None:
        """Check the run directory, lock it, and record the resolved config beside the checkpoints.

        In order, so that a refused command changes nothing: the folder must be usable (a training
        command creates it; any other command needs it to exist); an exclusive lock is taken (a second
        writer is refused, naming the holder); leftover temporary files of a killed run are removed;
        the run must be of this library's run format, and of this task;
        the config's fingerprint must match the one the run was trained with (``fingerprint.json``), except,
        for a reading command, the config's ``location_fields`` (where the data lies: it may have moved);
        only then is ``config.yaml`` (training) or ``config.<command>.yaml`` written. With resume off,
        a training command first moves an existing run's files aside into ``previous-<time>/``.
        """
        from ..utils.checkpoint import clean_stale_temp_files
        from ..utils.fingerprint import (check_fingerprint, fingerprint_task, keep_trained_values, read_fingerprint,
                                         write_fingerprint)
        from ..utils.rundir import RunDirError, move_aside, prepare_run_dir
        from ..utils.runlock import RunLock

        if self._prepared is not None:
            return  # a command calling another (reproduce -> train) prepares once
        self.run_dir = Path(self.run_dir)
        training = command in TRAINING_COMMANDS
        if self.ctx.is_main:
            self.run_dir = prepare_run_dir(self.run_dir, create=training)
            self._lock = RunLock(self.run_dir, command).acquire()
            clean_stale_temp_files(self.run_dir)
            if training and not self.resume:
                moved = move_aside(self.run_dir)
                if moved is not None:
                    self.log(f"--no-resume: the earlier run's files were moved to {moved}")
            fp = run_fingerprint(cfg)
            ckpts = self.run_dir / "checkpoints"
            trained = ckpts.is_dir() and any(ckpts.glob("*.pt"))
            if training and not trained:
                # nothing trained yet (a first attempt that failed early): the settings are still free
                (self.run_dir / "fingerprint.json").unlink(missing_ok=True)
            task = task_of_config(cfg)
            stored = read_fingerprint(self.run_dir)  # refuses a run of another run format
            owner = fingerprint_task(self.run_dir)
            if task and owner and owner != task:
                raise RunDirError(f"run directory {self.run_dir} belongs to task {owner}; use 'learn2stop {owner} "
                                  f"{command}', or another --run-dir for task {task}")
            if not training:  # the data may have moved since training: a reading command reads it where it is now
                for name, old, new in keep_trained_values(fp, stored, getattr(type(cfg), "location_fields", ())):
                    self.log(f"{name}: reading {new!r} (the run was trained on {old!r})")
            known = check_fingerprint(self.run_dir, fp, command)
            if trained and not known:
                raise RunDirError(f"run directory {self.run_dir} has checkpoints but no fingerprint.json, so the "
                                  f"settings they were trained with cannot be checked; restore the file or use a "
                                  f"new --run-dir")
            if training and not known:
                write_fingerprint(self.run_dir, fp, task)
            if training:
                save_yaml(cfg, self.run_dir / "config.yaml")
        self._prepared = command
        self.ctx.barrier()

    def record(self, cfg: Any, command: str) -> None:
        """Save a reading command's config as ``config.<command>.yaml`` (after it succeeded; training
        commands saved ``config.yaml`` in :meth:`prepare`)."""
        if command not in TRAINING_COMMANDS and self.ctx.is_main:
            save_yaml(cfg, Path(self.run_dir) / f"config.{command}.yaml")

    def close(self) -> None:
        """Release the run directory's lock (the OS also releases it when the process ends)."""
        lock = self._lock
        if lock is not None:
            lock.release()
            self._lock = None
        self._prepared = None

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)


def task_of_config(cfg: Any) -> str | None:
    """The registered task whose config class ``cfg`` is (None for a config no task registered)."""
    return next((spec.name for spec in _specs() if isinstance(cfg, spec.config_class)), None)


def _specs() -> list["TaskSpec"]:
    from . import load_all

    load_all()
    return [TASKS.get(n) for n in TASKS.names()]


def as_run(run: "RunContext | str | Path") -> "RunContext":
    """A RunContext for a folder given as a path (the Python API), or the one the CLI made."""
    return run if isinstance(run, RunContext) else RunContext(Path(run))


@dataclass
class TaskSpec:
    """An application as the CLI sees it."""

    name: str
    description: str
    config_class: type
    presets: dict[str, dict]
    commands: dict[str, Callable[[Any, RunContext], dict]]
    default_preset: str = "quick"
    app: Any = None  # the task's StoppingApp: adds the core's train, reproduce, calibrate, frontier and export


TASKS: Registry[TaskSpec] = Registry("task")


def register_task(spec: TaskSpec) -> TaskSpec:
    """Register a task. A task with a :class:`StoppingApp` declares its own commands (``evaluate``: its tables, and
    any other, e.g. ``predict``) and gets the core's ``train``, ``reproduce``, ``calibrate``, ``frontier`` and
    ``export`` (:mod:`learn2stop.core.commands`), each ``command(cfg, run)`` with ``run`` a :class:`RunContext` or a
    run directory's path."""
    if spec.app is not None:
        spec.commands = {**core_commands(spec.app, spec.name, spec.commands.get("evaluate")), **spec.commands}
        order = ("train", "evaluate", "reproduce")
        spec.commands = {**{c: spec.commands[c] for c in order if c in spec.commands},
                         **{c: f for c, f in spec.commands.items() if c not in order and c not in CORE_LAST},
                         **{c: spec.commands[c] for c in CORE_LAST}}
    TASKS.register(spec.name)(spec)
    return spec


#: the core's commands that close a task's listing
CORE_LAST = ("calibrate", "frontier", "export")


def core_commands(app: Any, task: str, evaluate: Callable | None) -> dict[str, Callable[[Any, Any], dict]]:
    """The core's commands bound to a task's app: ``train``, ``reproduce`` (which ends with the task's
    ``evaluate``), ``calibrate``, ``frontier`` and ``export``."""
    from ..core import commands as core

    def train(cfg, run: "RunContext | str | Path") -> dict:
        """Train the task's stages into a run directory; resumes what exists."""
        return core.train(app, cfg, as_run(run))

    def calibrate(cfg, run: "RunContext | str | Path"):
        """Fit a stop rule to a target: --budget (mean cost) or --epsilon (a risk bound)."""
        return core.calibrate(app, cfg, as_run(run))

    def frontier(cfg, run: "RunContext | str | Path") -> dict:
        """Quality against mean steps and wall-clock time, every rule of the task side by side."""
        return core.frontier(app, cfg, as_run(run))

    def export(cfg, run: "RunContext | str | Path") -> dict:
        """ONNX graphs and a manifest to serve the run without torch (--out)."""
        from ..export import export_command

        run = as_run(run)
        return export_command(app, cfg, run, out=run.options.out, task=task)

    out = {"train": train, "calibrate": calibrate, "frontier": frontier, "export": export}
    if evaluate is not None:
        def reproduce(cfg, run: "RunContext | str | Path") -> dict:
            """Train, deploy the rule calibrated to keep full depth's quality, evaluate."""
            return core.reproduce(app, cfg, as_run(run), evaluate)

        out["reproduce"] = reproduce
    return out


def get_task(name: str) -> TaskSpec:
    from . import load_all

    load_all()
    return TASKS.get(name)


def list_tasks() -> list[str]:
    from . import load_all

    load_all()
    return TASKS.names()

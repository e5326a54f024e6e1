"""The ``learn2stop`` command: ``learn2stop <task> <command> [--preset P] [--config F.yaml] [--section.field V]``.

Examples:
    learn2stop list
    learn2stop sparse reproduce --preset quick
    learn2stop sparse train --preset paper --run-dir runs/paper --stage1.lr 1e-4
    learn2stop sparse train --help
    torchrun --nproc_per_node 4 -m learn2stop sparse train --preset paper

``learn2stop --help`` and ``learn2stop <task> --help`` are short; ``learn2stop <task> <command> --help`` lists every
flag of that command, each config field's with its docstring and its value under the preset. A mistyped task,
command or flag is refused in one line with the nearest name.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

from . import __version__
from .tasks.base import OPTION_READERS, TRAINING_COMMANDS, CommandOptions, RunContext, get_task, list_tasks
from .utils.checkpoint import CheckpointError
from .utils.config import ConfigError, closest, from_dict, to_dict
from .utils.config_files import ConfigFileError, merge_layers, resolve
from .utils.config_flags import add_config_arguments, overrides_from_args
from .utils.rundir import RunDirError, check_run_dir_name

#: what the commands every task has do (a task's own command says it in its docstring)
COMMANDS = {
    "train": "Train the task's stages into a run directory; resumes what exists",
    "evaluate": "The trained run on the test set with the deployed rule: tables and figures",
    "reproduce": "Train, deploy the rule calibrated to keep full depth's quality, evaluate",
    "calibrate": "Fit a stop rule to a target: --budget (mean cost) or --epsilon (a risk bound)",
    "frontier": "Quality against mean steps and wall-clock time, every rule of the task side by side",
    "export": "ONNX graphs and a manifest to serve the run without torch (--out)",
}
#: the flags of every command, as ``learn2stop <task> --help`` shows them
MAIN_FLAGS = ("--preset", "--config", "--run-dir", "--device", "--threads", "--print-config")


def _summary(doc: str | None) -> str:
    """The first sentence of a docstring, on one line."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")
    return text.split(". ")[0].rstrip(".")


def _command_summary(spec, command: str) -> str:
    return _summary(spec.commands[command].__doc__) or COMMANDS.get(command, "")


def _overview() -> str:
    """``learn2stop --help``: the tasks and the commands, one line each."""
    specs = [get_task(n) for n in list_tasks()]
    lines = ["usage: learn2stop <task> <command> [flags]", "", "tasks:"]
    lines += [f"  {s.name:<11}{s.description}" for s in specs]
    lines += ["", "commands:"]
    lines += [f"  {c:<11}{about}" for c, about in COMMANDS.items()]
    lines += [f"  {c:<11}({s.name}) {_command_summary(s, c)}" for s in specs for c in s.commands if c not in COMMANDS]
    lines += [f"  {'list':<11}The tasks with their commands and presets", "",
              "learn2stop <task> --help              A task's commands, presets and main flags",
              "learn2stop <task> <command> --help    Every flag of a command, with its help and default",
              "learn2stop --version                  The installed version"]
    return "\n".join(lines)


def _task_help(spec) -> str:
    """``learn2stop <task> --help``: the task's commands, presets and the flags most runs use."""
    parser = build_parser(spec.name, "train")
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    sections = [n.split(".")[0] for n in actions if n.count(".") >= 1]
    lines = [f"usage: learn2stop {spec.name} <command> [flags]", "", spec.description, "", "commands:"]
    lines += [f"  {c:<11}{_command_summary(spec, c)}" for c in spec.commands]
    lines += ["", f"presets: {', '.join(spec.presets)} (default {spec.default_preset})", "", "main flags:"]
    for flag in MAIN_FLAGS:
        a = actions[flag]
        name = f"{flag} {a.metavar}" if a.metavar else flag
        lines.append(f"  {name:<22}{a.help.replace('%%', '%')}")
    lines += textwrap.wrap(f"any config field, e.g. --stage1.lr 1e-3; sections: "
                           f"{', '.join(dict.fromkeys(s[2:] for s in sections))}", 100,
                           initial_indent=f"  {'--SECTION.FIELD V':<22}", subsequent_indent=" " * 24)
    lines += ["",
              f"learn2stop {spec.name} <command> --help lists every flag of a command, with its help and default."]
    return "\n".join(lines)


def _list() -> int:
    for name in list_tasks():
        spec = get_task(name)
        print(f"{name}: {spec.description}")
        print(f"  commands: {', '.join(spec.commands)}")
        print(f"  presets:  {', '.join(spec.presets)} (default {spec.default_preset})")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and a pointer to ``--help``, not the usage of 130 flags, and whose
    unknown flags get the nearest known one."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n  ({self.prog} --help lists its flags)\n")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:  # type: ignore[override]
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            word = extra[0]
            if not word.startswith("-"):
                self.error(f"unexpected argument {word!r}")
            flag = word.split("=", 1)[0]
            self.error(f"unknown flag {flag}{_did_you_mean(flag, self._option_string_actions, quote=False)}")
        return ns


def build_parser(task_name: str, command: str, preset: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``learn2stop <task> <command>``: the shared ones, the command options (those another command
    reads are accepted, refused later by name, and left out of ``--help``), one per config field with its
    docstring and its value under ``preset`` (default: the task's)."""
    spec = get_task(task_name)
    preset = preset if preset in spec.presets else spec.default_preset
    parser = _Parser(prog=f"learn2stop {task_name} {command}", usage="%(prog)s [flags]",
                     description=_command_summary(spec, command),
                     formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=40),
                     allow_abbrev=False)  # a prefix of one field's flag would silently stop working once another shares it
    parser.add_argument("--preset", default=spec.default_preset, metavar="P",
                        help=f"the settings to start from: {', '.join(spec.presets)} (default "
                             f"{spec.default_preset}; a reading command given --run-dir starts from the run's own "
                             "config.yaml)")
    parser.add_argument("--config", default=None, metavar="F.yaml",
                        help="YAML file of config fields, applied over the preset (flags apply over it)")
    parser.add_argument("--run-dir", default=None, metavar="DIR", help=f"output folder (default runs/{task_name}-<preset>)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], metavar="D",
                        help="auto (cuda if present), cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    options = parser.add_argument_group(f"options of {command}")

    def option(flag: str, **kw) -> None:
        readers = OPTION_READERS.get(flag[2:].replace("-", "_"), TRAINING_COMMANDS)
        options.add_argument(flag, **{**kw, **({} if command in readers else {"help": argparse.SUPPRESS})})

    option("--no-resume", action="store_true", help="start the stages afresh (the earlier run's files are moved aside)")
    option("--budget", type=float, default=None, metavar="B",
           help="mean steps (or cost) at most this fraction of full depth, in (0, 1]")
    option("--epsilon", type=float, default=None, metavar="E",
           help="the metric may be worse than full depth's by at most this (risk control)")
    option("--delta", type=float, default=None, metavar="D",
           help="with --epsilon: the bound holds with probability >= 1 - delta (default 0.1)")
    option("--rule", default=None, metavar="R", help="which rule (default: inference.rule)")
    option("--fastest", action="store_true", help="every rule of the task (the policy's, the classical ones, a fixed "
                                                  "depth) calibrated and timed side by side on this machine; keep the fastest")
    option("--speed-batch", type=int, default=None, metavar="N",
           help="with --fastest: the batch size at which the rules are timed (default: the task's)")
    option("--no-speed", action="store_true", help="skip the wall-clock measurements")
    option("--backend", default=None, metavar="B",
           help="where early exit runs: torch (default), compile (torch.compile), stream (the streaming runner: freed "
                "rows refilled at every step) or onnxruntime (the exported graphs); frontier takes several, "
                "comma-separated, side by side")
    option("--out", default=None, metavar="DIR", help="folder for the ONNX graphs and manifest (new, or an earlier export)")
    add_config_arguments(parser, spec.config_class, to_dict(resolve(spec.config_class, spec.presets[preset])))
    return parser


def _fail(prog: str, message: str, see: str) -> int:
    print(f"{prog}: error: {message}\n  ({see})", file=sys.stderr)
    return 2


def _did_you_mean(word: str, choices, quote: bool = True) -> str:
    """"; did you mean 'x'?" for the nearest choice (a flag unquoted), or "" if none is near."""
    guess = closest(word, choices)
    if guess is None:
        return ""
    return f"; did you mean {guess!r}?" if quote else f"; did you mean {guess}?"


def _preset_asked(args: list[str]) -> str | None:
    """The value of ``--preset`` among the flags, before parsing (``--help`` shows that preset's values)."""
    for i, a in enumerate(args):
        if a.startswith("--preset="):
            return a.split("=", 1)[1]
        if a == "--preset" and i + 1 < len(args):
            return args[i + 1]
    return None


def _trained_config(run_dir: Path, task_name: str) -> str | None:
    """The config.yaml a run of this task was trained with (None: none, or a run of another task or run format,
    which the run directory's own checks then refuse by name)."""
    from .utils.fingerprint import fingerprint_task
    from .utils.rundir import RunDirError

    try:
        ours = fingerprint_task(run_dir) == task_name
    except (RunDirError, OSError):
        return None
    trained = run_dir / "config.yaml"
    return str(trained) if ours and trained.is_file() else None


def _resolve(spec, args: argparse.Namespace):
    """The config of the preset, ``--config`` and the field flags. Its rule is checked once, on this config, by
    :func:`check_command_options`; but when the config is refused for ``inference.param``, a rule the task lacks is
    the mistake to name (another rule's parameter range says nothing useful)."""
    try:
        data = merge_layers(spec.config_class, spec.presets[args.preset], args.config, overrides_from_args(args))
    except ConfigFileError as e:  # the file itself (not a value in it): the user's argument is --config
        raise (ConfigError(e.reason, "--config") if e.field is None else e) from None
    try:
        return from_dict(spec.config_class, data)
    except ConfigError as e:
        if e.field == "inference.param" and spec.app is not None:
            from .core.task import check_rule

            check_rule(spec.app, spec.config_class(), data["inference"]["rule"], "inference.rule", spec.name)
        raise


def check_command_options(args: argparse.Namespace, spec, cfg, command: str) -> CommandOptions:
    """The command's options, typed and checked (:class:`CommandOptions`), and its rules the task's own (checked
    here only, on the resolved config: a rule can depend on it), before any run directory is touched."""
    from .core.task import check_rule

    options = CommandOptions(command=command, budget=args.budget, epsilon=args.epsilon, delta=args.delta,
                             rule=args.rule, fastest=args.fastest, speed_batch=args.speed_batch,
                             no_speed=args.no_speed, backend=args.backend, out=args.out)
    if args.no_resume and command not in TRAINING_COMMANDS:
        raise ConfigError(f"only the {' and '.join(repr(c) for c in TRAINING_COMMANDS)} command(s) read it; "
                          f"'{command}' would ignore it", "--no-resume")
    if spec.app is not None:
        if hasattr(cfg, "inference"):
            check_rule(spec.app, cfg, cfg.inference.rule, "inference.rule", spec.name)
        if options.rule is not None:
            check_rule(spec.app, cfg, options.rule, "--rule", spec.name)
        from .backends import check_exportable

        check_exportable(command, options.backends, spec.app.export_unsupported)
    return options


def _new_folder_root(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what a refused command must not leave)."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists():
        top = top.parent
    return top


def _remove_new_run(top: Path | None, run_dir: Path) -> None:
    """After a refused training command in a folder it created: remove the folder if it holds only the
    command's own bookkeeping (lock, config, fingerprint, an empty checkpoints/), never a checkpoint."""
    import shutil

    if top is None or not top.is_dir():
        return
    run_dir = Path(run_dir).expanduser().absolute()
    ours = {".lock", "config.yaml", "fingerprint.json", "metrics.jsonl", "checkpoints"}
    if run_dir.is_dir():
        entries = {p.name for p in run_dir.iterdir()}
        ckpts = run_dir / "checkpoints"
        if not entries <= ours or (ckpts.is_dir() and any(ckpts.iterdir())):
            return
        shutil.rmtree(run_dir)
    for folder in [run_dir.parent, *run_dir.parent.parents]:  # the empty parents it made
        if not (folder == top or top in folder.parents):
            break
        try:
            folder.rmdir()
        except OSError:
            break


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"learn2stop {__version__}")
        return 0
    if argv[0] == "list":
        return _list()
    task_name, tasks = argv[0], list_tasks()
    if task_name not in tasks:
        if task_name.startswith("-"):
            return _fail("learn2stop", f"unknown flag {task_name}{_did_you_mean(task_name, ['--help', '--version'], False)}",
                         "learn2stop --help")
        return _fail("learn2stop", f"unknown task {task_name!r}{_did_you_mean(task_name, [*tasks, 'list'])}",
                     "learn2stop --help lists the tasks")
    spec = get_task(task_name)
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        if len(argv) < 2:
            return _fail(f"learn2stop {task_name}", f"give a command: {', '.join(spec.commands)}",
                         f"learn2stop {task_name} --help")
        print(_task_help(spec))
        return 0
    command = argv[1]
    if command not in spec.commands:
        what = (f"the command comes first: learn2stop {task_name} <command> {command} ...; commands: "
                f"{', '.join(spec.commands)}" if command.startswith("-") else
                f"unknown command {command!r} for task {task_name!r}{_did_you_mean(command, spec.commands)}")
        return _fail(f"learn2stop {task_name}", what, f"learn2stop {task_name} --help lists its commands")
    parser = build_parser(task_name, command, _preset_asked(argv[2:]))
    args = parser.parse_args(argv[2:])
    if command not in TRAINING_COMMANDS and args.run_dir and args.config is None and _preset_asked(argv[2:]) is None:
        args.config = _trained_config(Path(args.run_dir), task_name)
    try:
        if args.preset not in spec.presets:
            guess = _did_you_mean(args.preset, spec.presets)
            raise ConfigError(f"unknown preset {args.preset!r} for task {task_name!r}"
                              + (f"{guess} (available: {', '.join(spec.presets)})" if guess else
                                 f"; available: {', '.join(spec.presets)}"), "preset")
        cfg = _resolve(spec, args)
    except ConfigError as e:
        parser.error(str(e))
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    run_dir = Path(args.run_dir or f"runs/{task_name}-{args.preset}")
    try:
        check_run_dir_name(run_dir)  # by name, before anything stats it: a bare OSError otherwise
    except RunDirError as e:
        parser.error(str(e))
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1; got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    from .utils.distributed import init_distributed, shutdown_distributed

    try:
        ctx = init_distributed(args.device)
    except ValueError as e:
        parser.error(str(e))
    run = RunContext(run_dir=run_dir, ctx=ctx,
                     progress=not args.no_progress, resume=not args.no_resume)
    new_folder = _new_folder_root(run.run_dir) if command in TRAINING_COMMANDS else None
    failed = True
    try:
        run.options = check_command_options(args, spec, cfg, command)  # the flags first: a bad option touches no run directory
        if command == "export":  # likewise: a bad --out touches no run directory
            from .export import check_out_dir

            check_out_dir(args.out)
        run.prepare(cfg, command)
        spec.commands[command](cfg, run)
        run.record(cfg, command)  # a reading command's config.<command>.yaml: only once it succeeded
        failed = False
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"learn2stop {task_name} {command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        run.close()
        shutdown_distributed(ctx)
        if failed and ctx.is_main:
            _remove_new_run(new_folder, run.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

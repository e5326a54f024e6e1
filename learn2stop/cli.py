"""The ``learn2stop`` command: ``learn2stop <task> <command> [--preset P] [--config F.yaml] [--field.x V]``.

Examples:
    learn2stop list
    learn2stop sparse reproduce --preset quick
    learn2stop sparse train --preset paper --run-dir runs/paper --stage1.lr 1e-4
    torchrun --nproc_per_node 4 -m learn2stop sparse train --preset paper
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .tasks.base import TRAINING_COMMANDS, CommandOptions, RunContext, get_task, list_tasks
from .utils.checkpoint import CheckpointError
from .utils.config import ConfigError, add_config_arguments, overrides_from_args, resolve


def _list() -> int:
    for name in list_tasks():
        spec = get_task(name)
        print(f"{name}: {spec.description}")
        print(f"  commands: {', '.join(spec.commands)}")
        print(f"  presets:  {', '.join(spec.presets)} (default {spec.default_preset})")
    return 0


def build_parser(task_name: str) -> argparse.ArgumentParser:
    spec = get_task(task_name)
    parser = argparse.ArgumentParser(prog=f"learn2stop {task_name}", description=spec.description)
    parser.add_argument("command", choices=sorted(spec.commands), help="what to run")
    parser.add_argument("--preset", default=spec.default_preset, help=f"one of: {', '.join(spec.presets)}")
    parser.add_argument("--config", default=None, help="YAML file of config fields (applied over the preset)")
    parser.add_argument("--run-dir", default=None, help="output folder (default runs/<task>-<preset>)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 is far faster on a busy machine)")
    parser.add_argument("--no-resume", action="store_true", help="start stages afresh even if checkpoints exist")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    cal = parser.add_argument_group("calibrate and frontier")
    cal.add_argument("--budget", type=float, default=None,
                     help="calibrate: mean steps (or cost) at most this fraction of full depth, in (0, 1]")
    cal.add_argument("--epsilon", type=float, default=None,
                     help="calibrate: the metric may be worse than full depth by at most this (risk control)")
    cal.add_argument("--delta", type=float, default=None,
                     help="calibrate: the bound holds with probability >= 1 - delta (default 0.1)")
    cal.add_argument("--rule", default=None, help="calibrate: which rule (default: inference.rule)")
    cal.add_argument("--fastest", action="store_true",
                     help="calibrate: every rule of the task (the policy's, the classical ones, a fixed depth) for the "
                          "target, timed side by side on this machine; keep the fastest")
    cal.add_argument("--speed-batch", type=int, default=None,
                     help="calibrate --fastest: the batch size at which the rules are timed (default: the task's)")
    cal.add_argument("--no-speed", action="store_true", help="frontier: skip the wall-clock measurements")
    cal.add_argument("--backend", default=None,
                     help="evaluate, frontier: where early exit runs: torch (default), compile (torch.compile), stream "
                          "(the streaming runner: freed rows refilled at every step) or onnxruntime (the exported "
                          "graphs); frontier takes several, comma-separated, side by side")
    parser.add_argument("--out", default=None, help="export: folder for the ONNX graphs and manifest (new, or an earlier export)")
    add_config_arguments(parser, spec.config_class)
    return parser


def check_command_options(args: argparse.Namespace, spec, cfg) -> CommandOptions:
    """The command's options, typed and checked (:class:`CommandOptions`), and its rules the task's own, before
    any run directory is touched."""
    from .core.task import check_rule

    options = CommandOptions(command=args.command, budget=args.budget, epsilon=args.epsilon, delta=args.delta,
                             rule=args.rule, fastest=args.fastest, speed_batch=args.speed_batch,
                             no_speed=args.no_speed, backend=args.backend, out=args.out)
    if args.no_resume and args.command not in TRAINING_COMMANDS:
        raise ConfigError(f"--no-resume: only the {' and '.join(repr(c) for c in TRAINING_COMMANDS)} command(s) read it; "
                          f"'{args.command}' would ignore it")
    if spec.app is not None:
        check_rule(spec.app, cfg, cfg.inference.rule if hasattr(cfg, "inference") else "quantile", "inference.rule",
                   spec.name)
        if options.rule is not None:
            check_rule(spec.app, cfg, options.rule, "--rule", spec.name)
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
        print(__doc__.strip())
        print("\ntasks:", ", ".join(list_tasks()))
        return 0
    if argv[0] == "list":
        return _list()
    task_name = argv[0]
    try:
        spec = get_task(task_name)
    except KeyError as e:
        print(f"learn2stop: error: {e.args[0]}", file=sys.stderr)
        return 2
    parser = build_parser(task_name)
    args = parser.parse_args(argv[1:])
    try:
        if args.preset not in spec.presets:
            raise ConfigError(f"preset: unknown preset {args.preset!r} for task {task_name!r}; available: {', '.join(spec.presets)}")
        overrides = overrides_from_args(args)
        asked = overrides.get("inference", {}).get("rule") if isinstance(overrides.get("inference"), dict) else None
        if asked is not None and spec.app is not None:  # the task's rules first: its other settings do not matter then
            from .core.task import check_rule

            check_rule(spec.app, spec.config_class(), asked, "inference.rule", task_name)
        cfg = resolve(spec.config_class, spec.presets[args.preset], args.config, overrides)
    except ConfigError as e:
        parser.error(str(e))
    if args.print_config:
        import yaml

        from .utils.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
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
    run = RunContext(run_dir=Path(args.run_dir or f"runs/{task_name}-{args.preset}"), ctx=ctx,
                     progress=not args.no_progress, resume=not args.no_resume)
    new_folder = _new_folder_root(run.run_dir) if args.command in TRAINING_COMMANDS else None
    failed = True
    try:
        run.options = check_command_options(args, spec, cfg)  # the flags first: a bad option touches no run directory
        if args.command == "export":  # likewise: a bad --out touches no run directory
            from .export import check_out_dir

            check_out_dir(args.out)
        run.prepare(cfg, args.command)
        spec.commands[args.command](cfg, run)
        run.record(cfg, args.command)  # a reading command's config.<command>.yaml: only once it succeeded
        failed = False
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"learn2stop {task_name} {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        run.close()
        shutdown_distributed(ctx)
        if failed and ctx.is_main:
            _remove_new_run(new_folder, run.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

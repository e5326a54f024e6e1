"""MAML-stop: task-imbalanced few-shot learning with a learned number of adaptation steps (Sec. 5.2).

:mod:`.app` holds the config, presets, the :class:`~learn2stop.core.task.StoppingApp` and the commands, and
registers the task, as every task does.
"""
from .app import APP, PRESETS, SPEC, MAMLConfig, evaluate, preset, reproduce, train

__all__ = ["APP", "PRESETS", "SPEC", "MAMLConfig", "evaluate", "preset", "reproduce", "train"]

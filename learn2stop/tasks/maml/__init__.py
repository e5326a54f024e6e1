"""MAML-stop: task-imbalanced few-shot learning with a learned number of adaptation steps (Sec. 5.2).

Laid out as every task is: :mod:`.config` (dataclasses and presets), :mod:`.data` (the splits, the sampler, the
evaluation tasks; with :mod:`.classes`, :mod:`.omniglot` and :mod:`.samplers`), :mod:`.learner` and :mod:`.models`
(MAML as a step-wise model, the kept answer, the builders), :mod:`.policy`, :mod:`.metric`, :mod:`.report`,
:mod:`.app` (the :class:`~learn2stop.core.task.StoppingApp`) and :mod:`.commands` (the commands and the task's
registration). :mod:`.memory` measures a training step's memory for the benchmarks.
"""
from .app import APP
from .commands import SPEC, evaluate, reproduce, train
from .config import PRESETS, MAMLConfig, preset

__all__ = ["APP", "PRESETS", "SPEC", "MAMLConfig", "evaluate", "preset", "reproduce", "train"]

"""The language-model task's registration: ``learn2stop lm train | evaluate | reproduce | calibrate | generate``.

Python API (the CLI calls exactly these)::

    from learn2stop.tasks.lm import preset, reproduce, generate_text
    results = reproduce(preset("quick"), "runs/lm-quick")
    print(open("runs/lm-quick/results.md").read())
"""
from __future__ import annotations

from ..base import TaskSpec, register_task
from .calibrate import calibrate
from .commands import evaluate, generate_command, reproduce, train
from .config import PRESETS, LmConfig

SPEC = register_task(TaskSpec(
    name="lm",
    description="Early-exit character language model: GPT, deep supervision, Stage I + per-token policy vs CALM's "
                "rules, Learn-then-Test, self-speculative decoding",
    config_class=LmConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce, "calibrate": calibrate,
              "generate": generate_command},
))

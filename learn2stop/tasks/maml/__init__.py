"""MAML-stop: task-imbalanced few-shot learning with a learned number of adaptation steps (Sec. 5.2)."""
from ..base import TaskSpec, register_task
from .app import APP, PRESETS, MAMLConfig, evaluate, preset, reproduce, train

SPEC = register_task(TaskSpec(
    name="maml",
    description="MAML-stop: meta-learning with a learned number of inner steps per task (Sec. 5.2)",
    config_class=MAMLConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce},
    app=APP,
))

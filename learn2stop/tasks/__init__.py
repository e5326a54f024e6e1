"""Applications of learn2stop. Each registers itself in :data:`TASKS` on import."""
from .base import TASKS, RunContext, TaskSpec, get_task, list_tasks  # noqa: F401


def load_all() -> None:
    """Import every bundled application so that it registers (kept lazy: torch-heavy imports)."""
    import importlib

    for name in ("sparse", "maml", "denoise", "classify", "lm"):
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise

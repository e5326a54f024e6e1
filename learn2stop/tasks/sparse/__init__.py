"""Sparse recovery (paper Sec. 5.1): LISTA-stop against LISTA, ISTA and FISTA.

Pieces: :mod:`.config` (config and presets), :mod:`.data` (the problems and the training task), :mod:`.models`
(LISTA, ISTA, FISTA), :mod:`.policy` (the depth planner and the per-step policy), :mod:`.metric` (NMSE),
:mod:`.report` (Tables 1-2, Figure 4), :mod:`.commands` (evaluate) and
:mod:`.app` (the :class:`~learn2stop.core.task.StoppingApp`; registers the task).
"""
from .app import build_lista_stop, evaluate, reproduce, train  # noqa: F401
from .commands import tune_classical  # noqa: F401
from .config import PRESETS, ProblemConfig, SparseConfig, preset  # noqa: F401
from .data import SparseRecoveryTask, fixed_set, make_matrix, sample_problems  # noqa: F401
from .metric import nmse_by_snr, nmse_db  # noqa: F401
from .models import FISTA, ISTA, LISTA, soft_threshold  # noqa: F401
from .policy import SparseDepthPlanner, SparseStopPolicy  # noqa: F401

"""Sparse recovery (paper Sec. 5.1): LISTA-stop against LISTA, ISTA and FISTA."""
from .app import PRESETS, SparseConfig, build_lista_stop, evaluate, preset, reproduce, train, tune_classical  # noqa: F401
from .models import FISTA, ISTA, LISTA, soft_threshold  # noqa: F401
from .policy import SparseDepthPlanner, SparseStopPolicy  # noqa: F401
from .problem import ProblemConfig, fixed_set, make_matrix, nmse_by_snr, nmse_db, sample_problems  # noqa: F401
from .task import SparseRecoveryTask  # noqa: F401

"""Shared fixtures: a tiny step-wise model and policy, seeded generators, data paths."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from learn2stop.tasks.maml.policy import PosteriorPredictive

torch.set_num_threads(1)  # tests use tiny tensors: one thread avoids OpenMP spin-waits on a busy machine

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# The sparse task's flags for a reproduction of a few seconds: the CLI tests' run of every stage.
TINY = [
    "--problem.m", "13", "--problem.n", "27", "--problem.sparsity", "0.2",
    "--problem.test_per_snr", "30", "--problem.val_per_snr", "20",
    "--lista.num_steps", "5", "--classical.depths", "5,10", "--classical.L_grid", "3,5",
    "--classical.rho_grid", "0.05,0.1", "--classical.tune_samples", "50",
    "--policy.sketch_dim", "4",
    *[a for s in ("baseline", "stage1", "stage2", "stage3", "aevb")
      for a in (f"--{s}.iterations", "12", f"--{s}.batch_size", "32", f"--{s}.eval_every", "6", f"--{s}.checkpoint_every", "6")],
]


def shared_data(sub: str) -> Path:
    """Path under ../shared/data, or skip the test with the reason."""
    path = SHARED_DATA / sub
    if not path.exists():
        pytest.skip(f"needs {path} (the shared data folder is absent on this machine)")
    return path


def randomise(module: nn.Module, seed: int, scale: float = 1.0) -> None:
    """Draw every parameter of ``module`` from N(0, scale^2) under ``seed``: weights whose outputs (and stop
    decisions) differ from sample to sample."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * scale



def sketch_lista(samples: int):
    """A 7-step LISTA on a 13x27 problem with a random per-step sketch policy asked from step 2, in eval mode, and
    ``samples`` measurements drawn after it from the same generator: (stop model, (samples, 13) inputs)."""
    from learn2stop.core.model import StoppingModel
    from learn2stop.tasks.sparse.models import LISTA
    from learn2stop.tasks.sparse.policy import SparseStopPolicy

    g = torch.Generator().manual_seed(0)
    A = torch.randn(13, 27, generator=g) / 13 ** 0.5
    policy = SparseStopPolicy(A, 7, "sketch", 4, (8,))
    randomise(policy, 1)
    policy.min_step = 2
    return StoppingModel(LISTA(A, 7), policy).eval(), torch.randn(samples, 13, generator=g)

@pytest.fixture(scope="module")
def tiny_lista():
    """A 7-step LISTA on a 13x27 problem, a per-step sketch policy asked from step 2, a depth planner that plans
    at step 3 (both with random weights, in inference mode: the planner standardises its inputs by gathered
    statistics there, by the batch's own in training), and 41 measurements."""
    from learn2stop.tasks.sparse.models import LISTA
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner, SparseStopPolicy

    g = torch.Generator().manual_seed(0)
    A = torch.randn(13, 27, generator=g) / 13 ** 0.5
    policy = SparseStopPolicy(A, 7, "sketch", 4, (8,))
    randomise(policy, 1)
    policy.min_step = 2
    planner = SparseDepthPlanner(A, 7, hidden=(16,))
    randomise(planner, 2)
    planner.min_step = 3
    return LISTA(A, 7).eval(), policy.eval(), planner.eval(), torch.randn(41, 13, generator=g)


class ToyStepModel(nn.Module):
    """x_t = tanh(W_t x_{t-1} + U_t y): untied steps, readout = the state (like LISTA)."""

    def __init__(self, dim: int = 5, in_dim: int = 3, num_steps: int = 4):
        super().__init__()
        self.num_steps = num_steps
        self.dim = dim
        self.W = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(num_steps))
        self.U = nn.ModuleList(nn.Linear(in_dim, dim) for _ in range(num_steps))
        self.calls = 0

    def initial_state(self, inputs):
        return inputs.new_zeros(inputs.shape[0], self.dim)

    def step(self, t, state, inputs):
        self.calls += state.shape[0]  # rows computed, to check early exit really skips work
        return torch.tanh(self.W[t - 1](state) + self.U[t - 1](inputs))

    def readout(self, t, state, inputs):
        return state


class ToyPolicy(nn.Module):
    def __init__(self, dim: int = 5, in_dim: int = 3, num_steps: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + in_dim + 1, 8), nn.Tanh(), nn.Linear(8, 1))
        self.num_steps = num_steps

    def forward(self, inputs, output, t):
        tt = torch.full((inputs.shape[0], 1), t / self.num_steps, device=inputs.device)
        return self.net(torch.cat([inputs, output, tt], dim=1)).squeeze(1)


def mse_loss(output, target):
    return ((output - target) ** 2).sum(dim=1)


class ToyTask:
    """Regress a fixed random map of y, fresh data per batch; for trainer tests."""

    def __init__(self, in_dim: int = 3, dim: int = 5, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.M = torch.randn(in_dim, dim, generator=g) * 0.5
        self.in_dim = in_dim
        gv = torch.Generator().manual_seed(seed + 1)
        self._val = [self._make(64, gv)]

    def _make(self, n, g):
        y = torch.randn(n, self.in_dim, generator=g)
        return y, torch.tanh(y @ self.M)

    def loss_fn(self, output, target):
        return mse_loss(output, target)

    def sample_batch(self, batch_size, generator, device):
        y, x = self._make(batch_size, generator)
        return y.to(device), x.to(device)

    def validation_batches(self, device):
        return [(y.to(device), x.to(device)) for y, x in self._val]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Run a test on the CPU and, where one is present, on a CUDA device."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def toy():
    torch.manual_seed(0)
    return ToyStepModel(), ToyPolicy()


def oracle_kl(sm, task, beta: float) -> float:
    """Mean forward KL(q* || q_phi) on the task's validation batch; q_phi is both plans combined for a policy that
    plans twice (:func:`~learn2stop.core.distributions.replanned_log_q`)."""
    from learn2stop.core import log_oracle_distribution, log_stop_time_distribution
    from learn2stop.core.distributions import replanned_log_q

    (y, x), = task.validation_batches("cpu")
    with torch.no_grad():
        r = sm.unroll(y, x, task.loss_fn)
    log_q = log_stop_time_distribution(r.stop_logits)
    if r.replan_log_q is not None:
        log_q = replanned_log_q(log_q, r.replan_log_q, sm.policy.replan_step)
    log_p = log_oracle_distribution(r.losses, beta)
    return float((log_p.exp() * (log_p - log_q)).sum(1).mean())


class CountingPosterior(PosteriorPredictive):
    """MAML's posterior-mean estimate counting its forward calls (set ``calls`` to 0 first; assign the class to a
    policy's ``posterior.__class__``): for the tests that it is computed once per rollout."""

    calls = 0

    def forward(self, *args):
        type(self).calls += 1
        return super().forward(*args)

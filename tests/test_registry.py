"""One test over every registry entry: every task's every preset resolves, validates and builds its models
(presets whose data is not on this machine skip, naming it); every stop signal's offline trace equals its
online rule; every benchmark imports (test_benchmarks.py)."""
import math
from pathlib import Path

import pytest
import torch

from learn2stop.core.loop import run_with_early_exit, unroll
from learn2stop.core.rules import SignalRule, first_crossing, signal_trace
from learn2stop.core.signal_registry import SIGNALS, make_signal
from learn2stop.tasks.base import get_task, list_tasks
from learn2stop.utils.config_files import resolve

CASES = [(t, p) for t in list_tasks() for p in get_task(t).presets]


def _data_paths(cfg) -> list[str]:
    """The data folders or files a config reads (relative paths are relative to the repository)."""
    found = []
    for section in ("data", "problem"):
        d = getattr(cfg, section, None)
        for name in ("path", "root", "train_dir", "test_dir", "dataset_root"):
            v = getattr(d, name, None) if d is not None else None
            if isinstance(v, str) and v:
                found.append(v)
    return found


@pytest.mark.parametrize("task,preset", CASES, ids=[f"{t}-{p}" for t, p in CASES])
def test_every_preset_resolves_validates_and_builds(task, preset, monkeypatch):
    spec = get_task(task)
    cfg = resolve(spec.config_class, spec.presets[preset], None, {})
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    missing = [p for p in _data_paths(cfg) if not Path(p).exists()]
    if missing:
        pytest.skip(f"{task} {preset}: data not on this machine: {', '.join(missing)}")
    if spec.app is None:  # a task on its own pipeline (lm): its step-wise model is built from the config alone
        from learn2stop.tasks.lm.models import GPT, StepwiseGPT

        view = StepwiseGPT(GPT(cfg.model.gpt(65)))
        assert view.num_steps >= 2 and sum(p.numel() for p in view.parameters()) > 0
        return
    models = spec.app.build_models(cfg, "cpu")
    assert spec.app.stop_stage and models["stop"].num_steps >= 2 and models["stop"].policy is not None
    for sm in models.values():  # a baseline may be a single step (DnCNN without exits)
        assert sm.num_steps >= 1 and sum(p.numel() for p in sm.parameters()) > 0


class _Toy(torch.nn.Module):
    """A classifier-shaped step-wise model: logits that sharpen and drift step by step."""

    num_steps = 6

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(5, 5)

    def initial_state(self, x):
        return x

    def step(self, t, state, x):
        return torch.tanh(self.w(state)) + 0.3 * x * t

    def readout(self, t, state, x):
        return state * t


class _Policy(torch.nn.Module):
    min_step = 2

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def forward(self, x, out, t):
        return 3 * self.lin(torch.cat([out, out.new_full((out.shape[0], 1), t / 6)], 1)).squeeze(1)


class _Planner(torch.nn.Module):
    plan_step = 2

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)

    def forward(self, x, out, t):
        return 2 * self.lin(out)


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_every_signal_stops_online_where_its_offline_trace_says(name):
    torch.manual_seed(0)
    model, x = _Toy().eval(), torch.randn(40, 5)
    policy = _Planner() if name == "price" else _Policy()
    signal = lambda: make_signal(name, policy)  # noqa: E731
    with torch.no_grad():
        full = unroll(model, x, keep_outputs=True)
        trace = signal_trace(signal(), full.step_outputs, x)
        finite = trace[torch.isfinite(trace)]
        assert finite.numel(), name
        values = finite.unique()  # sorted
        for q in (0.2, 0.5, 0.8):
            # halfway between two scores: at a score itself (a quantile may be one) the price rule's plan has two
            # maximisers, the step of that score and a later one, and rounding, which differs between CPUs, picks
            i = int(q * (values.numel() - 1))
            thr = float((values[i] + values[i + 1]) / 2)
            online = run_with_early_exit(model, x, SignalRule(signal(), thr)).stop_times
            assert torch.equal(online, first_crossing(trace, thr)), (name, q)
        assert torch.equal(run_with_early_exit(model, x, SignalRule(signal(), math.inf)).stop_times,
                           torch.full((40,), 6))

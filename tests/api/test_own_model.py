"""A model the library has never seen, end to end through the public API only (``from learn2stop import ...``):
train, calibrate, frontier, save, load and export an unrolled least-squares solver defined here."""
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from learn2stop import (FixedDepth, StageConfig, StepMLPPolicy, StoppingModel, StoppingWarning, calibrate, export_model, frontier,
                        output_signals, train)

D, M, T = 8, 12, 10
A = torch.randn(M, D, generator=torch.Generator().manual_seed(3)) / math.sqrt(M)
L = float(torch.linalg.matrix_norm(A, 2)) ** 2  # the Lipschitz constant of the gradient


class UnrolledGD(nn.Module):
    """Gradient descent on ||A x - y||^2 unrolled for T steps with learned step sizes a_t in (0, 2/L): every step
    contracts the error, so no training can make a later step worse than an earlier one."""

    def __init__(self):
        super().__init__()
        self.num_steps = T
        self.register_buffer("A", A.clone())
        self.w = nn.Parameter(torch.zeros(T))

    def initial_state(self, y):
        return y.new_zeros(y.shape[0], D)

    def step(self, t, x, y):
        a = 2 / L * torch.sigmoid(self.w[t - 1])
        return x - a * (x @ self.A.T - y) @ self.A  # (B, D)

    def readout(self, t, x, y):
        return x


def sample(n, generator, device):
    """Problems whose solutions span two orders of magnitude: small ones are solved (in MSE) in few steps."""
    scale = torch.exp(torch.empty(n, 1).uniform_(-3, 1, generator=generator))
    x = scale * torch.randn(n, D, generator=generator)
    return (x @ A.T).to(device), x.to(device)


def mse(out, x):
    return (out - x).pow(2).mean(1)


def build():
    return StoppingModel(UnrolledGD(), StepMLPPolicy(T, 2, features=output_signals))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    sm = build()
    run = tmp_path_factory.mktemp("own")
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoppingWarning)  # a healthy run: no guard-rail fires
        summaries = train(sm, sample, mse, {
            "stage1": StageConfig(objective="stage1", beta=0.1, iterations=100, batch_size=64, lr=3e-2, eval_every=50),
            "stage2": StageConfig(objective="stage2", beta=0.1, iterations=200, batch_size=64, lr=1e-2, eval_every=50)},
            run_dir=run / "run")
        g = torch.Generator().manual_seed(11)
        val, test = [sample(512, g, None)], [sample(1024, g, None)]
        cal = calibrate(sm, val, mse, budget=0.5, test_data=test)
    return sm, summaries, val, test, cal, run


def test_training_runs_every_stage_and_calibration_meets_the_budget(trained):
    sm, summaries, val, test, cal, _ = trained
    assert list(summaries) == ["stage1", "stage2"] and all(s["iterations"] > 0 for s in summaries.values())
    assert cal.rule == "quantile" and cal.calibration["mean_cost"] <= 0.5 + 1e-6
    assert sm.calibration is cal  # attached: what sm(x) uses
    y = test[0][0]
    assert torch.equal(sm(y).stop_times, sm(y, rule=cal.make_rule(sm.policy)).stop_times)
    assert abs(cal.test["mean_steps"] - float(sm(y).stop_times.float().mean())) < 1e-6


def test_the_trained_policy_beats_a_fixed_depth_at_equal_mean_steps(trained):
    sm, _, val, test, cal, _ = trained
    f = frontier(sm, test, mse, calibration_data=val, batch_size=None)
    fixed = {p["depth"]: p["metric"] for p in f["curves"]["fixed_depth"]}
    steps = cal.test["mean_steps"]
    lo = math.floor(steps)
    at_equal_steps = fixed[lo] + (steps - lo) * (fixed[lo + 1] - fixed[lo])  # fixed depth interpolated to its steps
    assert cal.test["metric"] < 0.95 * at_equal_steps, (cal.test, fixed)
    assert f["summary"]["gain_over_fixed_depth_best"] > 0
    oracle = min(p["metric"] for p in f["curves"]["oracle"] if p["mean_steps"] <= steps)
    assert oracle <= cal.test["metric"]  # the oracle (it needs the target) bounds every rule
    assert "fixed_depth" in str(f) and "policy" in str(f)  # prints as the frontier's tables


def test_a_saved_and_loaded_model_stops_where_the_original_does(trained, tmp_path):
    sm, _, _, test, cal, _ = trained
    folder = sm.save_pretrained(tmp_path / "mine")
    loaded = StoppingModel.from_pretrained(folder, model=UnrolledGD(), policy=StepMLPPolicy(T, 2, features=output_signals))
    assert loaded.calibration.to_dict() == cal.to_dict()
    y = test[0][0]
    a, b = sm(y), loaded(y)
    assert torch.equal(a.stop_times, b.stop_times) and torch.equal(a.outputs, b.outputs)
    assert a.mean_depth < T  # it really stops early


def test_the_exported_runtime_stops_where_torch_does(trained, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from learn2stop.runtime import load

    sm, _, _, test, _, _ = trained
    y = test[0][0][:200]
    out = export_model(sm, y[:4], tmp_path / "exported")
    r = load(out).run(y.numpy())
    ref = sm(y)
    np.testing.assert_array_equal(r.stop_times, ref.stop_times.numpy())
    np.testing.assert_allclose(r.outputs, ref.outputs.numpy(), rtol=1e-4, atol=1e-5)


def test_inference_runs_without_autograd_unless_grad_is_asked(trained):
    sm, _, _, test, _, _ = trained
    y = test[0][0][:16]
    assert sm(y).outputs.is_inference()
    r = sm(y, grad=True)
    assert not r.outputs.is_inference() and r.outputs.requires_grad
    r.outputs.sum().backward()
    assert sm.model.w.grad is not None
    sm.zero_grad(set_to_none=True)


def test_the_policy_reads_the_step(trained):
    sm, _, _, test, _, _ = trained
    y = test[0][0][:32]
    x = sm(y, FixedDepth(3)).outputs
    assert not torch.allclose(sm.policy(y, x, 3), sm.policy(y, x, 8))  # same features, another step: another logit

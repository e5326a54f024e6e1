"""The public entry points refuse bad input once, at the boundary, with one message naming the problem: inputs
(NaN, batch-first, dtype) of ``unroll``, ``run_with_early_exit`` and ``StoppingModel``; a policy's NaN stop logits
(named by step, in the loop's own host sync); class-logit rules on an output without classes; risk losses outside
the declared ``loss_range``."""
import math

import pytest
import torch
from torch import nn

from learn2stop.core import (ConfidenceSignal, EntropySignal, FixedDepth, PatienceSignal, PolicyRule, SignalRule,
                             StoppingModel, calibrate_risk, run_with_early_exit, signal_trace, unroll)
from learn2stop.core.inference import InferenceConfig


class Decay(nn.Module):
    """x_t = a * x_{t-1} + y with a float32 parameter a: float64 inputs would silently promote every state."""

    num_steps = 3

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))

    def initial_state(self, inputs):
        return torch.zeros_like(inputs)

    def step(self, t, state, inputs):
        return self.a * state + inputs

    def readout(self, t, state, inputs):
        return state


class NaNAtStep(nn.Module):
    """A policy whose stop logits are NaN for the first sample at step ``bad`` (finite and low elsewhere)."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad = bad

    def forward(self, inputs, output, t):
        logits = torch.full((inputs.shape[0],), -3.0)
        if t == self.bad:
            logits[0] = math.nan
        return logits


@pytest.fixture
def nan_input():
    y = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    y[2, 1] = math.nan
    return y


def test_unroll_and_early_exit_refuse_nan_inputs(toy, nan_input):
    model, _ = toy
    with pytest.raises(ValueError, match="NaN or inf values in 1 sample"):
        unroll(model, nan_input)
    with pytest.raises(ValueError, match="NaN or inf values in 1 sample"):
        run_with_early_exit(model, nan_input, FixedDepth(2))
    with pytest.raises(ValueError, match="NaN or inf values in 1 sample"):
        run_with_early_exit(model, nan_input, ToyRule(), compact_every=2)  # device mode too


class ToyRule:
    """A per-step rule that never stops (a callable on a StepView)."""

    def __call__(self, view):
        return torch.zeros(view.index.numel(), dtype=torch.bool)


def test_entry_points_refuse_inputs_without_a_batch_dimension(toy):
    model, _ = toy
    for call in (lambda x: unroll(model, x), lambda x: run_with_early_exit(model, x, FixedDepth())):
        with pytest.raises(ValueError, match=r"batch-first, shape \(B, \.\.\.\); got shape \(3,\)"):
            call(torch.zeros(3))


def test_entry_points_refuse_inputs_of_another_dtype_than_the_model():
    model, y = Decay(), torch.ones(2, 3, dtype=torch.float64)
    assert unroll(Decay(), y.float()).outputs.dtype == torch.float32
    for call in (lambda: unroll(model, y), lambda: run_with_early_exit(model, y, FixedDepth()),
                 lambda: StoppingModel(model)(y)):
        with pytest.raises(ValueError, match=r"dtype torch.float64 do not match Decay's parameters \(dtype torch.float32\)"):
            call()


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("make_rule", [lambda p: PolicyRule(p, threshold=0.5),
                                       lambda p: PolicyRule(p, mode="sample", generator=torch.Generator()),
                                       lambda p: InferenceConfig(rule="quantile", param=0.5).make_rule(p)],
                         ids=["threshold", "sample", "quantile"])
def test_a_policy_returning_nan_stop_logits_is_an_error_naming_the_step(toy, batch, make_rule):
    model, _ = toy
    y = torch.randn(batch, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=f"NaN stop logits at step 2 for 1 of {batch} running sample"):
        run_with_early_exit(model, y, make_rule(NaNAtStep(bad=2)))
    assert (run_with_early_exit(model, y, make_rule(NaNAtStep(bad=99))).stop_times == 4).all()  # finite: no error


def test_device_mode_refuses_nan_stop_logits_at_its_compaction(toy):
    model, _ = toy
    y = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    for every in (1, 2, 5):  # a compaction after the NaN step, or none before the last step
        with pytest.raises(ValueError, match="NaN stop logits at step 2"):
            run_with_early_exit(model, y, PolicyRule(NaNAtStep(bad=2)), compact_every=every)


class Image(nn.Module):
    """A step-wise model whose output is an image (B, 1, 4, 4), or one number per sample (``scalar``: (B, 1))."""

    num_steps = 3

    def __init__(self, scalar: bool = False):
        super().__init__()
        self.scalar = scalar

    def initial_state(self, inputs):
        return inputs

    def step(self, t, state, inputs):
        return state * 0.5

    def readout(self, t, state, inputs):
        return state.flatten(1)[:, :1] if self.scalar else state


@pytest.mark.parametrize("signal", [ConfidenceSignal, EntropySignal, PatienceSignal])
@pytest.mark.parametrize("scalar", [False, True], ids=["image", "one-column"])
def test_class_logit_rules_refuse_an_output_without_classes(signal, scalar):
    model, x = Image(scalar), torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    shape = r"\(3, 1\)" if scalar else r"\(3, 1, 4, 4\)"
    with pytest.raises(ValueError, match=rf"the '{signal.name}' rule reads a classifier's \(batch, classes\) logits.*"
                                         rf"shape {shape}"):
        run_with_early_exit(model, x, SignalRule(signal(), 0.5))
    outputs = unroll(model, x, keep_outputs=True).step_outputs
    with pytest.raises(ValueError, match=r"\(batch, classes\) logits"):
        signal_trace(signal(), outputs, x)


def test_class_logit_rules_still_read_logits():
    logits = torch.randn(6, 3, 10, generator=torch.Generator().manual_seed(4))  # (B, T, classes)
    outputs = [logits[:, t] for t in range(3)]
    for signal in (ConfidenceSignal(), EntropySignal(), PatienceSignal()):
        assert signal_trace(signal, outputs, logits).shape == (6, 2)


def test_calibrate_risk_refuses_losses_outside_the_declared_range():
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(20, 3, generator=g)
    losses = torch.rand(20, 4, generator=g) * 0.5
    losses[:, -1] = 0
    cal = calibrate_risk(scores, losses, 0.2, 0.1, "threshold", loss_range=(0.0, 1.0))
    assert math.isfinite(cal.calibration["p_value"])
    losses[7, 1] = 1.5
    with pytest.raises(ValueError, match=r"a loss of 1.5 lies outside the declared loss_range \(0, 1\)"):
        calibrate_risk(scores, losses, 0.2, 0.1, "threshold", loss_range=(0.0, 1.0))
    losses[7, 1] = -0.25
    with pytest.raises(ValueError, match=r"a loss of -0.25 lies outside the declared loss_range \(0, 1\)"):
        calibrate_risk(scores, losses, 0.2, 0.1, "threshold", loss_range=(0.0, 1.0))
    calibrate_risk(scores, losses, 0.2, 0.1, "threshold")  # no declared range: the CLT p-value takes any loss



def test_patience_reads_integer_votes_and_the_softmax_rules_refuse_them():
    votes = torch.nn.functional.one_hot(torch.tensor([[0, 1, 1], [2, 2, 2]]), 4)  # (B, T, classes) int64
    outputs = [votes[:, t] for t in range(3)]
    assert signal_trace(PatienceSignal(), outputs, votes).tolist() == [[0, 0], [0, 1]]
    for signal in (ConfidenceSignal(), EntropySignal()):
        with pytest.raises(ValueError, match=r"torch.int64 tensor of shape \(2, 4\)"):
            signal_trace(signal, outputs, votes)


class ToyClassifier(nn.Module):
    """A step-wise classifier that declares nothing of its outputs: (B, 4) logits that sharpen with t."""

    num_steps = 4

    def initial_state(self, inputs):
        return inputs

    def step(self, t, state, inputs):
        return state * 2.0

    def readout(self, t, state, inputs):
        return state


@pytest.mark.parametrize("signal", [ConfidenceSignal, EntropySignal, PatienceSignal])
def test_class_logit_rules_refuse_a_model_that_declares_no_logits(signal):
    """A (B, n) sparse code looks like logits by shape; LISTA declares it is not, and the rule refuses it before
    the first step, in the loop and in the streaming runner, naming the rule and the model."""
    from learn2stop.core.streaming import StreamingRunner
    from learn2stop.tasks.sparse.models import LISTA

    g = torch.Generator().manual_seed(7)
    A = torch.randn(5, 9, generator=g) / 5 ** 0.5
    model, y = LISTA(A, 4), torch.randn(3, 5, generator=g)
    message = rf"the '{signal.name}' rule reads a classifier's class logits, and the model LISTA declares"
    with pytest.raises(ValueError, match=message):
        run_with_early_exit(model, y, SignalRule(signal(), 0.5))
    with pytest.raises(ValueError, match=message):
        run_with_early_exit(model, y, SignalRule(signal(), 0.5), compact_every=2)
    with pytest.raises(ValueError, match=message):
        StreamingRunner(model, SignalRule(signal(), 0.5))
    run_with_early_exit(model, y, SignalRule(signal(key=lambda o: o[:, :2]), 0.5))  # a key makes its own classes


@pytest.mark.parametrize("signal", [ConfidenceSignal, EntropySignal, PatienceSignal])
def test_class_logit_rules_accept_an_exit_network_and_an_undeclared_classifier(signal):
    from learn2stop.core.exits import attach_exits

    torch.manual_seed(8)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    model = attach_exits(net, ["1"], example_input=torch.zeros(1, 3, 6, 6)).eval()
    assert model.outputs_are_logits is True
    with torch.no_grad():
        r = run_with_early_exit(model, torch.randn(4, 3, 6, 6), SignalRule(signal(), 0.5))
    assert r.outputs.shape == (4, 5)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(9))
    assert run_with_early_exit(ToyClassifier(), x, SignalRule(signal(), 0.5)).outputs.shape == (4, 4)


def test_the_library_regressors_declare_their_outputs_are_not_logits():
    from learn2stop.core.protocols import member
    from learn2stop.tasks.denoise.models import DeepSupervisedDnCNN
    from learn2stop.tasks.maml.learner import MLP, MAMLModel
    from learn2stop.tasks.sparse.models import FISTA, ISTA

    A = torch.randn(3, 5, generator=torch.Generator().manual_seed(10))
    for model in (ISTA(A, 3, 1.0, 0.1), FISTA(A, 3, 1.0, 0.1), DeepSupervisedDnCNN(depth=5, channels=4),
                  MAMLModel(MLP(hidden=4), 2, 0.1, loss="mse")):
        assert member(model, "outputs_are_logits") is False, type(model).__name__
    assert member(MAMLModel(MLP(out_dim=3, hidden=4), 2, 0.1), "outputs_are_logits") is None  # a dict: by shape
    assert member(object(), "outputs_are_logits") is None

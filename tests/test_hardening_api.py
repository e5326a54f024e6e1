"""Bad input through the Python API and the CLI: each case fails with a message that names the problem."""
import numpy as np
import pytest
import torch
from torch import nn

from learn2stop.cli import main
from learn2stop.core import (FixedDepth, InferenceConfig, MethodConfig, PolicyRule, SignalRule, StageConfig,
                             StagedTrainer, StoppingModel, ToleranceRule, QuantileSignal, validation_scores)
from learn2stop.tasks.sparse import LISTA, ProblemConfig, make_matrix
from learn2stop.utils.config import ConfigError


class Pol(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, 1)

    def forward(self, y, x, t):
        return self.lin(x).squeeze(1)


@pytest.fixture(scope="module")
def sm():
    A = make_matrix(ProblemConfig(m=7, n=11))
    return StoppingModel(LISTA(A, 4), Pol(11)).eval()


@pytest.mark.parametrize("inputs, error, message", [
    (np.zeros((3, 7), dtype=np.float32), TypeError, "numpy.ndarray.*torch.as_tensor"),
    ([[0.0] * 7] * 3, TypeError, "list.*torch.as_tensor"),
    (3.0, TypeError, "must be a torch tensor"),
    (torch.zeros(3, 5), ValueError, "measurements have 5 entries but A has 7 rows"),  # LISTA's own check
    (torch.zeros(3, 7, dtype=torch.float64), ValueError, "dtype torch.float64"),
    (torch.tensor([[float("nan")] * 7, [0.0] * 7]), ValueError, "NaN or inf values in 1 sample"),
    (torch.tensor([[float("inf")] * 7] * 2), ValueError, "NaN or inf values in 2 sample"),
    (torch.zeros(0, 7), ValueError, "empty batch"),
])
def test_stopping_model_refuses_bad_inputs_in_the_users_terms(sm, inputs, error, message):
    for call in (lambda: sm(inputs), lambda: sm.unroll(inputs)):
        with pytest.raises(error, match=message):
            with torch.no_grad():
                call()


@pytest.mark.parametrize("make, message", [
    (lambda p: PolicyRule(p, threshold=float("nan")), "threshold"),
    (lambda p: PolicyRule(p, threshold=True), "threshold"),
    (lambda p: PolicyRule(p, mode="greedy"), "mode"),
    (lambda p: ToleranceRule(float("nan")), "tol"),
    (lambda p: ToleranceRule(-1.0), "tol"),
    (lambda p: ToleranceRule(float("inf")), "tol"),
    (lambda p: FixedDepth(True), "depth"),
    (lambda p: FixedDepth(0), "depth"),
    (lambda p: FixedDepth(2.5), "depth"),
    (lambda p: SignalRule(QuantileSignal(p), float("nan")), "threshold"),
])
def test_stop_rules_refuse_bad_parameters(sm, make, message):
    with pytest.raises(ValueError, match=message):
        make(sm.policy)


@pytest.mark.parametrize("kwargs, field", [
    ({"iterations": True}, "iterations"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"lr": float("nan")}, "lr"),
    ({"lr": float("inf")}, "lr"),
    ({"beta": 0.0}, "beta"),
    ({"price": -1.0}, "price"),
    ({"lr_decay_at": 0.5}, "lr_decay_at"),
    ({"eval_every": False}, "eval_every"),
    ({"objective": "stage4"}, "objective"),
    ({"variant": "magic"}, "variant"),
    ({"select": "best"}, "select"),
    ({"step_weights": (1.0, float("nan"))}, "step_weights"),
])
def test_stage_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        StageConfig(**{"objective": "stage1", **kwargs})


@pytest.mark.parametrize("kwargs, field", [
    ({"beta": float("nan")}, "method.beta"), ({"prior": "poisson"}, "method.prior"), ({"price": True}, "method.price"),
])
def test_method_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        MethodConfig(**kwargs)


def test_inference_rule_that_needs_a_policy_says_so(sm):
    with pytest.raises(ValueError, match="needs a stopping policy"):
        InferenceConfig(rule="quantile").make_rule(None)


class _Task:
    def __init__(self, val):
        self.val = val

    def loss_fn(self, out, tgt):
        return (out - tgt).pow(2).sum(1)

    def sample_batch(self, n, gen, device):
        y = torch.randn(n, 7, generator=gen)
        return y, torch.randn(n, 11, generator=gen)

    def validation_batches(self, device):
        return self.val


def test_an_empty_or_nan_validation_set_is_an_error_not_a_silent_no_selection(sm, tmp_path):
    with pytest.raises(ValueError, match="validation set is empty"):
        validation_scores(sm, [], _Task([]).loss_fn)
    nan_target = [(torch.randn(4, 7), torch.full((4, 11), float("nan")))]
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        validation_scores(sm, nan_target, _Task([]).loss_fn)
    trainer = StagedTrainer(sm, _Task([]), tmp_path, progress=False)
    with pytest.raises(ValueError, match="validation set is empty"):
        trainer.fit("stage2", StageConfig(objective="stage2", iterations=2, eval_every=1, batch_size=4))


@pytest.mark.parametrize("args, message", [
    (["sparse", "calibrate", "--budget", "0"], "--budget"),
    (["sparse", "calibrate", "--budget", "1.01"], "--budget"),
    (["sparse", "calibrate", "--epsilon", "-0.1"], "--epsilon"),
    (["sparse", "calibrate", "--epsilon", "0.1", "--delta", "1"], "--delta"),
    (["sparse", "calibrate", "--epsilon", "0.1", "--delta", "0"], "--delta"),
    (["sparse", "calibrate"], "exactly one target"),
    (["sparse", "calibrate", "--budget", "0.5", "--epsilon", "0.1"], "exactly one target"),
    (["sparse", "frontier"], "run the 'train' command"),
    (["sparse", "evaluate"], "does not exist"),
    (["sparse", "train", "--inference.rule", "quantile", "--inference.param", "2"], "inference.param"),
    (["sparse", "train", "--inference.rule", "magic"], "inference.rule"),
    (["sparse", "train", "--method.price", "nan"], "method.price"),
    (["sparse", "train", "--method.beta", "-1"], "method.beta"),
    (["sparse", "train", "--lista.num_steps", "1"], "lista.num_steps"),
])
def test_cli_bad_input_exits_2_with_the_flag_named(args, message, tmp_path, capsys):
    run = tmp_path / "run"
    if args[1] == "calibrate" and "exactly one target" in message:
        run.mkdir()
    try:
        rc = main([*args, "--run-dir", str(run), "--no-progress"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if args[1] in ("frontier", "evaluate"):
        assert not run.exists() or not any(run.iterdir())  # a refused reader creates nothing


def test_the_run_directory_is_a_file_or_under_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    for run in (f, f / "sub"):
        assert main(["sparse", "train", "--run-dir", str(run), "--no-progress"]) == 2
        assert str(f) in capsys.readouterr().err


def test_a_feature_size_mismatch_is_reported_at_the_first_step_not_deep_in_a_matmul():
    class Net(nn.Module):
        num_steps = 3

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def initial_state(self, y):
            return y

        def step(self, t, x, y):
            return torch.tanh(self.lin(x))

        def readout(self, t, x, y):
            return x

    with pytest.raises(ValueError, match=r"Net cannot take inputs of shape \(3, 4\) and dtype torch.float32"):
        StoppingModel(Net())(torch.zeros(3, 4))


@pytest.mark.parametrize("flags, field", [
    (["--problem.m", "200000", "--problem.n", "400000"], "problem: needs about"),
    (["--classical.depths", ""], "depths"),
    (["--classical.L_grid", ""], "L_grid"),
])
def test_sparse_configs_that_would_fail_late_are_refused_first(flags, field, tmp_path, capsys):
    try:
        rc = main(["sparse", "train", "--run-dir", str(tmp_path / "r"), "--no-progress", *flags])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and field in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_refused_command_leaves_the_runs_record_untouched(tmp_path, capsys):
    from tests.test_cli import TINY

    run = tmp_path / "run"
    flags = [*TINY, "--run_aevb", "false", "--run_stage3", "false", "--no-progress"]
    assert main(["sparse", "train", "--run-dir", str(run), *flags]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["sparse", "train", "--run-dir", str(run), *flags, "--problem.matrix_seed", "7"]) == 2
    assert "problem.matrix_seed" in capsys.readouterr().err
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert {k: v for k, v in before.items() if k != ".lock"} == after

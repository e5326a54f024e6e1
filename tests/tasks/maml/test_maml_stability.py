"""Training that cannot blow up: a bounded inner loop, stage losses that stay finite when one step's loss
is huge, and a stage that does go non-finite fails naming the stage, the iteration and the quantity,
keeping its last good checkpoint."""
import json
import math

import pytest
import torch

from conftest import ToyPolicy, ToyStepModel, ToyTask
from learn2stop.core import StageConfig, StagedTrainer, StoppingModel
from learn2stop.core import losses as L
from learn2stop.core.distributions import log_oracle_distribution
from learn2stop.core.objectives import NonFiniteError, step_ranges
from learn2stop.tasks.maml.learner import MLP, MAMLModel, clip_task_gradients
from learn2stop.tasks.maml.policy import MAMLStopPolicy
from learn2stop.tasks.maml.samplers import SinusoidSampler
from learn2stop.tasks.maml.data import MetaLearningTask, fixed_batches
from learn2stop.utils.checkpoint import load_checkpoint

# per-step losses (B=2, T=5) with diverged steps: -loss / beta overflows float32 at beta 0.01
HUGE = torch.tensor([[0.3, 1e30, 3e38, 2.0, 0.5], [1e20, 1e25, 7.0, 3e38, 1e10]])


def test_stage_losses_stay_finite_when_one_step_loss_is_huge():
    beta = 0.01
    losses = HUGE.clone().requires_grad_(True)
    logits = torch.linspace(-2, 2, 8).view(2, 4).requires_grad_(True)
    log_q_star = log_oracle_distribution(losses, beta)
    assert torch.isfinite(log_q_star).all()
    torch.testing.assert_close(log_q_star.exp().sum(1), torch.ones(2))
    assert log_q_star.exp()[0, 0] > 0.99 and log_q_star.exp()[1, 2] > 0.99  # the mass sits on the best step
    values = {
        "stage1 expected": L.stage1_expected_loss(losses, beta, reduction="none"),
        "stage1 marginal": L.stage1_marginal_loss(losses, beta, reduction="none"),
        "stage1 sampled": L.stage1_sampled_loss(losses, beta, generator=torch.Generator().manual_seed(0), reduction="none"),
        "stage2 forward_kl": L.stage2_forward_kl(logits, losses, beta, reduction="none"),
        "stage2 reverse_kl": L.stage2_reverse_kl(logits, losses, beta, reduction="none"),
        "stage2 map": L.stage2_map_loss(logits, losses, reduction="none"),
        "beta_vae": L.beta_vae_loss(logits, losses, beta, reduction="none"),
    }
    for name, v in values.items():
        assert torch.isfinite(v).all(), name
        g = torch.autograd.grad(v.sum(), [losses, logits], allow_unused=True)
        assert all(x is None or torch.isfinite(x).all() for x in g), name
    best = torch.tensor([0.3, 7.0])
    torch.testing.assert_close(values["stage1 expected"], best, atol=1e-4, rtol=0)
    # -beta log (1/T) sum_t exp(-l_t / beta) = min l + beta log T (+ exp(-20) from step 5 of the first row)
    torch.testing.assert_close(values["stage1 marginal"], best + beta * math.log(5), atol=1e-4, rtol=0)
    # the reverse KL charges a step the oracle rules out a bounded, large price, not inf
    assert (values["stage2 reverse_kl"] > 100).all()


def test_inner_gradient_clip_bounds_each_tasks_step_and_keeps_small_ones():
    g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), "b": torch.tensor([[0.0], [0.0], [0.0]])}
    out = clip_task_gradients(g, 1.0)
    torch.testing.assert_close(out["w"], torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    zero = torch.zeros(1, 3, requires_grad=True)  # second order differentiates through the scaling
    (d,) = torch.autograd.grad(clip_task_gradients({"w": zero}, 1.0)["w"].sum(), zero)
    assert torch.isfinite(d).all()


def unstable_maml(clip: float, T: int = 6):
    """A sinusoid MAML-stop whose inner lr (3.0) makes the unbounded inner loop overflow within T steps."""
    torch.manual_seed(0)
    model = MAMLModel(MLP(hidden=8), T, inner_lr=3.0, loss="mse", policy_features=True, inner_grad_clip=clip)
    sm = StoppingModel(model, MAMLStopPolicy(8, 1, T, classification=False, dim=8, hidden=16))
    sampler = SinusoidSampler(1, 5, 5, noise=0.5)
    val = fixed_batches(sampler, None, 6, torch.Generator().manual_seed(1), 6)
    return sm, MetaLearningTask(model, sampler, None, None, val_batches=val)


def stage(objective, variant, **kw):
    return StageConfig(objective=objective, variant=variant, iterations=4, batch_size=4, eval_every=2,
                       checkpoint_every=2, beta=0.01, lr=1e-3, recompute=variant == "sampled", **kw)


def test_a_deliberately_unstable_inner_loop_trains_through_stage1_and_stage2_without_a_non_finite_loss(tmp_path):
    sm, task = unstable_maml(clip=10.0)
    trainer = StagedTrainer(sm, task, tmp_path, progress=False)
    trainer.fit("stage1", stage("stage1", "sampled"))
    trainer.fit("stage2", stage("stage2", "reverse_kl"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == ["stage1"] * 2 + ["stage2"] * 2
    for r in records:
        for key in ("train_loss", "loss_last", "val_last", "val_oracle", "val_policy"):
            assert r[key] is not None and math.isfinite(r[key]), (r["stage"], key, r[key])
    assert max(r["loss_last"] for r in records) > 1e4  # the late inner steps are far off, yet finite


def test_the_unbounded_inner_loop_fails_naming_stage_iteration_and_steps(tmp_path):
    sm, task = unstable_maml(clip=0.0)
    trainer = StagedTrainer(sm, task, tmp_path, progress=False)
    with pytest.raises(NonFiniteError, match=r"stage 'stage1': the loss is not finite \(per-step losses at steps "
                                             r"[0-9, -]+ non-finite .* at iteration 1; no checkpoint of this stage"):
        trainer.fit("stage1", stage("stage1", "sampled"))


class NaNFromIteration(ToyTask):
    """The toy task whose targets turn NaN from the ``bad``-th training batch on."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad, self.calls = bad, 0

    def sample_batch(self, n, gen, device):
        y, x = super().sample_batch(n, gen, device)
        self.calls += 1
        return y, (x * float("nan") if self.calls >= self.bad else x)


def test_a_stage_that_goes_non_finite_names_it_and_keeps_its_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    sm = StoppingModel(ToyStepModel(), ToyPolicy())
    trainer = StagedTrainer(sm, NaNFromIteration(bad=6), tmp_path, progress=False)
    cfg = StageConfig(objective="stage1", variant="expected", iterations=10, batch_size=8, eval_every=2,
                      checkpoint_every=2, beta=0.5)
    with pytest.raises(NonFiniteError) as err:
        trainer.fit("stage1", cfg)
    assert str(err.value).startswith(
        "stage 'stage1': the loss is not finite (per-step losses at steps 1-4 non-finite (NaN) in 8 of 8 samples) "
        "at iteration 6; the last good checkpoint checkpoints/stage1.pt (iteration 4) is kept")
    assert isinstance(err.value, ValueError)  # the CLI prints it as a one-line error
    ck = load_checkpoint(tmp_path / "checkpoints" / "stage1.pt")
    assert ck["iteration"] == 4 and not ck["completed"]
    assert all(torch.isfinite(v).all() for v in ck["weights"].values())
    iterations = [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert iterations == [2, 4]


def test_step_ranges():
    assert step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert step_ranges([4]) == "4"


def test_a_diverging_cli_stage_names_itself_in_a_one_line_error(tmp_path, capsys):
    from learn2stop.cli import main

    tiny = ["--maml.iterations", "4", "--maml.batch_size", "3", "--maml.eval_every", "2", "--maml.checkpoint_every", "2",
            "--eval.tasks", "6", "--eval.val_tasks", "6", "--eval.chunk", "6", "--no-progress"]
    assert main(["maml", "train", "--preset", "quick", "--maml.lr", "1e12", "--run-dir", str(tmp_path / "r")] + tiny) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("learn2stop maml train: error: stage 'baseline': the loss is not finite (per-step losses at "
                          "step 1 non-finite") and "lower the stage's learning rate (lr 1e+12)" in err

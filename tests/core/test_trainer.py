"""Stage objectives and the trainer: gradients reach the right parameters, training improves,
checkpoints resume exactly and fail clearly."""
import copy

import pytest
import torch

from learn2stop.core import StageConfig, StagedTrainer, StageObjective, StoppingModel
from learn2stop.utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from learn2stop.utils.config import ConfigError

from conftest import ToyPolicy, ToyStepModel, ToyTask


def make_sm():
    torch.manual_seed(0)
    return StoppingModel(ToyStepModel(), ToyPolicy())


def grads_after(objective, variant="", **kw):
    sm = make_sm()
    task = ToyTask()
    cfg = StageConfig(objective=objective, variant=variant, beta=0.5, **kw)
    y, x = task.sample_batch(16, torch.Generator().manual_seed(0), "cpu")
    loss, metrics = StageObjective(sm, task.loss_fn, cfg)(y, x, torch.Generator().manual_seed(1))
    loss.backward()
    has = lambda m: any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    return has(sm.model), has(sm.policy), metrics


@pytest.mark.parametrize("objective, variant, model_grad, policy_grad", [
    ("deep_supervision", "", True, False),
    ("stage1", "expected", True, False),
    ("stage1", "marginal", True, False),
    ("stage1", "sampled", True, False),
    ("stage2", "forward_kl", False, True),
    ("stage2", "map", False, True),
    ("stage2", "reverse_kl", False, True),
    ("stage3", "", True, True),
    ("aevb", "", True, True),
])
def test_gradients_reach_the_right_parameters(objective, variant, model_grad, policy_grad):
    m, p, metrics = grads_after(objective, variant)
    assert (m, p) == (model_grad, policy_grad)
    assert metrics["loss_oracle"] <= metrics["loss_last"]


def test_recomputed_sampled_stage1_equals_plain_sampled():
    """The memory-saving path (no-grad pass, then recompute to t ~ q*) gives the same loss and gradient."""
    task = ToyTask()
    y, x = task.sample_batch(32, torch.Generator().manual_seed(0), "cpu")
    grads = []
    for recompute in (False, True):
        sm = make_sm()
        cfg = StageConfig(objective="stage1", variant="sampled", beta=0.5, recompute=recompute)
        loss, _ = StageObjective(sm, task.loss_fn, cfg)(y, x, torch.Generator().manual_seed(5))
        loss.backward()
        grads.append((loss.detach(), [q.grad.clone() for q in sm.model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)


def test_stage2_leaves_theta_untouched(tmp_path):
    sm = make_sm()
    before = copy.deepcopy(sm.model.state_dict())
    StagedTrainer(sm, ToyTask(), tmp_path, progress=False).fit(
        "stage2", StageConfig(objective="stage2", iterations=5, batch_size=8, eval_every=5))
    for k, v in sm.model.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_flush_denormals_zeroes_subnormal_values_alone_and_counts_them():
    from learn2stop.core.trainer import flush_denormals_

    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1e-40, -1e-42, 1.0], [0.0, 1e-30, -torch.finfo(torch.float32).tiny]]))
    m.register_buffer("wide", torch.tensor([1e-310, 1e-300], dtype=torch.float64))
    m.register_buffer("count", torch.tensor([0, 1, 2]))  # not floating point: left alone
    assert flush_denormals_(m) == 3
    assert m.weight.tolist() == [[0.0, 0.0, 1.0], [0.0, pytest.approx(1e-30), -torch.finfo(torch.float32).tiny]]
    assert m.wide.tolist() == [0.0, 1e-300] and m.count.tolist() == [0, 1, 2]
    assert flush_denormals_(m) == 0


def _subnormals(tensors) -> int:
    return sum(int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum()) for t in tensors if t.is_floating_point())


def test_a_finished_stage_and_a_loaded_checkpoint_hold_no_subnormal_weight(tmp_path):
    """Subnormal weights (what weight decay leaves in dead units) make a CPU's matrix products take a slow path; a
    finished stage hands on and saves none, loads back as it saved, and the outputs do not move."""
    from learn2stop.core.stage_checkpoints import load_finished_stage

    sm = make_sm()
    with torch.no_grad():  # theta, which Stage II leaves alone, with subnormal weights beside ordinary ones
        sm.model.W[1].weight[0, :3] = torch.tensor([1e-40, -3e-41, 2e-44])
    y = ToyTask().sample_batch(16, torch.Generator().manual_seed(0), "cpu")[0]
    outputs = lambda m: torch.stack(m.eval().unroll(y, keep_outputs=True, model_grad=False).step_outputs)  # noqa: E731
    before = outputs(sm)
    StagedTrainer(sm, ToyTask(), tmp_path, progress=False).fit(
        "stage2", StageConfig(objective="stage2", iterations=3, batch_size=8, eval_every=3))
    assert _subnormals(sm.parameters()) == 0
    saved = load_checkpoint(tmp_path / "checkpoints" / "stage2.pt")
    assert _subnormals(saved["weights"].values()) == 0
    fresh = make_sm()
    load_finished_stage(fresh, tmp_path / "checkpoints", "stage2")
    assert _subnormals(fresh.parameters()) == 0
    for a, b in zip(fresh.parameters(), sm.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(outputs(sm), before)  # the subnormal weights added nothing the outputs could hold


@pytest.mark.parametrize("optimizer, lr", [("adam", 1e-2), ("sgd", 0.2)])
def test_short_training_run_improves(tmp_path, optimizer, lr):
    sm = make_sm()
    task = ToyTask()
    trainer = StagedTrainer(sm, task, tmp_path, progress=False)
    from learn2stop.core import validation_scores
    before = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    opt = dict(optimizer=optimizer, lr=lr)
    trainer.fit("stage1", StageConfig(objective="stage1", iterations=150, batch_size=32, beta=0.1, eval_every=50, **opt))
    trainer.fit("stage2", StageConfig(objective="stage2", iterations=100, batch_size=32, beta=0.1, eval_every=50, **opt))
    after = validation_scores(sm, task.validation_batches("cpu"), task.loss_fn)
    assert after["oracle"] < 0.5 * before["oracle"]
    assert after["policy"] < 0.5 * before["policy"]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 5


def test_stage2_fits_the_tasks_stop_loss_and_only_stage2_does(tmp_path):
    from learn2stop.core import InferenceConfig, validation_scores
    from learn2stop.core.distributions import log_stop_time_distribution
    from learn2stop.core.loop import unroll
    from learn2stop.core.trainer import stage_loss_fn

    sm = make_sm()

    class Task(ToyTask):
        def stop_loss_fn(self, output, target):  # 0 for step 2's output (recomputed: theta is frozen), else 1
            r = unroll(sm.model, self._y, keep_outputs=True, model_grad=False)
            good = torch.stack(r.step_outputs, 1)[:, 1]  # step 2's output
            return 1.0 - (output - good).abs().amax(1).lt(1e-6).float()

        def sample_batch(self, batch_size, generator, device):
            self._y, x = super().sample_batch(batch_size, generator, device)
            return self._y, x

        def validation_batches(self, device):
            (y, x), = super().validation_batches(device)
            self._y = y
            return [(y, x)]

    task = Task()
    assert stage_loss_fn(task, StageConfig(objective="stage2")) == task.stop_loss_fn
    assert stage_loss_fn(task, StageConfig(objective="stage1")) == task.loss_fn
    StagedTrainer(sm, task, tmp_path, progress=False).fit(
        "stage2", StageConfig(objective="stage2", iterations=150, batch_size=32, lr=3e-2, beta=0.1, eval_every=50))
    (y, _), = task.validation_batches("cpu")
    with torch.no_grad():
        logits = sm.unroll(y).stop_logits
    mode = log_stop_time_distribution(logits).argmax(1) + 1
    assert (mode == 2).float().mean() > 0.95  # the stop loss's best step, not the MSE's (which falls with depth)
    scores = validation_scores(sm, task.validation_batches("cpu"), task.stop_loss_fn,
                               InferenceConfig(rule="threshold", param=0.5))
    assert scores["policy"] < 0.05 < scores["last"] == 1.0


class Crash(RuntimeError):
    pass


class CrashingTask(ToyTask):
    def __init__(self, crash_at):
        super().__init__()
        self.calls, self.crash_at = 0, crash_at

    def sample_batch(self, batch_size, generator, device):
        self.calls += 1
        if self.calls == self.crash_at:
            raise Crash("killed")
        return super().sample_batch(batch_size, generator, device)


def test_resume_after_crash_reproduces_uninterrupted_run(tmp_path):
    cfg = StageConfig(objective="stage1", iterations=20, batch_size=8, checkpoint_every=5, eval_every=20, select="none")
    ref = make_sm()
    StagedTrainer(ref, ToyTask(), tmp_path / "a", progress=False).fit("s1", cfg)

    sm = make_sm()
    with pytest.raises(Crash):
        StagedTrainer(sm, CrashingTask(crash_at=13), tmp_path / "b", progress=False).fit("s1", cfg)
    assert load_checkpoint(tmp_path / "b" / "checkpoints" / "s1.pt")["iteration"] == 10
    sm2 = make_sm()
    StagedTrainer(sm2, ToyTask(), tmp_path / "b", progress=False).fit("s1", cfg)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sm2.state_dict()[k], v)
    # a finished stage is skipped and restores its weights
    sm3 = make_sm()
    summary = StagedTrainer(sm3, ToyTask(), tmp_path / "b", progress=False).fit("s1", cfg)
    assert summary["iterations"] == 20
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sm3.state_dict()[k], v)
    with pytest.raises(ConfigError, match="different config"):
        StagedTrainer(make_sm(), ToyTask(), tmp_path / "b", progress=False).fit("s1", StageConfig(objective="stage1", iterations=30))


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")
    good = save_checkpoint({"x": torch.ones(3)}, tmp_path / "good.pt")
    data = good.read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(bad)
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(CheckpointError, match="not a learn2stop checkpoint"):
        load_checkpoint(other)

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    evil = tmp_path / "evil.pt"
    torch.save({"format": "learn2stop-checkpoint", "x": Evil()}, evil)
    with pytest.raises(CheckpointError, match="corrupt or not loadable safely"):
        load_checkpoint(evil)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = save_checkpoint({"x": torch.zeros(2)}, tmp_path / "c.pt")

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"x": torch.ones(2)}, path)
    monkeypatch.undo()
    torch.testing.assert_close(load_checkpoint(path)["x"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize("kw, field", [
    ({"beta": 0.0}, "beta"), ({"beta": -1.0}, "beta"), ({"iterations": -1}, "iterations"),
    ({"objective": "stage9"}, "objective"), ({"objective": "stage2", "variant": "sampled"}, "variant"),
    ({"lr": 0.0}, "lr"), ({"gamma": 1.5}, "gamma"), ({"lr_schedule": "linear"}, "lr_schedule"),
])
def test_stage_config_validation_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        StageConfig(**kw)


def test_lr_schedules():
    c = StageConfig(lr=1.0, iterations=100, lr_schedule="cosine", warmup=10)
    assert c.lr_at(0) == pytest.approx(0.1) and c.lr_at(9) == pytest.approx(1.0)
    assert c.lr_at(99) < 0.01
    s = StageConfig(lr=1.0, iterations=100, lr_schedule="step", lr_decay_at=(0.5,))
    assert s.lr_at(49) == 1.0 and s.lr_at(50) == pytest.approx(0.1)


def test_weight_average_is_the_moving_average_of_the_trajectory(tmp_path):
    """ema > 0: the stage ends on the moving average of the iterates (decay ramped min(ema, (1+i)/(10+i))),
    computed here by hand from the weights after each optimiser step; the live trajectory is unchanged."""
    cfg = StageConfig(objective="stage1", iterations=15, batch_size=8, lr=0.05, eval_every=5, select="none", ema=0.8)
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: seen.append([p.detach().clone() for p in sm.model.parameters()]))
    try:
        sm = make_sm()
        StagedTrainer(sm, ToyTask(), tmp_path / "a", progress=False).fit("s1", cfg)
        plain = make_sm()
        StagedTrainer(plain, ToyTask(), tmp_path / "b", progress=False).fit("s1", StageConfig(**{**cfg.__dict__, "ema": 0.0}))
    finally:
        hook.remove()
    trajectory = seen[:15]
    avg = [p.clone() for p in make_sm().model.parameters()]
    for i, weights in enumerate(trajectory):
        d = min(0.8, (1 + i) / (10 + i))
        avg = [d * a + (1 - d) * w for a, w in zip(avg, weights)]
    for got, want in zip(sm.model.parameters(), avg):
        torch.testing.assert_close(got, want)
    for got, want in zip(plain.model.parameters(), trajectory[-1]):  # ema 0: the last iterate, as before
        torch.testing.assert_close(got, want)
    assert not all(torch.allclose(a, w) for a, w in zip(avg, trajectory[-1]))  # the average is not the last iterate
    for p in sm.policy.parameters():  # not trained by stage1: no average touches it
        assert p.requires_grad


def test_weight_average_resumes_bit_identically_and_a_checkpoint_of_other_settings_is_refused(tmp_path):
    cfg = StageConfig(objective="stage1", iterations=20, batch_size=8, checkpoint_every=5, eval_every=20, select="none",
                      ema=0.9)
    ref = make_sm()
    StagedTrainer(ref, ToyTask(), tmp_path / "a", progress=False).fit("s1", cfg)
    sm = make_sm()
    with pytest.raises(Crash):
        StagedTrainer(sm, CrashingTask(crash_at=13), tmp_path / "b", progress=False).fit("s1", cfg)
    sm2 = make_sm()
    StagedTrainer(sm2, ToyTask(), tmp_path / "b", progress=False).fit("s1", cfg)
    for k, v in ref.state_dict().items():
        assert torch.equal(sm2.state_dict()[k], v), k
    # a checkpoint's stage config is compared field for field: one without a field is another stage, even at the
    # field's default (a checkpoint of an older library is refused by its run format, not completed by defaults)
    plain = StageConfig(**{**cfg.__dict__, "ema": 0.0})
    StagedTrainer(make_sm(), ToyTask(), tmp_path / "c", progress=False).fit("s1", plain)
    assert StagedTrainer(make_sm(), ToyTask(), tmp_path / "c", progress=False).fit("s1", plain)["iterations"] == 20
    with pytest.raises(ConfigError, match="different config"):
        StagedTrainer(make_sm(), ToyTask(), tmp_path / "c", progress=False).fit("s1", cfg)
    path = tmp_path / "c" / "checkpoints" / "s1.pt"
    ck = load_checkpoint(path)
    del ck["stage_config"]["ema"]
    save_checkpoint(ck, path)
    with pytest.raises(ConfigError, match="different config"):
        StagedTrainer(make_sm(), ToyTask(), tmp_path / "c", progress=False).fit("s1", plain)


def test_the_stage_optimiser_is_the_one_configured():
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = StageConfig(objective="stage1", optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=5e-4).make_optimizer(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.9
    assert sgd.defaults["weight_decay"] == 5e-4
    plain = StageConfig(objective="stage1", optimizer="sgd", momentum=0.0).make_optimizer(params)
    assert not plain.defaults["nesterov"]  # Nesterov needs momentum
    assert isinstance(StageConfig(objective="stage1").make_optimizer(params), torch.optim.Adam)
    with pytest.raises(ConfigError, match="optimizer"):
        StageConfig(objective="stage1", optimizer="rmsprop")
    with pytest.raises(ConfigError, match=r"momentum: must be in \[0, 1\)"):
        StageConfig(objective="stage1", optimizer="sgd", momentum=1.0)


@pytest.mark.parametrize("ema", [1.0, -0.1, 2])
def test_weight_average_decay_out_of_range_is_refused(ema):
    with pytest.raises(ConfigError, match=r"ema: must be in \[0, 1\)"):
        StageConfig(objective="stage1", ema=ema)


@pytest.mark.parametrize("objective", ["stage1", "stage3"])
def test_a_stage_leaves_the_weights_the_user_froze_unchanged_and_trains_the_rest(tmp_path, objective):
    # A pretrained backbone: the user freezes some of the model's weights and trains heads (and the policy) only.
    sm = make_sm()
    frozen = [*sm.model.W.parameters(), *sm.model.U[0].parameters()]
    for p in frozen:
        p.requires_grad_(False)
    before = copy.deepcopy(sm.state_dict())
    cfg = StageConfig(objective=objective, iterations=15, batch_size=16, lr=1e-2, eval_every=15, beta=0.5, select="none")
    StagedTrainer(sm, ToyTask(), tmp_path, progress=False).fit("s", cfg)
    after = sm.state_dict()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same == (name.startswith("model.W.") or name.startswith("model.U.0.")
                        or (objective == "stage1" and name.startswith("policy."))), name
    assert [p.requires_grad for p in sm.parameters()] == [not any(p is f for f in frozen) for p in sm.parameters()]


def test_a_stage_whose_parameters_are_all_frozen_says_so(tmp_path):
    sm = make_sm()
    for p in sm.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="every one of them is frozen"):
        StagedTrainer(sm, ToyTask(), tmp_path, progress=False).fit("s", StageConfig(objective="stage1", iterations=2))
    assert not any(p.requires_grad for p in sm.model.parameters())
    assert all(p.requires_grad for p in sm.policy.parameters())


@pytest.mark.parametrize("name", ["../escaped", "", "a/b", "/abs", ".", "..", "x\0y", 3])
def test_a_stage_name_must_be_a_plain_name(name, tmp_path):
    trainer = StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="stage name: must be a plain name"):
        trainer.fit(name, StageConfig(objective="stage1", beta=0.1, iterations=2, batch_size=4))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "run"]  # nothing written anywhere


def test_fit_and_train_refuse_a_dict_for_their_config(tmp_path):
    trainer = StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), tmp_path / "run", progress=False)
    for bad in ({"objective": "stage1"}, None):
        with pytest.raises(TypeError, match="the stage config must be a StageConfig"):
            trainer.fit("stage1", bad)
    from learn2stop.tasks.classify import commands as classify_app
    from learn2stop.tasks.denoise import app as denoise_app
    from learn2stop.tasks.maml import commands as maml_app
    from learn2stop.tasks.sparse import app as sparse_app

    for app in (sparse_app, maml_app, classify_app, denoise_app):
        for command in (app.train, app.evaluate):
            with pytest.raises(TypeError, match="cfg: expected the task's config dataclass"):
                command({"seed": 0}, tmp_path / "run-of-a-dict")
    assert not (tmp_path / "run-of-a-dict").exists()


def test_a_resume_that_cannot_write_keeps_metrics(tmp_path, monkeypatch):
    from learn2stop.core import stage_checkpoints as trainer_module

    run = tmp_path / "run"
    cfg = StageConfig(objective="stage1", beta=0.1, iterations=4, batch_size=4, eval_every=2, checkpoint_every=2)
    StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), run, progress=False).fit("stage1", cfg)
    metrics = (run / "metrics.jsonl").read_text()
    assert metrics.count("\n") == 2
    longer = StageConfig(objective="stage1", beta=0.1, iterations=6, batch_size=4, eval_every=2, checkpoint_every=2)
    ck = torch.load(run / "checkpoints" / "stage1.pt", weights_only=True)  # make it an unfinished stage at 2
    ck.update(completed=False, iteration=2, stage_config=__import__("learn2stop").utils.config.to_dict(longer.inherit()))
    torch.save(ck, run / "checkpoints" / "stage1.pt")

    def read_only(*args, **kwargs):  # what mkstemp meets on a read-only checkpoints/ (root ignores modes)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(trainer_module.tempfile, "mkstemp", read_only)
    with pytest.raises(OSError, match=r"cannot write checkpoints to .*checkpoints \(Permission denied\)"):
        StagedTrainer(StoppingModel(ToyStepModel(), ToyPolicy()), ToyTask(), run, progress=False).fit("stage1", longer)
    assert (run / "metrics.jsonl").read_text() == metrics  # the line after iteration 2 is still there

"""MAML-stop's kept answer (with ``model.policy_posterior``): each step keeps, per task, the prediction of the step so far
nearest the posterior-mean estimate; a stop answers with it. Also the estimate's own stage (objective ``auxiliary``)
and the task's classical rules built with the part of the output they read."""
import dataclasses
import json

import pytest
import torch

from learn2stop.cli import main
from learn2stop.core import InferenceConfig, StageConfig, StoppingModel, unroll
from learn2stop.core.trace import collect_trace, evaluate_rule
from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.objectives import StageObjective
from learn2stop.core.deployment import load_deployment
from learn2stop.core.train import load_stage
from learn2stop.core.task import signal_key
from learn2stop.core.rules import StopAtTimes, first_crossing
from learn2stop.tasks.maml.app import APP
from learn2stop.tasks.maml.config import MAMLConfig, preset
from learn2stop.tasks.maml.learner import MLP, MAMLModel
from learn2stop.tasks.maml.models import AnsweringMAML, build, meta_learner
from learn2stop.tasks.maml.policy import MAMLStopPolicy
from learn2stop.tasks.maml.samplers import SinusoidSampler
from learn2stop.utils.config import ConfigError
from learn2stop.utils.config_files import load_run_config

from conftest import CountingPosterior


def sinusoids(n=8, seed=0):
    return SinusoidSampler(1, 6, 9, noise=0.5).batch(None, n, torch.Generator().manual_seed(seed))


def answering(T=5, on=True):
    torch.manual_seed(0)
    net = MLP(hidden=8)
    policy = MAMLStopPolicy(net.feat_dim, 1, T, classification=False, dim=8, hidden=16, posterior=True, in_dim=1,
                            answer=True)
    model = AnsweringMAML(net, T, 0.3, loss="mse", policy_features=True, estimate=policy.posterior_mean)
    model.answering = on
    return StoppingModel(model, policy)


def test_the_answer_is_the_best_step_so_far_by_the_score():
    sm = answering()
    inputs, target = sinusoids()
    with torch.no_grad():
        own = unroll(meta_learner(sm), inputs, keep_outputs=True, model_grad=False).step_outputs
        kept = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs
        score = torch.stack([sm.policy.prediction_distance(inputs, o["pred"]) for o in own], 1)  # (B, T)
    for t, out in enumerate(kept, start=1):
        best = score[:, :t].argmin(1)  # the earliest of equal scores
        torch.testing.assert_close(out["step_pred"], own[t - 1]["pred"])
        torch.testing.assert_close(out["pred"], torch.stack([own[int(s)]["pred"][b] for b, s in enumerate(best)]))
        assert torch.equal(out["answer_step"], best + 1)
        torch.testing.assert_close(out["answer_score"], score[:, :t].min(1).values)
    assert len({int(s) for s in kept[-1]["answer_step"]}) > 1  # the tasks keep different steps


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_the_policy_can_read_the_support_loss_its_step_was_taken_of_without_a_support_forward(batching, monkeypatch):
    """``support_loss_from_step`` (with ``model.policy_inputs: scalars``): the support loss read at step t is the one the
    step's inner gradient was taken of, i.e. the support loss of step t-1's weights, read without a support-set
    forward; the steps themselves, and so the answers, are the same."""
    sm = answering()
    sm.model.task_batching = batching
    inputs, _ = sinusoids()
    with torch.no_grad():
        fresh = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs  # a support forward each
        first = sm.model._support_loss  # the support loss of the meta-parameters, before step 1
        at_init = torch.stack([first({k: v[b] for k, v in sm.model._fast(sm.model.initial_state(inputs)).items()},
                                     sm.model._split()[1], inputs["support_x"][b], inputs["support_y"][b],
                                     inputs["support_mask"][b]) for b in range(inputs["support_x"].shape[0])])
        sm.model.support_loss_from_step = True
        calls = []
        monkeypatch.setattr(AnsweringMAML, "_support_features", lambda *a: calls.append(1))
        carried = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs
    assert not calls  # no support-set forward at any step
    torch.testing.assert_close(carried[0]["support_loss"], at_init)
    for t in range(1, len(carried)):
        torch.testing.assert_close(carried[t]["support_loss"], fresh[t - 1]["support_loss"])
        torch.testing.assert_close(carried[t]["pred"], fresh[t]["pred"])
    assert set(carried[0]) == set(fresh[0]) - {"support_pred", "support_feats"}
    with torch.no_grad():  # the scalars policy reads it
        scalars = MAMLStopPolicy(8, 1, 5, classification=False, dim=8, hidden=16, posterior=True, in_dim=1,
                                 answer=True, inputs="scalars")
        scalars.posterior = sm.policy.posterior
        assert scalars(inputs, carried[2], 3).shape == (8,)


def test_off_it_is_the_meta_learner_and_the_switch_is_in_the_checkpoint():
    sm = answering(on=False)
    inputs, _ = sinusoids()
    with torch.no_grad():
        a = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs
        b = unroll(meta_learner(sm), inputs, keep_outputs=True, model_grad=False).step_outputs
    assert all(torch.equal(x["pred"], y["pred"]) and "answer_step" not in x for x, y in zip(a, b))
    sm.model.answering = True
    other = answering(on=False)
    other.load_state_dict(sm.state_dict())
    assert other.model.answering  # Stage II's checkpoints answer, Stage I's do not
    assert isinstance(meta_learner(sm), MAMLModel) and not isinstance(meta_learner(sm), AnsweringMAML)


def test_early_exit_answers_what_the_trace_has_at_the_stop_step():
    sm = answering()
    inputs, target = sinusoids(10, seed=3)
    times = torch.tensor([1, 2, 3, 4, 5, 5, 4, 3, 2, 1])
    with torch.no_grad():
        r = run_with_early_exit(sm.model, inputs, StopAtTimes(times))
        full = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs
    want = torch.stack([full[int(t) - 1]["pred"][b] for b, t in enumerate(times)])
    torch.testing.assert_close(r.outputs["pred"], want)


def test_the_estimate_rides_in_the_state_once_per_rollout_under_early_exit():
    sm = answering()
    sm.policy.posterior.__class__ = CountingPosterior
    inputs, _ = sinusoids(10, seed=3)
    times = torch.tensor([1, 2, 3, 4, 5, 5, 4, 3, 2, 1])
    with torch.no_grad():
        # a threshold between the rows' first stop probabilities: some stop at step 1, the others run on
        param = float(torch.sigmoid(sm.unroll({k: v.clone() for k, v in inputs.items()}).stop_logits[:, 0]).median())
        CountingPosterior.calls = 0
        r = run_with_early_exit(sm.model, inputs, StopAtTimes(times))
        assert CountingPosterior.calls == 1  # rows that stop take their slice of it; the others never recompute it
        rule = InferenceConfig(rule="threshold", param=param).make_rule(sm.policy)  # asked on the running rows
        e = run_with_early_exit(sm.model, {k: v.clone() for k, v in inputs.items()}, rule)
        assert CountingPosterior.calls == 2 and len(set(e.stop_times.tolist())) > 1  # new inputs: once more, and only once
        full = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs
    # the policy reads the step's score the model computed, equal to computing it from the inputs
    for out in full:
        torch.testing.assert_close(out["step_score"], sm.policy.prediction_distance(inputs, out["step_pred"]))
    torch.testing.assert_close(r.outputs["pred"], torch.stack([full[int(t) - 1]["pred"][b] for b, t in enumerate(times)]))


def test_the_policy_reads_the_kept_answer():
    sm = answering()
    inputs, _ = sinusoids()
    with torch.no_grad():
        out = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs[3]
        a = sm.policy(inputs, out, 4)
        moved = {**out, "answer_step": torch.ones_like(out["answer_step"])}  # the same answer, kept for longer
        assert not torch.allclose(sm.policy(inputs, moved, 4), a)
        plain = {k: v for k, v in out.items() if not k.startswith("answer_")}  # none kept yet: reads this step
        assert sm.policy(inputs, plain, 4).shape == a.shape
    with pytest.raises(ValueError, match="posterior"):
        MAMLStopPolicy(8, 1, 4, classification=False, posterior=False, answer=True)


def test_the_auxiliary_objective_trains_the_estimate_alone_and_improves_it():
    sm = answering()
    obj = StageObjective(sm, sm.model.task_loss, StageConfig(objective="auxiliary"))
    assert obj.cfg.trains == "policy" and obj.cfg.select == "none"
    test_in, test_y = sinusoids(200, seed=99)
    with torch.no_grad():
        before = float(sm.policy.auxiliary_loss(test_in, test_y))
    head = [p.detach().clone() for p in sm.policy.head.parameters()]
    opt = torch.optim.Adam(sm.policy.parameters(), 3e-3)
    sampler, g = SinusoidSampler(1, 6, 9, noise=0.5), torch.Generator().manual_seed(1)
    for _ in range(150):
        loss, metrics = obj(*sampler.batch(None, 16, g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert "aux_loss" in metrics and all(torch.equal(a, b) for a, b in zip(head, sm.policy.head.parameters()))
    with torch.no_grad():
        assert float(sm.policy.auxiliary_loss(test_in, test_y)) < 0.8 * before
    plain = StoppingModel(MAMLModel(MLP(hidden=8), 3, 0.1, loss="mse", policy_features=True),
                          MAMLStopPolicy(8, 1, 3, classification=False))
    with pytest.raises(ValueError, match="auxiliary_loss"):
        StageObjective(plain, plain.model.task_loss, StageConfig(objective="auxiliary"))(*sinusoids())


def test_the_estimate_brings_the_kept_answer_and_the_support_loss_follows_what_the_policy_reads():
    """``model.policy_posterior`` builds the estimate and the kept answer it chooses (its stage, its patience rule);
    with ``policy_inputs: scalars`` the policy reads the support loss its step was taken of. The fields that
    set these apart (``answer``, ``policy_support_loss``) are gone, refused by name."""
    for gone in ({"answer": "nearest"}, {"policy_support_loss": "step"}):
        with pytest.raises(ConfigError, match=f"model.{next(iter(gone))}: unknown config field"):
            preset("quick", model=gone)
    with pytest.raises(ConfigError, match="posterior.objective"):
        preset("quick", posterior={"objective": "stage2", "variant": "map"})
    cfg = preset("quick")
    assert [s.name for s in APP.stages(cfg)] == ["baseline", "stage1", "posterior", "stage2"]
    assert [s.name for s in APP.stages(preset("quick", model={"policy_posterior": False}))] == [
        "baseline", "stage1", "stage2"]
    stop = build(cfg, None)[1]
    assert isinstance(stop.model, AnsweringMAML) and stop.model.support_loss_from_step and stop.policy.answer
    assert set(APP.classical_signals(cfg)) == {"tolerance", "patience"}
    joint = build(preset("quick", model={"policy_inputs": "joint"}), None)[1]
    assert isinstance(joint.model, AnsweringMAML) and not joint.model.support_loss_from_step  # the sets need the readout
    plain = build(preset("quick", model={"policy_posterior": False}), None)[1]
    assert type(plain.model) is MAMLModel and not plain.policy.answer
    assert set(APP.classical_signals(preset("quick", model={"policy_posterior": False}))) == {"tolerance"}


TINY = ["--maml.iterations", "4", "--stage1.iterations", "4", "--stage2.iterations", "4", "--posterior.iterations", "40",
        "--posterior.eval_every", "40", "--maml.batch_size", "3", "--stage1.batch_size", "3", "--stage2.batch_size", "3",
        "--eval.tasks", "12", "--eval.val_tasks", "6", "--eval.chunk", "6", "--no-progress", "--model.inner_steps", "4",
        "--model.policy_posterior", "true"]


def test_a_run_answers_from_stage2_on_and_rules_read_their_part_of_the_output(tmp_path):
    run = tmp_path / "run"
    assert main(["maml", "reproduce", "--preset", "quick", "--run-dir", str(run)] + TINY) == 0
    assert (run / "checkpoints" / "posterior.pt").is_file()
    cfg = load_run_config(MAMLConfig, run)
    assert not load_stage(APP, cfg, run, "stage1").model.answering
    assert not load_stage(APP, cfg, run, "posterior").model.answering
    sm = load_stage(APP, cfg, run, "stage2")
    assert sm.model.answering
    estimate = load_stage(APP, cfg, run, "posterior").policy.posterior
    assert all(torch.equal(a, b) for a, b in zip(estimate.parameters(), sm.policy.posterior.parameters()))
    assert all("aux_loss" not in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if json.loads(line).get("stage") == "stage2")  # Stage II keeps the estimate of its own stage
    result = json.loads((run / "results.json").read_text())
    batches = APP.eval_batches(cfg, "test", None)
    own = collect_trace(meta_learner(sm), batches, APP.metric(cfg)).metric
    assert result["rows"]["MAML-stop meta-learner, fixed 4 steps"]["mean"] == pytest.approx(float(own[:, -1].mean()))
    in_time = json.loads((run / "in_time.json").read_text())
    assert {r["rule"] for r in in_time["rows"]} >= {"baseline", "quantile", "tolerance", "patience", "fixed"}
    # a rule named by the config runs online on the part of the output the task's trace scored
    key = signal_key(APP, cfg, "tolerance")
    assert callable(key) and signal_key(APP, cfg, "quantile") is None
    for rule, param in (("tolerance", 0.05), ("patience", 1.0)):
        c = dataclasses.replace(cfg, inference=InferenceConfig(rule=rule, param=param, use_calibrated=False))
        online = load_deployment(APP, c, run, stage=APP.stop_stage, sm=sm).online
        got = evaluate_rule(sm.model, batches, lambda: online, APP.metric(cfg))["stop_times"]
        trace = collect_trace(sm.model, batches, APP.metric(cfg), signals=APP.classical_signals(cfg))
        signal = APP.classical_signals(cfg)[rule]()
        assert torch.equal(got, first_crossing(trace.signals[rule], signal.from_param(param)))
    assert main(["maml", "frontier", "--preset", "quick", "--run-dir", str(run)] + TINY) == 0
    front = json.loads((run / "frontier.json").read_text())
    assert {"patience", "tolerance", "policy", "fixed_depth"} <= set(front["curves"])

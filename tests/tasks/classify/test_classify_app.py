"""Early-exit recognition end to end: reproduce, calibrate, frontier, predict, bad input (tiny configs)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from learn2stop.cli import main

TINY = ["--data.kind", "synthetic", "--data.size", "16", "--data.synthetic_per_class", "24",
        "--data.synthetic_classes", "3", "--model.arch", "vgg6-narrow", "--model.fc_width", "16", "--eval_batch", "64",
        "--no-progress", "--threads", "1",
        *[a for s in ("baseline", "sdn", "stage1", "stage2")
          for a in (f"--{s}.iterations", "8", f"--{s}.batch_size", "16", f"--{s}.eval_every", "4",
                    f"--{s}.checkpoint_every", "4")]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("classify") / "run"
    assert main(["classify", "reproduce", "--run-dir", str(run), *TINY]) == 0
    return run


def test_reproduce_writes_table7_and_the_frontier(trained):
    for f in ("table7.md", "results.json", "frontier.json", "frontier.md", "frontier.png", "checkpoints/sdn.pt",
              "checkpoints/stage2.pt", "training_summary.json"):
        assert (trained / f).is_file(), f
    text = (trained / "table7.md").read_text()
    assert "SDN training" in text and "confidence on SDN network" in text and "policy (threshold) on Stage I network" in text
    fr = json.loads((trained / "frontier.json").read_text())
    assert fr["metric"] == "accuracy (%)" and fr["lower_is_better"] is False and fr["num_steps"] == 6
    assert {"fixed_depth", "confidence", "entropy", "patience", "policy", "oracle", "sdn_confidence",
            "baseline_fixed_depth"} <= set(fr["curves"])
    assert "mean_flops" in fr["full_depth"]
    for name in ("confidence", "policy", "fixed_depth"):
        for p in fr["curves"][name]:
            assert p["mean_flops"] > 0 and p["samples_per_s_batch1"] > 0 and p["samples_per_s_batchN"] > 0
    flops = [p["mean_flops"] for p in fr["curves"]["fixed_depth"]]
    assert flops == sorted(flops) and flops[-1] == pytest.approx(fr["full_depth"]["mean_flops"])
    # the oracle exit bounds every rule from above at equal or lower cost
    best_oracle = max(p["metric"] for p in fr["curves"]["oracle"])
    assert best_oracle >= max(p["metric"] for p in fr["curves"]["fixed_depth"])
    # head to head: the policy against the one-line rules of the Stage I network and of SDN's, not the baseline's
    columns = set(fr["head_to_head"]["rows"][0]["rules"])
    assert columns == {"confidence", "entropy", "patience", "fixed", "sdn_confidence", "sdn_entropy", "sdn_patience",
                       "sdn_fixed"}
    assert fr["head_to_head"]["by"] == "cost"


def test_calibrate_risk_and_predict_use_the_calibrated_rule(trained, tmp_path, capsys):
    assert main(["classify", "calibrate", "--run-dir", str(trained), "--epsilon", "0.05", "--delta", "0.2", *TINY]) == 0
    cal = json.loads((trained / "calibration.json").read_text())
    assert cal["target"]["kind"] == "risk" and cal["target"]["p_value"] == "hoeffding-bentkus"
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / "a.png")
    Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8)).save(folder / "b.png")  # grey, other size
    capsys.readouterr()
    assert main(["classify", "predict", "--run-dir", str(trained), "--predict.input", str(folder), *TINY]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "resized" in out
    pred = json.loads((trained / "predictions.json").read_text())
    assert "calibrated confidence" not in pred["rule"] and "calibrated threshold rule" in pred["rule"]
    assert [p["file"].endswith(n) for p, n in zip(pred["predictions"], ("a.png", "b.png"))] == [True, True]
    for p in pred["predictions"]:
        assert 1 <= p["exit"] <= 6 and p["flops"] > 0 and p["class"].startswith("class")
    (folder / "c.png").write_bytes(b"not an image")
    assert main(["classify", "predict", "--run-dir", str(trained), "--predict.input", str(folder), *TINY]) == 2
    assert "c.png" in capsys.readouterr().err


def test_a_checkpoint_for_another_number_of_classes_is_refused(trained, capsys):
    args = [a if a != "3" else "4" for a in TINY]  # synthetic_classes 3 -> 4
    assert main(["classify", "evaluate", "--run-dir", str(trained), *args]) == 2
    assert "data.synthetic_classes=4" in capsys.readouterr().err  # the run's fingerprint refuses it first
    from learn2stop.core import load_stage
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.utils.checkpoint import CheckpointError
    from learn2stop.utils.config import from_dict

    cfg = from_dict(ClassifyConfig, {"data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 24,
                                              "synthetic_classes": 4}, "model": {"arch": "vgg6-narrow", "fc_width": 16}})
    with pytest.raises(CheckpointError, match="does not fit"):  # and the checkpoint itself, without the fingerprint
        load_stage(APP, cfg, trained, "stage2")


@pytest.mark.parametrize("args, message", [
    (["--data.kind", "mnist"], "data.kind"),
    (["--data.kind", "folder", "--data.path", "/nonexistent/folder"], "nonexistent"),
    (["--model.arch", "vgg99"], "model.arch"),
    (["--table_budget", "0"], "table_budget"),
    (["--sdn_from", "pretrained"], "sdn_from"),
    (["--stop_loss", "hinge"], "stop_loss"),
    (["--model.arch", "resnet20", "--model.width", "4", "--model.channels_last", "true"], "model.channels_last"),
])
def test_bad_configs_name_the_field(args, message, tmp_path, capsys):
    rc = None
    try:
        rc = main(["classify", "train", "--run-dir", str(tmp_path / "r"), *TINY, *args])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_exit_costs_are_the_measured_flops():
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.utils.config import from_dict

    cfg = from_dict(ClassifyConfig, {"data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 6,
                                              "synthetic_classes": 2}, "model": {"arch": "vgg6-narrow"}})
    sm = APP.build_models(cfg, "cpu")["stop"]
    flops = sm.model.flops
    assert sm.model.exit_costs == flops.exits and flops.exits[-1] == sm.model.network_flops + sum(flops.heads)
    assert sm.policy(None, torch.randn(5, 2), 1).shape == (5,)


@pytest.mark.parametrize("arch", ["resnet20", "resnet56", "resnet18"])  # VGG: the reproduce above (every VGG builds
# and runs in test_classify_models)
def test_every_architecture_trains_evaluates_and_predicts_a_tiny_config(arch, tmp_path):
    size = "16"
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--data.kind", "synthetic", "--data.size", size, "--data.synthetic_per_class", "9",
            "--data.synthetic_classes", "2", "--model.arch", arch, "--eval_batch", "32", "--no-progress",
            "--threads", "1", "--model.width", "4", "--model.channels_last", "false",  # width 4: see ModelConfig
            *[a for s in ("baseline", "sdn", "stage1", "stage2")
              for a in (f"--{s}.iterations", "2", f"--{s}.batch_size", "8", f"--{s}.eval_every", "2",
                        f"--{s}.checkpoint_every", "2", f"--{s}.warmup", "0")]]
    assert main(["classify", "train", *args]) == 0
    assert main(["classify", "evaluate", *args]) == 0
    res = json.loads((run / "results.json").read_text())
    steps = len(res["per_exit"]["SDN training"])  # SDN's placement: six exits and the network's own classifier
    assert steps == 7
    assert [len(v) for v in res["per_exit"].values()] == [steps] * 3
    # of the network alone's FLOPs: above 1 only by the exit heads' own cost (under 1 %) when no image exits early
    assert 0 < res["deployed"]["flops_fraction"] < 1.01
    img = tmp_path / "x.png"
    Image.fromarray(np.zeros((int(size), int(size), 3), dtype=np.uint8)).save(img)
    assert main(["classify", "predict", *args, "--predict.input", str(img)]) == 0
    pred = json.loads((run / "predictions.json").read_text())["predictions"]
    assert len(pred) == 1 and 1 <= pred[0]["exit"] <= steps


def test_a_run_no_threshold_of_which_keeps_the_baselines_accuracy_deploys_the_network_alone(
        trained, tmp_path, monkeypatch, capsys):
    """When no threshold of the stop model reaches the network alone's accuracy on validation, what a user who
    keeps that accuracy ships is the network alone: reproduce records it, evaluate's deployed row and predict
    serve it, the stop model's configured rule is the second row; a calibration put in since wins."""
    import shutil

    from learn2stop.core import deploy, train
    from learn2stop.tasks.base import RunContext
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.utils.config import from_dict
    from learn2stop.utils.config_files import load_yaml

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock", "calibration.json", "deployment.json"))
    cfg = from_dict(ClassifyConfig, load_yaml(run / "config.yaml"))
    monkeypatch.setattr(APP, "quality_lead", lambda cfg, val, base: -0.01)  # the stop model trails
    monkeypatch.setattr(deploy, "calibrate_match", lambda *a, **k: None)  # and no threshold reaches it
    assert deploy.deploy_calibration(APP, cfg, RunContext(run_dir=run, progress=False)) is None
    assert not (run / "calibration.json").exists()
    record = json.loads((run / "deployment.json").read_text())
    assert record["stage"] == "baseline" and "no threshold" in record["reason"]
    in_time = json.loads((run / "in_time.json").read_text())  # the served network alone, timed beside every rule
    assert in_time["deployed"] == "baseline" and in_time["rows"][0]["name"].endswith("(deployed)")
    assert all(r.get("reached") is False for r in in_time["rows"][1:])  # none matched (calibrate_match: None)
    assert [r["rule"] for r in in_time["rows"][1:]] == ["threshold", "quantile", "confidence", "entropy", "patience",
                                                        "fixed"]
    assert main(["classify", "evaluate", "--run-dir", str(run), *TINY]) == 0
    res = json.loads((run / "results.json").read_text())
    dep = res["deployed"]
    assert dep["accuracy"] == pytest.approx(res["per_exit"]["network alone"][-1]) and dep["flops_fraction"] == 1.0
    assert dep["rule"].startswith("the network alone")
    assert "deploys the network alone at full depth instead" in dep["stop_model"]["rule"]
    text = (run / "table7.md").read_text()
    assert "Deployed (the network alone at full depth, no early exit: no threshold" in text and "configured rule" in text
    img = tmp_path / "x.png"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(img)
    assert main(["classify", "predict", "--run-dir", str(run), "--predict.input", str(img), *TINY]) == 0
    pred = json.loads((run / "predictions.json").read_text())
    net = train.load_stage(APP, cfg, run, "baseline").model
    assert pred["rule"].startswith("the network alone")
    assert pred["predictions"][0]["exit"] == 6 and pred["predictions"][0]["flops"] == net.network_flops
    # the config's rule, asked for, puts the stop model back; so does a calibration
    assert main(["classify", "predict", "--run-dir", str(run), "--predict.input", str(img), *TINY,
                 "--inference.use_calibrated", "false"]) == 0
    assert "network alone" not in json.loads((run / "predictions.json").read_text())["rule"]
    monkeypatch.setattr(APP, "quality_lead", lambda cfg, val, base: 0.02)
    # whichever certified rule of the stop model the timing picks (here the cheapest: timings are the machine's)
    monkeypatch.setattr(deploy, "fastest_certified", lambda speeds, costs, tie: min((r for r in costs if r != "baseline"),
                                                                               key=costs.get))
    assert deploy.deploy_calibration(APP, cfg, RunContext(run_dir=run, progress=False)) is not None
    assert (run / "calibration.json").is_file() and not (run / "deployment.json").exists()
    (run / "calibration.json").unlink()
    from learn2stop.utils.formats import RUN_FORMAT

    (run / "deployment.json").write_text(json.dumps({"format": RUN_FORMAT, "stage": "sdn", "reason": "x"}))
    capsys.readouterr()
    assert main(["classify", "predict", "--run-dir", str(run), "--predict.input", str(img), *TINY]) == 2
    assert "deployment.json" in capsys.readouterr().err


def test_the_deployed_epsilon_is_the_accuracy_lead_not_the_consistency_risk():
    """The stop model right on 30 images the baseline misses, wrong on 40 it gets: a lead of -10 of 100 (the
    consistency loss would count +30 %, and let the deployed rule fall below the baseline)."""
    from learn2stop.core.trace import Trace
    from learn2stop.tasks.classify.app import APP

    base_last = torch.zeros(100)
    base_last[30:] = 1.0
    stop_last = torch.ones(100)
    stop_last[30:70] = 0.0
    costs = torch.tensor([0.5, 1.0])
    stop = Trace(metric=torch.stack([stop_last, stop_last], 1), costs=costs)
    base = Trace(metric=torch.stack([base_last, base_last], 1), costs=costs)
    assert APP.quality_lead(None, stop, base) == pytest.approx(-0.10)


def test_sdn_from_the_network_alone_starts_from_its_weights(tmp_path):
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.core.train import load_stage
    from learn2stop.utils.config import from_dict

    run = tmp_path / "run"
    zero = ["--sdn.iterations", "0", "--stage1.iterations", "0", "--stage2.iterations", "0"]
    assert main(["classify", "train", "--run-dir", str(run), *TINY, *zero, "--sdn_from", "baseline"]) == 0
    cfg = from_dict(ClassifyConfig, {"data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 24,
                                              "synthetic_classes": 3}, "sdn_from": "baseline",
                                     "model": {"arch": "vgg6-narrow", "fc_width": 16}})
    base, sdn = (load_stage(APP, cfg, run, s).model.backbone.state_dict() for s in ("baseline", "sdn"))
    fresh = APP.build_models(cfg, "cpu")["sdn"].model.backbone.state_dict()
    assert all(torch.equal(base[k], sdn[k]) for k in base)  # the trained network alone, handed on
    assert not all(torch.equal(base[k], fresh[k]) for k in base)  # not a fresh draw


def test_stage2_oracle_is_on_the_error_by_default_and_on_the_cross_entropy_if_asked():
    from learn2stop.core.trainer import stage_loss_fn
    from learn2stop.core import StageConfig
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.tasks.classify.metric import error_loss
    from learn2stop.utils.config import from_dict

    logits, y = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0]]), torch.tensor([0, 2, 2])
    torch.testing.assert_close(error_loss(logits, y), torch.tensor([0.0, 1.0, 0.0]))
    data = {"kind": "synthetic", "size": 16, "synthetic_per_class": 6, "synthetic_classes": 3}
    for stop_loss, expect in (("error", error_loss), ("cross_entropy", None)):
        cfg = from_dict(ClassifyConfig, {"data": data, "model": {"arch": "vgg6-narrow"}, "stop_loss": stop_loss})
        task = APP.training_task(cfg, "stop", None)
        got = stage_loss_fn(task, StageConfig(objective="stage2"))
        assert got == (expect or task.loss_fn)
        assert stage_loss_fn(task, StageConfig(objective="stage1")) == task.loss_fn  # the network trains on CE
    assert ClassifyConfig().inference.rule == "threshold" and ClassifyConfig().stage2.beta == 0.1


def test_channels_last_changes_the_layout_not_the_function():
    from learn2stop.tasks.classify import APP, ClassifyConfig
    from learn2stop.utils.config import from_dict

    def models(cl):
        return APP.build_models(from_dict(ClassifyConfig, {
            "data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 6, "synthetic_classes": 2},
            "model": {"arch": "vgg6-narrow", "channels_last": cl}}), "cpu")["stop"].model.eval()

    nhwc, nchw = models(True), models(False)
    nhwc.load_state_dict(nchw.state_dict())
    conv = nhwc.backbone.features[0][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    x = torch.randn(4, 3, 16, 16)
    s1, s2 = nhwc.initial_state(x), nchw.initial_state(x)
    for t in range(1, nhwc.num_steps + 1):
        s1, s2 = nhwc.step(t, s1), nchw.step(t, s2)
        torch.testing.assert_close(nhwc.readout(t, s1), nchw.readout(t, s2), rtol=1e-4, atol=1e-5)

"""The one record of what a trained run serves: load_deployment on a tiny sparse run, for each way a rule is
chosen (the config's, a calibration, the baseline recorded by reproduce), and a bad record refused by name."""
import json

import pytest

from learn2stop.cli import main
from learn2stop.core.deployment import load_deployment
from learn2stop.core.rules import FixedDepth
from learn2stop.tasks.sparse.app import APP
from learn2stop.tasks.sparse.config import SparseConfig
from learn2stop.utils.config import ConfigError
from learn2stop.utils.config_files import resolve
from learn2stop.utils.formats import RUN_FORMAT

from conftest import TINY  # the sparse quick preset shrunk to seconds


def test_each_kind_of_deployment_is_read_back_with_its_model_and_rule(tmp_path):
    run = tmp_path / "run"
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", "--threads", "1", *TINY]) == 0
    cfg = resolve(SparseConfig, yaml_path=str(run / "config.yaml"))
    dep = load_deployment(APP, cfg, run)  # nothing calibrated: the config's rule on the stop model
    assert (dep.kind, dep.stage, dep.rule, dep.param) == ("configured", "stage2", cfg.inference.rule, cfg.inference.param)
    assert not dep.calibrated and dep.model.policy is not None and dep.reason == ""
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--no-progress", "--threads", "1", "--budget", "0.6",
                 "--rule", "fixed", *TINY]) == 0
    dep = load_deployment(APP, cfg, run)
    assert (dep.kind, dep.rule, dep.target["budget"]) == ("calibrated", "fixed", 0.6) and dep.calibrated
    assert dep.description.startswith("calibrated fixed rule") and dep.online.depth == 3  # 60 % of 5 steps
    assert load_deployment(APP, cfg, run, stage="stage3").kind == "configured"  # the calibration is the stop stage's
    off = resolve(SparseConfig, yaml_path=str(run / "config.yaml"), overrides={"inference": {"use_calibrated": False}})
    assert load_deployment(APP, off, run).kind == "configured"
    (run / "calibration.json").unlink()
    (run / "deployment.json").write_text(json.dumps({"format": RUN_FORMAT, "stage": "baseline", "reason": "slower",
                                                     "tie": 0.03}))
    dep = load_deployment(APP, cfg, run)  # reproduce's record: the baseline served at full depth
    assert (dep.kind, dep.stage, dep.reason, dep.tie) == ("baseline", "baseline", "slower", 0.03)
    assert isinstance(dep.online, FixedDepth) and dep.model.policy is None and dep.serves_baseline
    stop = load_deployment(APP, cfg, run, stage="stage2")  # the stop model still evaluated, saying what is served
    assert stop.kind == "configured" and stop.reason == "slower" and "deploys LISTA at full depth" in stop.description
    (run / "deployment.json").write_text(json.dumps({"format": RUN_FORMAT, "stage": "stage1", "reason": "x"}))
    with pytest.raises(ConfigError, match=r"deployment\.json: expected this task's baseline stage 'baseline'"):
        load_deployment(APP, cfg, run)

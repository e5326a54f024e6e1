"""Export to ONNX and the torch-free runtime: the same stop times and outputs as StoppingModel, refusals."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import randomise, sketch_lista  # noqa: E402
from learn2stop.cli import main  # noqa: E402
from learn2stop.core.inference import InferenceConfig
from learn2stop.core.model import StoppingModel  # noqa: E402
from learn2stop.export import ExportError, export_stop_model  # noqa: E402
from learn2stop.runtime import ManifestError, load  # noqa: E402
from learn2stop.tasks.classify.models import build_network  # noqa: E402
from learn2stop.core.policies import ExitPolicy  # noqa: E402


@pytest.fixture(scope="module")
def sparse_sm():
    return sketch_lista(96)


@pytest.fixture(scope="module")
def classify_sm():
    torch.manual_seed(0)
    net = build_network("vgg6-narrow", 5, 16, fc_width=16)
    randomise(net.heads, 7)  # exits whose logits differ from image to image: varied confidences and stops
    policy = ExitPolicy(5, net.num_steps, hidden=8)
    randomise(policy, 2)
    x = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return StoppingModel(net, policy).eval(), x


class TinyPlanner(nn.Module):
    """A planning policy: called once at ``plan_step``, returns the (B, T-1) stop logits of every step."""

    def __init__(self, n: int, T: int, plan_step: int):
        super().__init__()
        self.plan_step, self.net = plan_step, nn.Linear(n + 13, T - 1)

    def forward(self, y, x, t):
        return 3 * self.net(torch.cat([x, y], 1))


def _same_as_torch(sm, inputs, rule, folder, *, batch1=4):
    """Export, run both, compare; return the torch stop times."""
    export_stop_model(sm, rule, inputs[:2], folder, task="test")
    rt = load(folder)
    with torch.no_grad():
        ref = sm(inputs, rule=rule.make_rule(sm.policy))
    got = rt.run(inputs.numpy())
    np.testing.assert_array_equal(got.stop_times, ref.stop_times.numpy())
    np.testing.assert_allclose(got.outputs, ref.outputs.numpy(), atol=1e-5, rtol=1e-5)
    assert got.steps_computed == ref.steps_computed
    for i in range(batch1):  # batch 1: a stop ends the loop
        out, t = rt.run_one(inputs[i].numpy())
        assert t == int(ref.stop_times[i])
        np.testing.assert_allclose(out, ref.outputs[i].numpy(), atol=1e-5, rtol=1e-5)
    return ref.stop_times


@pytest.mark.parametrize("rule,param", [("quantile", 0.5), ("threshold", 0.6)])
def test_sparse_runtime_stops_where_the_torch_loop_stops(sparse_sm, tmp_path, rule, param):
    sm, y = sparse_sm
    times = _same_as_torch(sm, y, InferenceConfig(rule=rule, param=param), tmp_path / "exp", batch1=6)
    assert times.unique().numel() >= 2 and int(times.min()) >= 2  # varied stops, none before min_step


@pytest.mark.parametrize("rule,param", [("quantile", 0.8), ("confidence", 0.8)])
def test_classify_runtime_stops_where_the_torch_loop_stops(classify_sm, tmp_path, rule, param):
    sm, x = classify_sm
    times = _same_as_torch(sm, x, InferenceConfig(rule=rule, param=param), tmp_path / "exp")
    assert times.unique().numel() >= 2
    m = json.loads((tmp_path / "exp" / "manifest.json").read_text())
    assert m["inputs"] == [{"name": "inputs", "shape": [None, 3, 16, 16], "dtype": "float32"}]
    assert len(m["exit_costs"]) == sm.num_steps and m["exit_costs"] == sorted(m["exit_costs"])
    # the convolutional steps never read the images again: they are not compacted with the batch
    assert all(s["inputs"] == ["state.0"] for s in m["steps"][1:])


def test_tolerance_rule_without_a_policy(sparse_sm, tmp_path):
    sm, y = sparse_sm
    times = _same_as_torch(StoppingModel(sm.model).eval(), y, InferenceConfig(rule="tolerance", param=0.1), tmp_path / "e")
    assert times.unique().numel() >= 2 and int(times.max()) < 7


def test_denoise_exports_for_images_of_any_size(tmp_path):
    from learn2stop.tasks.denoise.models import DeepSupervisedDnCNN
    from learn2stop.tasks.denoise.policy import DenoisePolicy

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = DeepSupervisedDnCNN(depth=6, channels=8)
    policy = DenoisePolicy(net.num_steps, hidden=8)
    randomise(policy, 0)
    sm = StoppingModel(net, policy).eval()
    rule = InferenceConfig(rule="quantile", param=0.5)
    export_stop_model(sm, rule, torch.rand(2, 1, 16, 16), tmp_path / "exp", dynamic_dims={"inputs": [2, 3]})
    rt = load(tmp_path / "exp")
    x = torch.rand(24, 1, 20, 24, generator=g) * torch.rand(24, 1, 1, 1, generator=g) * 3  # not the traced size
    with torch.no_grad():
        ref = sm(x, rule=rule.make_rule(policy))
    got = rt.run(x.numpy())
    assert ref.stop_times.unique().numel() >= 2
    np.testing.assert_array_equal(got.stop_times, ref.stop_times.numpy())
    np.testing.assert_allclose(got.outputs, ref.outputs.numpy(), atol=1e-5, rtol=1e-5)
    out, t = rt.run_one(x[0, :, :9, :13].numpy())
    assert out.shape == (1, 9, 13) and 1 <= t <= net.num_steps
    with pytest.raises(ValueError, match=r"expected shape \(B, 1, any, any\)"):
        rt.run(np.zeros((1, 2, 9, 9), np.float32))


class DictModel(nn.Module):
    """Dict inputs, a dict output: the leaves are exported by name, the runtime takes and gives dicts."""

    num_steps = 3

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def initial_state(self, inputs):
        return inputs["a"] * 0

    def step(self, t, state, inputs):
        return torch.tanh(self.lin(state) + inputs["a"] * t + inputs["b"])

    def readout(self, t, state, inputs):
        return {"mean": state.mean(1, keepdim=True), "x": state}


class DictPolicy(nn.Module):
    def forward(self, inputs, output, t):
        return 3 * output["x"].sum(1)


def test_dict_inputs_and_outputs(tmp_path):
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    sm = StoppingModel(DictModel(), DictPolicy()).eval()
    inputs = {"a": torch.randn(20, 4, generator=g), "b": torch.randn(20, 4, generator=g)}
    rule = InferenceConfig(rule="threshold", param=0.5)
    export_stop_model(sm, rule, {k: v[:2] for k, v in inputs.items()}, tmp_path / "exp")
    rt = load(tmp_path / "exp")
    assert [i["name"] for i in rt.inputs] == ["inputs.a", "inputs.b"]
    with torch.no_grad():
        ref = sm(inputs, rule=rule.make_rule(sm.policy))
    got = rt.run({k: v.numpy() for k, v in inputs.items()})
    assert ref.stop_times.unique().numel() >= 2
    np.testing.assert_array_equal(got.stop_times, ref.stop_times.numpy())
    for key in ("mean", "x"):
        np.testing.assert_allclose(got.outputs[key], ref.outputs[key].numpy(), atol=1e-5, rtol=1e-5)
    out, t = rt.run_one({k: v[3].numpy() for k, v in inputs.items()})
    assert t == int(ref.stop_times[3]) and out["x"].shape == (4,)


class CachingModel(nn.Module):
    """A state leaf ("cache") that no later step reads: the exporter drops it from the step graphs' inputs."""

    num_steps = 4

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def initial_state(self, x):
        return {"cache": x * 0, "h": x * 0}

    def step(self, t, state, x):
        h = torch.tanh(self.lin(state["h"]) + x)
        return {"cache": 2 * h, "h": h}

    def readout(self, t, state, x):
        return state["cache"]


class SumPolicy(nn.Module):
    def forward(self, x, output, t):
        return output.sum(1)


def test_a_state_leaf_no_step_reads(tmp_path):
    torch.manual_seed(6)
    sm = StoppingModel(CachingModel(), SumPolicy()).eval()
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(6))
    times = _same_as_torch(sm, x, InferenceConfig(rule="threshold", param=0.5), tmp_path / "exp")
    assert times.unique().numel() >= 2
    assert [s["inputs"] for s in load(tmp_path / "exp").manifest["steps"]][1] == ["state.1", "inputs"]


@pytest.mark.parametrize("rule,param", [("quantile", 0.5), ("price", 3.0)])
def test_planning_policy_fixes_the_depth_once(sparse_sm, tmp_path, rule, param):
    sm, y = sparse_sm
    planner = TinyPlanner(27, 7, plan_step=3)
    randomise(planner, 4)
    planned = StoppingModel(sm.model, planner).eval()
    times = _same_as_torch(planned, y, InferenceConfig(rule=rule, param=param), tmp_path / "exp")
    assert times.unique().numel() >= 2 and int(times.min()) >= 3
    m = json.loads((tmp_path / "exp" / "manifest.json").read_text())
    assert [s["policy"] for s in m["steps"]] == [None, None, "plan", None, None, None, None]


@pytest.mark.parametrize("price", [-40.0, -3.0, 0.0, 0.7, 5.0, 60.0])
def test_the_runtime_price_rule_reads_the_plan_by_argmax_as_the_envelope_says(price):
    """Online the numpy price rule takes argmax_{s >= t} log q(s) - price s / T, the first crossing of its offline
    scores (the O(T^3) envelope), for plans made at any step t; +inf never stops early, for a second plan too."""
    from learn2stop.runtime.rules import PriceRule

    g = np.random.default_rng(int(abs(price) * 10))
    rule = PriceRule(-price)
    for t in (1, 3, 6):
        plan = (g.normal(size=(200, 9)) * 3).astype(np.float32)
        plan[:, :t - 1] = -50.0  # the runner's "cannot stop any more" before the plan step
        by_scores = _first_crossing(rule, plan)
        np.testing.assert_array_equal(rule.plan_stop_steps(plan, t), np.maximum(by_scores, t))
    assert (PriceRule(float("inf")).plan_stop_steps(plan, 2) == 10).all()
    assert (PriceRule(float("inf")).replan_stop_steps(g.normal(size=(5, 10)).astype(np.float32), 4) == 10).all()


def _first_crossing(rule, plan: np.ndarray) -> np.ndarray:
    """The base rule's reading: the first step whose score reaches the threshold (T if none)."""
    from learn2stop.runtime.rules import Rule

    return Rule.plan_stop_steps(rule, plan)


def test_fixed_depth_exports_only_the_steps_it_runs(sparse_sm, tmp_path):
    sm, y = sparse_sm
    export_stop_model(sm, {"name": "fixed", "param": 4}, y[:2], tmp_path / "exp")
    rt = load(tmp_path / "exp")
    got = rt.run(y.numpy())
    with torch.no_grad():
        ref = sm.unroll(y, keep_outputs=True).step_outputs[3]
    assert (got.stop_times == 4).all() and sorted(p.name for p in (tmp_path / "exp").glob("*.onnx")) == \
        [f"step_0{t}.onnx" for t in range(1, 5)]
    np.testing.assert_allclose(got.outputs, ref.numpy(), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def exported(sparse_sm, tmp_path_factory):
    sm, y = sparse_sm
    folder = tmp_path_factory.mktemp("exp") / "sparse"
    export_stop_model(sm, InferenceConfig(rule="quantile", param=0.5), y[:2], folder, task="sparse")
    return folder, y


def test_the_runtime_imports_and_runs_without_torch(exported):
    folder, y = exported
    np.save(folder.parent / "y.npy", y.numpy())
    code = f"""
import sys
class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is hidden")
sys.meta_path.insert(0, HideTorch())
import numpy as np
from learn2stop.runtime import load
r = load({str(folder)!r}).run(np.load({str(folder.parent / 'y.npy')!r}))
assert "torch" not in sys.modules
print(",".join(map(str, r.stop_times)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ",".join(map(str, load(folder).run(y.numpy()).stop_times))


def test_corrupt_manifest_and_changed_graphs_are_refused(exported, tmp_path):
    import shutil

    folder, _ = exported
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "step_02.onnx").write_bytes((bad / "step_02.onnx").read_bytes() + b"\0")
    with pytest.raises(ManifestError, match="step_02.onnx does not match its sha256"):
        load(bad)
    (bad / "step_02.onnx").unlink()
    with pytest.raises(ManifestError, match="step_02.onnx is missing"):
        load(bad)
    (bad / "manifest.json").write_text('{"format": "learn2stop-onnx", "version": 1, "num_')
    with pytest.raises(ManifestError, match="manifest.json is corrupt"):
        load(bad)
    m = json.loads((folder / "manifest.json").read_text())
    m["rule"]["name"] = "sampled"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="'rule.name' must name one of"):
        load(bad)
    m = json.loads((folder / "manifest.json").read_text())
    del m["steps"][1]["readout"]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"'steps\[1\].readout' is missing"):
        load(bad)


def test_bad_inputs_are_refused_naming_the_input(exported):
    folder, y = exported
    rt = load(folder)
    x = y[:3].numpy()
    with pytest.raises(ValueError, match=r"input 'inputs': expected shape \(B, 13\)"):
        rt.run(x[:, :5])
    with pytest.raises(ValueError, match="input 'inputs': expected dtype float32; got float64"):
        rt.run(x.astype(np.float64))
    nan = x.copy()
    nan[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"input 'inputs': NaN or inf values in 1 sample"):
        rt.run(nan)
    with pytest.raises(ValueError, match="inputs: expected"):
        rt.run({"y": x})
    with pytest.raises(TypeError, match="must be a numpy array"):
        rt.run(x.tolist())


def test_export_refuses_what_it_cannot_write(sparse_sm, exported, tmp_path):
    sm, y = sparse_sm
    folder, _ = exported
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not an earlier export"):
        export_stop_model(sm, InferenceConfig(), y[:2], other)
    assert (other / "keep.txt").read_text() == "mine" and len(list(other.iterdir())) == 1
    with pytest.raises(ExportError, match="needs a stopping policy"):
        export_stop_model(StoppingModel(sm.model), InferenceConfig(), y[:2], tmp_path / "nopolicy")
    with pytest.raises(ExportError, match="needs a planning policy"):
        export_stop_model(sm, {"name": "price", "param": 1.0}, y[:2], tmp_path / "price")
    with pytest.raises(ExportError, match="inference.sampled"):
        export_stop_model(sm, InferenceConfig(sampled=True), y[:2], tmp_path / "sampled")
    with pytest.raises(ExportError, match="threshold -inf"):  # stops everything at once: no 'never stops early'
        export_stop_model(sm, {"name": "threshold", "param": 0.0, "threshold": -math.inf}, y[:2], tmp_path / "ninf")
    wrong = StoppingModel(sm.model, TinyPlanner(27, 8, plan_step=3)).eval()  # a plan of 7 logits for T = 7
    with pytest.raises(ExportError, match=r"planning policy at step 3: must return \(B, 6\) stop logits; got shape \(2, 7\)"):
        export_stop_model(wrong, {"name": "price", "param": 1.0}, y[:2], tmp_path / "wrong")
    assert not any((tmp_path / d).exists() for d in ("nopolicy", "sampled", "price", "wrong"))
    assert not [p for p in tmp_path.iterdir() if "export-tmp" in p.name]
    # an earlier export is replaced, complete, by the new one
    export_stop_model(sm, {"name": "fixed", "param": 2}, y[:2], folder)
    assert load(folder).manifest["rule"]["name"] == "fixed" and not (folder / "step_05.onnx").exists()
    export_stop_model(sm, InferenceConfig(rule="quantile", param=0.5), y[:2], folder, task="sparse")


TINY = ["--problem.m", "13", "--problem.n", "27", "--problem.test_per_snr", "20", "--problem.val_per_snr", "20",
        "--lista.num_steps", "5", "--policy.sketch_dim", "4", "--run_stage3", "false", "--run_aevb", "false",
        "--no-progress", "--threads", "1",
        *[a for s in ("baseline", "stage1", "stage2") for a in (f"--{s}.iterations", "4", f"--{s}.batch_size", "16",
                                                               f"--{s}.eval_every", "4", f"--{s}.checkpoint_every", "4")]]


def test_cli_exports_a_trained_run_and_refuses_an_unfinished_one(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "exported"
    run.mkdir()
    assert main(["sparse", "export", "--run-dir", str(run), "--out", str(out), *TINY]) == 2
    assert "no finished stage 'stage2'" in capsys.readouterr().err and not out.exists()
    assert main(["sparse", "train", "--run-dir", str(run), *TINY]) == 0
    assert main(["sparse", "export", "--run-dir", str(run), *TINY]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["sparse", "export", "--run-dir", str(run), "--out", str(out), *TINY]) == 0
    m = load(out).manifest
    assert m["task"] == "sparse" and m["rule"]["name"] == "price" and m["rule"]["source"] == "inference config"
    # the runtime on the task's test inputs: the run's own stop model and rule, loaded the CLI's way
    from learn2stop.cli import build_parser
    from learn2stop.core.train import load_stage
    from learn2stop.tasks.sparse.app import APP
    from learn2stop.tasks.sparse.config import PRESETS, SparseConfig
    from learn2stop.utils.config_flags import overrides_from_args
    from learn2stop.utils.config_files import resolve

    cfg = resolve(SparseConfig, PRESETS["quick"], None, overrides_from_args(build_parser("sparse", "export").parse_args(TINY)))
    sm = load_stage(APP, cfg, run, "stage2", "cpu")
    y = APP.eval_batches(cfg, "test", "cpu")[0][0]
    with torch.no_grad():
        ref = sm(y, inference=cfg.inference)
    got = load(out).run(y.numpy())
    np.testing.assert_array_equal(got.stop_times, ref.stop_times.numpy())
    np.testing.assert_allclose(got.outputs, ref.outputs.numpy(), atol=1e-5, rtol=1e-5)
    # calibrated: the export takes the run's calibration.json, and replaces the earlier export
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", *TINY]) == 0
    assert main(["sparse", "export", "--run-dir", str(run), "--out", str(out), *TINY]) == 0
    cal = json.loads((run / "calibration.json").read_text())
    m = load(out).manifest
    assert m["rule"]["source"] == "calibration.json" and m["rule"]["threshold"] == pytest.approx(cal["threshold"])
    from learn2stop.core.calibration_file import load_calibration

    with torch.no_grad():
        ref = sm(y, rule=load_calibration(run).make_rule(sm.policy))
    np.testing.assert_array_equal(load(out).run(y.numpy()).stop_times, ref.stop_times.numpy())
    from learn2stop.export import export_command
    from learn2stop.tasks.maml.app import APP as MAML
    from learn2stop.utils.config import ConfigError

    with pytest.raises(ConfigError, match="no gradient operator"):
        export_command(MAML, None, None, out=str(tmp_path / "maml"))


def test_runtime_speed_benchmark_runs_on_a_tiny_config(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "runtime_speed.py"
    spec = importlib.util.spec_from_file_location("runtime_speed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--tiny", "--tasks", "sparse,denoise,maml", "--json", str(tmp_path / "speed.json")])
    assert res["maml"]["stop_times_agree"] is None  # its steps do not export: the torch variants only
    assert "ONNX Runtime runner" not in {r["variant"] for r in res["maml"]["rows"]} and len(res["maml"]["rows"]) == 15
    rows = res["sparse"]["rows"]
    assert res["sparse"]["stop_times_agree"] is True and res["denoise"]["stop_times_agree"] is True
    assert {r["variant"] for r in rows} == {"plain for-t loop", "unroll", "run_with_early_exit", "ONNX Runtime runner",
                                            "early exit, device mode (compact every 4)", "early exit, stop times given"}
    device = {r["batch"]: r["mean_depth"] for r in rows if r["variant"].startswith("early exit, device")}
    given = [r for r in rows if r["variant"] == "early exit, stop times given"]
    early = {r["batch"]: r["mean_depth"] for r in rows if r["variant"] == "run_with_early_exit"}
    assert all(r["mean_depth"] == early[r["batch"]] for r in given)  # the same decisions, made in advance
    assert device == early  # and without a sync per step
    assert {r["batch"] for r in rows} == {1, 4, 8} and all(r["ms_per_sample"] > 0 for r in rows)
    assert json.loads((tmp_path / "speed.json").read_text())["sparse"]["rule"]["name"] == "quantile"
    assert "ONNX Runtime runner" in capsys.readouterr().out

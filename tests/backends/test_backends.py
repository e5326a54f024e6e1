"""Backends: the same early exit in eager torch, under torch.compile and in ONNX Runtime, and the CLI's --backend."""
import json
import math

import pytest
import torch

from learn2stop.backends import BACKENDS, BackendError, CompiledRunner, StreamRunner, make_runner, parse_backends
from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.policy_signals import PolicyRule, PriceSignal, QuantileSignal
from learn2stop.core.rules import FixedDepth, SignalRule, StopAtTimes
from learn2stop.core.signals import ToleranceRule
from learn2stop.core.model import StoppingModel


@pytest.fixture(scope="module")
def lista(tiny_lista):
    model, policy, _, y = tiny_lista
    return StoppingModel(model, policy).eval(), y


def _rules(sm):
    return [FixedDepth(), FixedDepth(3), ToleranceRule(0.05), PolicyRule(sm.policy, threshold=0.4),
            SignalRule(QuantileSignal(sm.policy), QuantileSignal.from_param(0.5)),
            SignalRule(QuantileSignal(sm.policy), math.inf)]


def test_parse_backends_names_the_choices():
    assert parse_backends(None) == ["torch"] and parse_backends("torch, onnxruntime") == ["torch", "onnxruntime"]
    for bad in ("tensorrt", "torch,torch", ","):
        with pytest.raises(BackendError, match="--backend"):
            parse_backends(bad)
    assert make_runner("torch") is run_with_early_exit and set(BACKENDS) == {"torch", "compile", "stream", "onnxruntime"}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_registered_backend_runs_the_torch_loops_early_exit(name, lista):
    """One check over the registry: each backend's runner gives eager torch's stop times and outputs."""
    if name == "onnxruntime":
        pytest.importorskip("onnxruntime")
    sm, y = lista
    runner = make_runner(name)
    with torch.no_grad():
        for rule in (FixedDepth(), FixedDepth(3), PolicyRule(sm.policy, threshold=0.4)):
            ref, got = run_with_early_exit(sm.model, y, rule), runner(sm.model, y, rule)
            assert torch.equal(got.stop_times, ref.stop_times), (name, rule)
            torch.testing.assert_close(got.outputs, ref.outputs, atol=1e-5, rtol=1e-5)


def test_parse_backends_refuses_empty_names_instead_of_reading_them_as_torch():
    for bad in ("", "torch,,", ",torch", " "):
        with pytest.raises(BackendError, match=r"--backend: .*\(an empty name\)"):
            parse_backends(bad)
    with pytest.raises(BackendError, match=r"\(unknown 'tensorrt'\)"):
        parse_backends("torch,tensorrt")


def test_maml_on_onnxruntime_gives_the_reason_export_gives(tmp_path, capsys):
    from learn2stop.cli import main
    from learn2stop.tasks.maml.app import APP

    for command in ("evaluate", "frontier"):
        assert main(["maml", command, "--run-dir", str(tmp_path / "run"), "--backend", "onnxruntime"]) == 2
        err = capsys.readouterr().err
        assert f"--backend onnxruntime: {APP.export_unsupported}" in err and "data pointer" not in err, err
    assert main(["maml", "export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert f"export: {APP.export_unsupported}" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_stream_runner_gives_the_torch_loops_stop_times_and_outputs(lista, tiny_lista):
    from learn2stop.core.timing import measure_speed

    sm, y = lista
    planner = tiny_lista[2]
    for rule in [*_rules(sm), SignalRule(PriceSignal(planner), PriceSignal.from_param(0.5))]:
        with torch.no_grad():
            ref = run_with_early_exit(sm.model, y, rule)
            for max_batch in (None, 3):  # one step call for every running row, or at most 3 (refilled)
                got = make_runner("stream")(sm.model, y, rule, max_batch=max_batch)
                assert torch.equal(got.stop_times, ref.stop_times), rule
                torch.testing.assert_close(got.outputs, ref.outputs)
    with pytest.raises(BackendError, match="compact_every"):
        StreamRunner()(sm.model, y, FixedDepth(), compact_every=2)

    calls = []

    class Counting(StreamRunner):  # measure_speed hands a stream every input at once, the batch as its max batch
        def __call__(self, model, inputs, rule, max_batch=None, **kw):
            calls.append((inputs.shape[0], max_batch))
            return super().__call__(model, inputs, rule, max_batch=max_batch, **kw)

    assert measure_speed(sm.model, y, lambda: FixedDepth(), 4, repeats=2, runner=Counting()) > 0
    assert calls == [(min(8, y.shape[0]), 4), (y.shape[0], 4), (y.shape[0], 4)]  # a short warm-up, then every input


def test_onnxruntime_runner_gives_the_torch_loops_stop_times_and_outputs(lista):
    pytest.importorskip("onnxruntime")
    sm, y = lista
    runner = make_runner("onnxruntime")
    with torch.no_grad():
        for rule in _rules(sm):
            ref = run_with_early_exit(sm.model, y, rule)
            got = runner(sm.model, y, rule)
            assert torch.equal(got.stop_times, ref.stop_times), type(rule).__name__
            torch.testing.assert_close(got.outputs, ref.outputs, atol=1e-5, rtol=1e-5)
        exports = len(runner._runtimes)
        other = runner(sm.model, y, PolicyRule(sm.policy, threshold=0.7))  # another threshold: the same graphs
        assert len(runner._runtimes) == exports
        assert torch.equal(other.stop_times, run_with_early_exit(sm.model, y, PolicyRule(sm.policy, threshold=0.7)).stop_times)


def test_onnxruntime_runner_plans_with_a_planning_policy(tiny_lista):
    pytest.importorskip("onnxruntime")
    model, _, planner, y = tiny_lista
    sm = StoppingModel(model, planner).eval()
    runner = make_runner("onnxruntime")
    with torch.no_grad():
        for price in (0.0, 2.0):
            rule = SignalRule(PriceSignal(planner), PriceSignal.from_param(price))
            ref, got = run_with_early_exit(sm.model, y, rule), runner(sm.model, y, rule)
            assert torch.equal(got.stop_times, ref.stop_times)
            torch.testing.assert_close(got.outputs, ref.outputs, atol=1e-5, rtol=1e-5)


def test_onnxruntime_runner_refuses_what_the_runtime_cannot_run(lista):
    pytest.importorskip("onnxruntime")
    sm, y = lista
    runner = make_runner("onnxruntime")
    with pytest.raises(BackendError, match="sampled"):
        runner(sm.model, y, PolicyRule(sm.policy, mode="sample"))
    with pytest.raises(BackendError, match="StopAtTimes"):
        runner(sm.model, y, StopAtTimes(torch.full((41,), 2)))


def test_compiled_runner_matches_eager(lista):
    sm, y = lista
    runner = CompiledRunner()
    with torch.no_grad():
        for rule in (FixedDepth(), PolicyRule(sm.policy, threshold=0.4)):
            ref, got = run_with_early_exit(sm.model, y, rule), runner(sm.model, y, rule)
            assert torch.equal(got.stop_times, ref.stop_times)
            torch.testing.assert_close(got.outputs, ref.outputs, atol=1e-5, rtol=1e-5)
    assert len(runner._compiled) == 1  # compiled once per model


def test_frontier_measures_every_backend_side_by_side_and_evaluate_runs_on_one(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from learn2stop.cli import main
    from conftest import TINY

    tiny = [*TINY, "--run_aevb", "false", "--run_stage3", "false"]
    run = tmp_path / "run"
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", *tiny]) == 0
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", "--backend", "onnxruntime", *tiny]) == 2
    assert "--backend" in capsys.readouterr().err
    assert main(["sparse", "evaluate", "--run-dir", str(run), "--backend", "torch,onnxruntime", *tiny]) == 2
    assert "evaluate runs on one backend" in capsys.readouterr().err
    assert main(["sparse", "frontier", "--run-dir", str(run), "--backend", "tensorrt", *tiny]) == 2
    assert "tensorrt" in capsys.readouterr().err

    assert main(["sparse", "evaluate", "--run-dir", str(run), "--no-progress", *tiny]) == 0
    eager = json.loads((run / "results.json").read_text())
    assert main(["sparse", "evaluate", "--run-dir", str(run), "--no-progress", "--backend", "onnxruntime", *tiny]) == 0
    onnx = json.loads((run / "results.json").read_text())
    for label, value in eager["rows"].items():  # the deployed rows come from the runtime: equal quality
        assert onnx["rows"][label] == pytest.approx(value, abs=1e-3), label
    assert onnx["depth"] == eager["depth"]  # the same stop times

    assert main(["sparse", "frontier", "--run-dir", str(run), "--no-progress", "--backend", "torch,stream,onnxruntime",
                 *tiny]) == 0
    fr = json.loads((run / "frontier.json").read_text())
    assert fr["backends"] == ["torch", "stream", "onnxruntime"] and fr["backend"] == "torch"
    for name in ("fixed_depth", "tolerance", "policy"):
        for p in fr["curves"][name]:
            assert p["speeds"]["onnxruntime"]["samples_per_s_batch1"] > 0 and p["speeds"]["stream"]["samples_per_s_batchN"] > 0
            assert p["samples_per_s_batch1"] == p["speeds"]["torch"]["samples_per_s_batch1"]
    assert set(fr["speed_at_quality_by_backend"]["onnxruntime"]) >= {"fixed_depth", "policy"}
    assert set(fr["speed_at_quality_by_backend"]["stream"]) >= {"fixed_depth", "policy"}
    md = (run / "frontier.md").read_text()
    assert "backend onnxruntime (speed-ups against baseline at full depth in torch)" in md

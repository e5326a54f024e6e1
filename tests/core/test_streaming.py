"""The streaming runner: per-step queues refilled as requests arrive give every request the stop time and
output of the batch loop, with any rule (planned, per-step, with memory), at any arrival pattern."""
import math

import pytest
import torch

from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.policy_signals import PolicyRule, PriceSignal, QuantileSignal
from learn2stop.core.rules import FixedDepth, SignalRule
from learn2stop.core.signals import PatienceSignal, ToleranceRule
from learn2stop.core.streaming import StreamingRunner
from learn2stop.tasks.classify.models import build_network

from conftest import randomise


def _stream(model, rule, x, max_batch, pattern=(5, 3)):
    """Submit ``pattern[0]`` requests, tick ``pattern[1]`` times, repeat; then drain."""
    runner = StreamingRunner(model, rule, max_batch=max_batch, capacity=64)
    ids, i = [], 0
    while i < x.shape[0]:
        for _ in range(pattern[0]):
            if i < x.shape[0]:
                ids.append(runner.submit(x[i:i + 1]))
                i += 1
        for _ in range(pattern[1]):
            runner.tick()
            # the requests per queue, kept as chunks come and go, are what the queues hold
            assert runner._rows == [sum(len(c) for c in q) for q in runner.queues]
    runner.run_until_idle()
    assert runner.in_flight == 0 and len(runner.finished) == x.shape[0]
    return runner, ids


@pytest.mark.parametrize("make", [
    lambda p, q: FixedDepth(4), lambda p, q: FixedDepth(), lambda p, q: ToleranceRule(0.2),
    lambda p, q: PolicyRule(p, threshold=0.4), lambda p, q: SignalRule(QuantileSignal(p), QuantileSignal.from_param(0.6)),
    lambda p, q: SignalRule(PriceSignal(q), PriceSignal.from_param(0.5)), lambda p, q: PolicyRule(q, threshold=0.3),
], ids=["fixed4", "full", "tolerance", "threshold", "quantile-memory", "price-planned", "threshold-planned"])
@pytest.mark.parametrize("max_batch,pattern", [(7, (5, 3)), (3, (6, 1)), (64, (41, 0)), (1, (2, 5))])
def test_every_request_gets_the_batch_loops_stop_and_output(tiny_lista, make, max_batch, pattern):
    model, policy, planner, x = tiny_lista
    with torch.no_grad():
        ref = run_with_early_exit(model, x, make(policy, planner))
    runner, ids = _stream(model, make(policy, planner), x, max_batch, pattern)
    times = torch.tensor([runner.finished[r].stop_time for r in ids])
    assert torch.equal(times, ref.stop_times)
    torch.testing.assert_close(torch.cat([runner.finished[r].output for r in ids]), ref.outputs)
    assert runner.rows_run == int(ref.stop_times.sum())  # no padding: each request runs its own steps only
    if max_batch > 1 and pattern[1] > 0:
        assert runner.steps_run < runner.rows_run  # requests shared step calls


def test_patience_memory_is_kept_per_slot_on_a_cnn():
    torch.manual_seed(0)
    net = build_network("vgg6-narrow", 5, 16, fc_width=16).eval()
    randomise(net.heads, 7)
    x = torch.randn(23, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    rule = lambda: SignalRule(PatienceSignal(), 1)
    with torch.no_grad():
        ref = run_with_early_exit(net, x, rule())
    runner, ids = _stream(net, rule(), x, 4, (3, 2))
    assert [runner.finished[r].stop_time for r in ids] == ref.stop_times.tolist()
    assert len(set(ref.stop_times.tolist())) > 1  # the rule did stop at different exits


def test_refusals_name_the_problem(tiny_lista):
    model, policy, _, x = tiny_lista
    with pytest.raises(ValueError, match="max_batch"):
        StreamingRunner(model, FixedDepth(), max_batch=0)
    runner = StreamingRunner(model, FixedDepth(), capacity=2)
    with pytest.raises(ValueError, match="one request"):
        runner.submit(x[:2])
    runner.submit(x[:1]), runner.submit(x[1:2])
    with pytest.raises(RuntimeError, match="capacity"):
        runner.submit(x[2:3])
    runner.run_until_idle()
    assert runner.submit(x[2:3]) == 2  # slots come back when requests finish
    with pytest.raises(TypeError, match="stop rule"):
        StreamingRunner(model, "quantile")
    assert math.isfinite(runner.finished[0].latency)


def test_streaming_benchmark_runs_on_a_tiny_config(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "streaming.py"
    spec = importlib.util.spec_from_file_location("bench_streaming_tiny", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--tiny", "--tasks", "sparse,maml", "--loads", "0.8", "--json", str(tmp_path / "s.json")])
    for task, T in (("sparse", 5), ("maml", 3)):  # a tensor per request, and a tree (a task's support and query sets)
        rows = res[task]["rows"]
        assert [r["server"] for r in rows] == ["full depth, batched", "early exit, batch then shrink", "early exit, streaming"]
        assert rows[0]["mean_depth"] == T and all(r["throughput"] > 0 and r["p95_ms"] >= r["p50_ms"] for r in rows)
        assert rows[1]["mean_depth"] == rows[2]["mean_depth"]  # the same rule, the same stops
    assert json.loads((tmp_path / "s.json").read_text())["sparse"]["rows"][0]["server"] == "full depth, batched"


def test_the_stream_reads_the_model_out_only_where_the_loop_does():
    from test_planned_loop import ReadCounting

    torch.manual_seed(0)
    model, x = ReadCounting(num_steps=6), torch.randn(11, 3)
    for rule, want in ((FixedDepth(), {6: 11}), (FixedDepth(4), {4: 11})):
        model.read = {}
        runner, ids = _stream(model, rule, x, max_batch=4)
        assert model.read == want and {runner.finished[i].stop_time for i in ids} == set(want)
        torch.testing.assert_close(torch.cat([runner.finished[i].output for i in ids]),
                                   run_with_early_exit(model, x, rule).outputs)

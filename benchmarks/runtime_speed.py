"""Inference speed of one stop model five ways, side by side in one process: the plain ``for t`` loop over
the steps (full depth), ``unroll`` (full depth), ``run_with_early_exit`` with the deployed rule (synchronising,
and in device mode: ``compact_every=4``), and the exported model in ONNX Runtime (:mod:`learn2stop.runtime`)
with the same rule, at batch 1, 64 (8 denoise, 10 maml) and a large batch (1000 sparse, 256 classify, 64 denoise,
100 maml; MAML's inner gradient steps do not export, so maml has the torch variants only).

    python benchmarks/runtime_speed.py --threads 1                       # random weights, quick sizes
    python benchmarks/runtime_speed.py --sparse-run runs/final-sparse --classify-run runs/classify-quick
    python benchmarks/runtime_speed.py --tiny                            # a smoke run (the tests use it)

Sizes: sparse is the quick preset's LISTA-stop (125x250, T = 16, its planning policy; ``--sparse-policy
sketch`` for the policy asked at every step) on the preset's test problems; classify the quick
preset's network (vgg6-narrow, 32x32, 10 classes, 5 exits and the exit policy); denoise the quick preset's
DnCNN-stop on 64x64 noisy textures (a run's own test images with ``--denoise-run``). Without a run directory
the weights are random (LISTA from ISTA) and the policy's output bias is set (``--random-bias``; by default
the bias whose constant pi_t makes the default rule, quantile alpha 0.5, stop at about 65 % of T) so that it
stops part-way; with one, the run's stop stage and its deployed rule
(``calibration.json`` or its inference config) are used, on its test inputs. Each time is the best of
``--rounds`` round-robin passes (a load drift hits every variant alike); batch 1 is timed over
``--samples`` inputs one by one. Needs the deploy extra (onnx, onnxruntime).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from learn2stop.core.calibration_file import load_calibration
from learn2stop.core.inference import InferenceConfig
from learn2stop.core.loop import run_with_early_exit, unroll
from learn2stop.core.model import StoppingModel
from learn2stop.core.rules import StopAtTimes
from learn2stop.core.trees import batch_size, tree_map
from learn2stop.export import export_stop_model
from learn2stop.tasks.base import get_task
from learn2stop.runtime import load
from learn2stop.utils.report import markdown_table


# ----------------------------------------------------------------------------- the models
def _last_linear(module: nn.Module) -> nn.Linear:
    return [m for m in module.modules() if isinstance(m, nn.Linear)][-1]


def _from_run(task: str, run_dir: str):
    """(stop model, rule, test inputs) of a trained run: its stop stage, its deployed rule."""
    from learn2stop.core.train import load_stage
    from learn2stop.tasks.base import get_task
    from learn2stop.utils.config_files import resolve

    spec = get_task(task)
    cfg = resolve(spec.config_class, {}, str(Path(run_dir) / "config.yaml"))
    sm = load_stage(spec.app, cfg, run_dir, spec.app.stop_stage, "cpu")
    inference = spec.app.inference(cfg)
    cal = load_calibration(run_dir) if inference.use_calibrated else None
    inputs = spec.app.speed_inputs(cfg, "cpu")  # the test inputs of the most common shape, as one batch
    return sm, (cal if cal is not None else inference), inputs


def auto_bias(T: int, depth_fraction: float = 0.65) -> float:
    """The logit of a constant pi whose quantile-0.5 stop step is about ``depth_fraction`` of T."""
    pi = 1 - 0.5 ** (1 / max(depth_fraction * (T - 1), 1))
    return math.log(pi / (1 - pi))


def _set_bias(policy: nn.Module, bias: float | None, T: int) -> None:
    nn.init.constant_(_last_linear(policy).bias, auto_bias(T) if bias is None else bias)


def sparse_model(tiny: bool, bias: float | None, n: int, features: str = "plan"):
    """LISTA-stop as the quick preset builds it (ISTA-initialised LISTA and its policy: by default the
    planning policy), and n of the preset's test problems."""
    from learn2stop.tasks.sparse.app import APP
    from learn2stop.tasks.sparse.config import preset

    small = {"problem": {"m": 13, "n": 27, "test_per_snr": 10, "val_per_snr": 10}, "lista": {"num_steps": 5},
             "policy": {"sketch_dim": 4, "hidden": [8]}} if tiny else {}
    cfg = preset("quick", **{**small, "policy": {**small.get("policy", {}), "features": features}})
    sm = APP.build_models(cfg, "cpu")["stop"].eval()
    _set_bias(sm.policy, bias, sm.num_steps)
    y = torch.cat([b[0] for b in APP.eval_batches(cfg, "test", "cpu")])
    return sm, InferenceConfig(), y[:n] if y.shape[0] >= n else y.repeat(n // y.shape[0] + 1, 1)[:n]


def classify_model(tiny: bool, bias: float | None, n: int):
    """The quick preset's network (vgg6-narrow with 5 exits) and its exit policy; n random images."""
    from learn2stop.tasks.classify.models import build_network
    from learn2stop.core.policies import ExitPolicy

    size, classes = (16, 3) if tiny else (32, 10)
    torch.manual_seed(0)
    net = build_network("vgg6-narrow", classes, size, **({"fc_width": 16} if tiny else {}))
    policy = ExitPolicy(classes, net.num_steps, hidden=8 if tiny else 32)
    _set_bias(policy, bias, net.num_steps)
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))
    return StoppingModel(net, policy).eval(), InferenceConfig(), x


def denoise_model(tiny: bool, bias: float | None, n: int):
    """The quick preset's DnCNN-stop (its exits and policy) and n noisy random-texture images of 64x64 (32x32 tiny)."""
    from learn2stop.tasks.denoise.config import preset

    cfg = preset("quick", **({"model": {"depth": 5, "channels": 8, "outputs": [2, 3], "policy_hidden": 8}} if tiny else {}))
    from learn2stop.tasks.denoise.app import APP

    sm = APP.build_models(cfg, "cpu")["stop"].eval()
    nn.init.zeros_(_last_linear(sm.policy).weight)  # random image statistics would saturate it: a constant pi_t
    _set_bias(sm.policy, bias, sm.num_steps)
    size = 32 if tiny else 64
    g = torch.Generator().manual_seed(1)
    clean = torch.nn.functional.avg_pool2d(torch.rand(n, 1, size + 3, size + 3, generator=g), 4, stride=1)
    return sm, InferenceConfig(), clean + 0.1 * torch.randn(n, 1, size, size, generator=g)


def maml_model(tiny: bool, bias: float | None, n: int):
    """The quick preset's MAML-stop (sinusoid regression, its policy) and n of its test tasks (dict inputs)."""
    from learn2stop.tasks.maml import APP, preset

    cfg = preset("quick", **({"model": {"hidden": 8, "inner_steps": 3}, "eval": {"tasks": 8, "val_tasks": 4}}
                             if tiny else {}))
    sm = APP.build_models(cfg, "cpu")["stop"].eval()
    _set_bias(sm.policy, bias, sm.num_steps)
    return sm, InferenceConfig(), APP.speed_inputs(cfg, "cpu")


def _rows(x, i: int, j: int):
    return tree_map(lambda v: v[i:j], x)


def task_model(task: str, run: str | None, tiny: bool, n: int, bias: float | None = None, sparse_policy: str = "plan"):
    """(stop model, rule, inputs, where they come from): a trained run's, or random weights of the quick sizes."""
    if run:
        return (*_from_run(task, run), f"trained run {run}")
    if task == "sparse":
        sm, rule, inputs = sparse_model(tiny, bias, n, sparse_policy)
    else:
        sm, rule, inputs = {"classify": classify_model, "denoise": denoise_model, "maml": maml_model}[task](tiny, bias, n)
    return sm, rule, inputs, "random weights"


# ----------------------------------------------------------------------------- the five ways
def plain_loop(model, inputs):
    state = model.initial_state(inputs)
    for t in range(1, model.num_steps + 1):
        state = model.step(t, state, inputs)
    return model.readout(model.num_steps, state, inputs)


def torch_rule(sm: StoppingModel, rule):
    """A fresh online rule (rules keep per-rollout memory) of an InferenceConfig or a Calibration."""
    return rule.make_rule(sm.policy)


def variants(sm: StoppingModel, rule, runtime, given: dict | None = None) -> dict:
    """name -> (inputs tensor -> mean depth of that call). ``given``: id(inputs) -> the deployed rule's stop
    times on them, for the loop's own overhead with the decisions made (``StopAtTimes``: a plan before step 1)."""
    m, T = sm.model, sm.num_steps
    given = given or {}

    def planned(x):
        times = given[id(x)]
        run_with_early_exit(m, x, StopAtTimes(times))
        return float(times.float().mean())

    def plain(x):
        plain_loop(m, x)
        return T

    def full(x):
        unroll(m, x)
        return T

    def early(x):
        return float(run_with_early_exit(m, x, torch_rule(sm, rule)).stop_times.float().mean())

    def device_mode(x):  # no host sync between compactions (a planning rule plans instead: the same loop)
        return float(run_with_early_exit(m, x, torch_rule(sm, rule), compact_every=4).stop_times.float().mean())

    def ort(x):
        return runtime.run(x.numpy()).mean_depth

    ways = {"plain for-t loop": plain, "unroll": full, "run_with_early_exit": early,
            "early exit, device mode (compact every 4)": device_mode}
    if runtime is not None:  # a task whose steps export
        ways["ONNX Runtime runner"] = ort
    if given:
        ways["early exit, stop times given"] = planned
    return ways


@torch.inference_mode()  # as a deployment runs, for every variant alike
def measure(sm: StoppingModel, rule, inputs: torch.Tensor, batches: list[int], samples: int, rounds: int,
            runtime) -> list[dict]:
    """Best-of-``rounds`` seconds per sample of every variant at every batch size, round-robin."""
    work, N = {}, batch_size(inputs)
    for b in batches:
        if b == 1:
            work[b] = [_rows(inputs, i, i + 1) for i in range(min(samples, N))]
        else:
            reps = max(1, min(3, N // b))
            work[b] = [_rows(inputs, i * b, (i + 1) * b) for i in range(reps)] if N >= b else [_rows(inputs, 0, b)]
    given = {id(x): run_with_early_exit(sm.model, x, torch_rule(sm, rule)).stop_times for b in batches for x in work[b]}
    ways = variants(sm, rule, runtime, given)
    best = {(b, name): float("inf") for b in batches for name in ways}
    depth = {}
    for _ in range(rounds):
        for b in batches:
            for name, fn in ways.items():
                t0 = time.perf_counter()
                depths = [fn(x) for x in work[b]]
                rows = sum(batch_size(x) for x in work[b])
                best[b, name] = min(best[b, name], (time.perf_counter() - t0) / rows)
                depth[b, name] = sum(d * batch_size(x) for d, x in zip(depths, work[b])) / rows
    out = []
    for b in batches:
        base = best[b, "plain for-t loop"]
        for name in ways:
            ideal = sm.num_steps / depth[b, name]  # the speed-up if only the steps computed cost time
            out.append({"batch": b, "variant": name, "ms_per_sample": 1e3 * best[b, name],
                        "speed_vs_plain": base / best[b, name], "mean_depth": depth[b, name],
                        "share_of_ideal": base / best[b, name] / ideal})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    ap.add_argument("--tasks", default="sparse,classify,denoise,maml")
    ap.add_argument("--sparse-run", default=None, help="a trained sparse run directory (else random weights)")
    ap.add_argument("--classify-run", default=None, help="a trained classify run directory (else random weights)")
    ap.add_argument("--denoise-run", default=None, help="a trained denoise run directory (else random weights)")
    ap.add_argument("--maml-run", default=None, help="a trained maml run directory (else random weights)")
    ap.add_argument("--random-bias", type=float, default=None,
                    help="random weights: the policy's output bias (default: stop at about 65 %% of T)")
    ap.add_argument("--sparse-policy", default="plan", choices=["plan", "sketch", "full"],
                    help="random weights: the sparse policy (the quick preset's is 'plan')")
    ap.add_argument("--samples", type=int, default=200, help="inputs timed one by one at batch 1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and batches: a smoke run")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1; got {args.threads}")
    torch.set_num_threads(args.threads)
    large = {"sparse": 1000, "classify": 256, "denoise": 64, "maml": 100}
    results = {}
    for task in [t for t in args.tasks.split(",") if t]:
        if task not in large:
            ap.error(f"--tasks: unknown task {task!r}; choose from {', '.join(large)}")
        batches = [1, 4, 8] if args.tiny else sorted({1, {"denoise": 8, "maml": 10}.get(task, 64), large[task]})
        n = max(batches) * (1 if args.tiny else 3)
        sm, rule, inputs, source = task_model(task, getattr(args, f"{task}_run"), args.tiny, n, args.random_bias,
                                              args.sparse_policy)
        with tempfile.TemporaryDirectory() as tmp:
            runtime, agree, spec = None, None, {"name": rule.rule, "param": rule.param}
            if not getattr(get_task(task).app, "export_unsupported", None):
                export_stop_model(sm, rule, _rows(inputs, 0, 2), Path(tmp) / "exported", task=task)
                runtime = load(Path(tmp) / "exported", threads=args.threads)
                spec = runtime.rule_spec
            rows = measure(sm, rule, inputs, batches, 4 if args.tiny else args.samples, 1 if args.tiny else args.rounds,
                           runtime)
            if runtime is not None:
                check = runtime.run(inputs[:min(64, inputs.shape[0])].numpy())
                with torch.no_grad():
                    ref = run_with_early_exit(sm.model, inputs[:min(64, inputs.shape[0])], torch_rule(sm, rule))
                agree = bool(np.array_equal(check.stop_times, ref.stop_times.numpy()))
        results[task] = {"source": source, "rule": spec, "rows": rows, "stop_times_agree": agree}
        print(f"\n## {task} ({source}; rule {spec['name']} {spec['param']}; {args.threads} thread(s); "
              + ("no ONNX export: " + get_task(task).app.export_unsupported if runtime is None else
                 f"runtime and torch stop times agree: {agree}") + ")\n")
        print(markdown_table(["batch", "variant", "ms / sample", "speed vs plain loop", "mean depth", "share of ideal"],
                             [[r["batch"], r["variant"], r["ms_per_sample"], r["speed_vs_plain"], r["mean_depth"],
                               r["share_of_ideal"]] for r in rows], digits=3))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

"""Export a trained stop model to ONNX, for :mod:`learn2stop.runtime` (numpy + ONNX Runtime, no torch).

What is written to ``out_dir``:

- ``step_01.onnx`` .. ``step_<last>.onnx``: one graph per step. Step 1 takes the inputs and builds the
  initial state itself; step t > 1 takes the state of step t-1 (and the inputs it reads). Each returns
  the new state (not at the last step), the readout where the rule needs it (every step where a sample
  can stop), and the policy's stop logit where the policy is asked (a planning policy: its (B, T-1)
  plan at ``plan_step``; one that plans twice, also its (B, T) second plan at ``replan_step``, from the
  previous step's output, which that graph takes as ``previous.*`` inputs). One graph per step, not one graph with a loop: compaction then happens
  between ONNX Runtime calls in numpy, and each call runs only the rows still going.
- ``manifest.json``: the task, T, the rule and its parameter (from the run's ``calibration.json`` or the
  inference config), the inputs and outputs (names, shapes with ``null`` for the batch, dtypes), each
  graph's own inputs and outputs, the exit costs and the sha256 of every graph file.

The folder is written to a temporary sibling and renamed into place: nothing is ever half-written.
``out_dir`` must be new, empty or a complete earlier export (:func:`export_mismatch`: its manifest lists
every file in it, each with its sha256); that one is kept at ``<out_dir>.previous`` once the new one is
complete. Anything else is refused before any work (:mod:`learn2stop.utils.outputs`).

The graphs are traced with torch's TorchScript-based exporter (``torch.onnx.export(dynamo=False)``, opset
17): it needs nothing beyond ``onnx`` and drops the inputs a step never reads, which tells the runtime what
to compact. It is deprecated since torch 2.9; a torch without it will need the dynamo exporter (onnxscript).
One op our policies use gets its ONNX form here (``logcumsumexp``).

Example:
    >>> from learn2stop.export import export_stop_model              # doctest: +SKIP
    >>> export_stop_model(sm, {"name": "quantile", "param": 0.5}, y[:2], "exported", task="sparse")
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .core.calibration_file import Calibration
from .core.inference import InferenceConfig
from .core.policy_calls import NEVER_STOP_LOGIT
from .core.steps import check_stepwise
from .core.protocols import member
from .core.trees import check_inputs
from .core.signal_registry import SIGNALS
from .core.signals import DepthSignal
from .runtime.manifest import ManifestError, read_manifest, sha256_file
from .runtime.registry import list_rules
from .utils.config import ConfigError
from .utils.outputs import OutputError, check_output_folder, previous_path, replace_folder, writing
from .utils.outputs import reason as _os_reason

FORMAT = "learn2stop-onnx"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ExportError(ValueError):
    """An export that cannot be made: the message names the file, the rule or the model part."""


# ----------------------------------------------------------------------------- the rule
def rule_spec(rule: Any, source: str = "") -> dict:
    """The deployed rule as the manifest records it: ``{"name", "param", "threshold", "source"}``.

    ``rule`` is an :class:`~learn2stop.core.calibration.InferenceConfig`, a
    :class:`~learn2stop.core.calibration.Calibration`, or a dict ``{"name": ..., "param": ...}``
    (``{"name": "fixed", "param": d}`` stops every sample at step d). ``threshold`` is in the rule's
    score units (what the online rule compares with; see :mod:`learn2stop.core.rules`).
    """
    if isinstance(rule, InferenceConfig):
        if rule.sampled:
            raise ExportError("inference.sampled: the runtime runs deterministic rules only; "
                              "set --inference.sampled false (or calibrate) before exporting")
        name, param, source = rule.rule, float(rule.param), source or "inference config"
        threshold = SIGNALS[name].from_param(param)
    elif isinstance(rule, Calibration):
        name, param, threshold, source = rule.rule, rule.param, rule.threshold, source or "calibration.json"
    elif isinstance(rule, dict) and "name" in rule:
        name, param = rule["name"], rule.get("param")
        if name == "fixed":
            if isinstance(param, bool) or not isinstance(param, int) or param < 1:
                raise ExportError(f"rule 'fixed': param is the depth, an integer >= 1; got {param!r}")
            threshold = None
        elif name in SIGNALS:
            if not isinstance(param, (int, float)) or isinstance(param, bool) or math.isnan(param):
                raise ExportError(f"rule {name!r}: param must be a number; got {param!r}")
            threshold = rule.get("threshold", SIGNALS[name].from_param(float(param)))
        else:
            threshold = None
        source = source or rule.get("source", "given")
    else:
        raise ExportError(f"rule must be an InferenceConfig, a Calibration or a dict with 'name' and 'param'; got {rule!r}")
    if isinstance(rule, (InferenceConfig, Calibration)) and name == "fixed":  # a depth, or full depth (+inf)
        depth = DepthSignal.depth(float(threshold))
        param, threshold = (depth, None) if depth is not None else (None, math.inf)
    runtime_rules = list_rules(runtime=True)  # the rule registry's claim (a test runs each of them)
    if name not in runtime_rules:
        raise ExportError(f"rule {name!r}: the runtime implements {', '.join(runtime_rules)}; "
                          f"calibrate or set --inference.rule to one of them before exporting")
    if threshold is not None:
        threshold = float(threshold)
        if threshold == -math.inf:  # the torch rule stops every sample at its first ask; JSON cannot hold -inf
            raise ExportError(f"rule {name!r}: threshold -inf (param {param!r}) stops every sample at the rule's first "
                              f"step; export that fixed depth instead ({{'name': 'fixed', 'param': <step>}})")
    return {"name": name, "param": param if name == "fixed" else (None if param is None or not math.isfinite(param) else float(param)),
            "threshold": None if threshold is None or not math.isfinite(threshold) else threshold,
            "never_stops_early": threshold is not None and not math.isfinite(threshold), "source": source}


def _plan_step(policy: Any) -> int | None:
    return member(policy, "plan_step")


def _schedule(spec: dict, policy: Any, T: int) -> dict:
    """Which step graphs exist, where the readout, the policy's logit or its plan are computed."""
    name = spec["name"]
    if spec["never_stops_early"]:
        return {"last": T, "readout": [T], "policy": [], "plan": None, "replan": None}
    if name == "fixed":
        last = min(int(spec["param"]), T)
        return {"last": last, "readout": [last], "policy": [], "plan": None, "replan": None}
    if SIGNALS[name].needs_policy:
        if policy is None:
            raise ExportError(f"rule {name!r} needs a stopping policy, but the model has none")
        plan = _plan_step(policy)
        if plan is not None:
            if isinstance(plan, bool) or not isinstance(plan, int) or not 1 <= plan <= T - 1:
                raise ExportError(f"policy.plan_step must be an integer in 1..{T - 1}; got {plan!r}")
            again = member(policy, "replan_step")
            if again is not None and name != "price":
                raise ExportError(f"rule {name!r} reads one plan, and this policy plans again at step {again}: "
                                  "export its price rule")
            if again is not None and (isinstance(again, bool) or not isinstance(again, int) or not plan < again < T):
                raise ExportError(f"policy.replan_step must be an integer in {plan + 1}..{T - 1}; got {again!r}")
            return {"last": T, "readout": list(range(plan, T + 1)), "policy": [], "plan": plan, "replan": again}
        if name == "price":
            raise ExportError("rule 'price' reads a planned q_phi: it needs a planning policy (one with plan_step)")
        first = max(int(member(policy, "min_step")), 1)
        asked = list(range(first, T))
        return {"last": T, "readout": asked + [T], "policy": asked, "plan": None, "replan": None}
    return {"last": T, "readout": list(range(1, T + 1)), "policy": [], "plan": None, "replan": None}


# ----------------------------------------------------------------------------- graphs
class _StepGraph(nn.Module):
    """Step t of a stop model as one traceable function of flat tensors (see the module docstring)."""

    def __init__(self, model: nn.Module, policy: nn.Module | None, t: int, *, n_state: int, in_spec, state_spec,
                 keep_state: bool, readout: bool, policy_kind: str | None, n_in: int = 0, out_spec=None):
        super().__init__()
        self.model, self.policy, self.t = model, policy, t
        self.n_state, self.in_spec, self.state_spec = n_state, in_spec, state_spec
        self.keep_state, self.readout, self.policy_kind = keep_state, readout, policy_kind
        self.n_in, self.out_spec = n_in, out_spec  # a second plan also takes the previous output, after the inputs

    def forward(self, *flat: Tensor):
        state_leaves, input_leaves = flat[:self.n_state], flat[self.n_state:]
        if self.policy_kind == "replan":
            input_leaves, previous = input_leaves[:self.n_in], tree_unflatten(list(input_leaves[self.n_in:]), self.out_spec)
        inputs = tree_unflatten(list(input_leaves), self.in_spec)
        if self.t == 1:
            state = self.model.initial_state(inputs)
        else:
            state = tree_unflatten(list(state_leaves), self.state_spec)
        state = self.model.step(self.t, state, inputs)
        outs = list(tree_flatten(state)[0]) if self.keep_state else []
        if self.readout:
            output = self.model.readout(self.t, state, inputs)
            outs += tree_flatten(output)[0]
            if self.policy_kind == "replan":
                outs.append(self.policy.replan_log_q(inputs, output, previous, self.t))
            elif self.policy_kind is not None:
                outs.append(self.policy(inputs, output, self.t))
        # a graph output must not be a graph input or another output: copy what passes through unchanged
        seen: set[int] = {id(x) for x in flat}
        unique = []
        for x in outs:
            unique.append(x.clone() if id(x) in seen else x)
            seen.add(id(x))
        return tuple(unique)


def _leaf_names(tree: Any, prefix: str) -> list[str]:
    """Names of a tree's tensor leaves: ``prefix`` for a single tensor, ``prefix.<key>`` / ``prefix.<i>`` otherwise."""
    if isinstance(tree, Tensor):
        return [prefix]
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in _leaf_names(v, f"{prefix}.{k}")]
    if isinstance(tree, (list, tuple)):
        return [n for i, v in enumerate(tree) for n in _leaf_names(v, f"{prefix}.{i}")]
    raise ExportError(f"{prefix}: only tensors and dicts/lists/tuples of tensors can be exported; got {type(tree).__name__}")


def _describe(names: list[str], leaves: list[Tensor], dynamic: dict[str, list[int]] | None = None) -> list[dict]:
    """Name, shape (None for the batch and for dims listed in ``dynamic``) and dtype of each leaf."""
    dynamic = dynamic or {}
    return [{"name": n, "shape": [None if d == 0 or d in dynamic.get(n, ()) else int(x.shape[d]) for d in range(x.dim())],
             "dtype": str(x.dtype).replace("torch.", "")} for n, x in zip(names, leaves)]




def _used_inputs(path: Path) -> list[str]:
    """The graph's inputs as ONNX Runtime will ask for them (the exporter drops inputs a step never reads)."""
    import onnx

    return [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]


def export_mismatch(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete export of ours, or None if it is: a valid manifest of this format, every
    file it lists present with its sha256, and nothing else in the folder (only then may an export replace it)."""
    folder = Path(folder)
    try:
        m = read_manifest(folder, verify=True)
    except ManifestError as e:
        return str(e).removesuffix("; export the run again")
    except (OSError, UnicodeDecodeError) as e:
        return f"{folder / MANIFEST} cannot be read ({e.strerror or type(e).__name__})"
    listed = {MANIFEST, *(s["file"] for s in m["steps"])}
    extra = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p.name not in listed)
    if extra:
        return f"it also holds {', '.join(extra[:3])}{' and more' if len(extra) > 3 else ''}, not listed in its {MANIFEST}"
    return None


def check_out_dir(out: str | Path | None, arg: str = "--out", run_dir: str | Path | None = None) -> Path:
    """Check, before any work, the folder an export is written to (:func:`learn2stop.utils.outputs.check_output_folder`):
    a new folder, an empty one or a complete earlier export (kept at ``<out>.previous`` when replaced); never a
    record of ``run_dir``, a file, or a folder holding anything else. Returns it absolute."""
    if not out:
        raise ExportError(f"{arg}: give the folder to write the export to (a new folder, or an earlier export)")
    try:
        return check_output_folder(out, arg, export_mismatch, run_dirs=[run_dir] if run_dir else [], what="export")
    except OutputError as e:
        raise ExportError(str(e)) from None


def _without_extra_state(module: nn.Module) -> nn.Module:
    """The TorchScript exporter reads ``state_dict()`` and fails on non-tensor extra state (a policy's
    ``min_step``): give the copies it traces a class whose extra state is the default (none)."""
    for m in module.modules():
        cls = type(m)
        if getattr(cls, "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state:
            m.__class__ = type(cls.__name__, (cls,), {"get_extra_state": nn.Module.get_extra_state,
                                                      "set_extra_state": nn.Module.set_extra_state})
    return module


_SYMBOLICS: set[int] = set()


def _register_symbolics(opset: int) -> None:
    """ONNX forms of the ops our policies use that the TorchScript exporter lacks: ``logcumsumexp``
    (a planning policy's stop logits from its q_phi) as max + log(cumsum(exp(x - max))), in float64."""
    if opset in _SYMBOLICS:
        return
    from torch.onnx import register_custom_op_symbolic, symbolic_helper

    def logcumsumexp(g, x, dim):
        d = symbolic_helper._get_const(dim, "i", "dim")
        xd = g.op("Cast", x, to_i=11)  # DOUBLE: exp(x - max) of a sharp distribution underflows float32
        m = g.op("ReduceMax", xd, axes_i=[d], keepdims_i=1) if opset < 18 else \
            g.op("ReduceMax", xd, g.op("Constant", value_t=torch.tensor([d])), keepdims_i=1)
        c = g.op("CumSum", g.op("Exp", g.op("Sub", xd, m)), g.op("Constant", value_t=torch.tensor(d)))
        return g.op("Cast", g.op("Add", g.op("Log", c), m), to_i=1)  # FLOAT

    register_custom_op_symbolic("aten::logcumsumexp", logcumsumexp, opset)
    _SYMBOLICS.add(opset)


def _onnx_export(module: nn.Module, args: tuple, path: Path, in_names: list[str], out_names: list[str], opset: int,
                 dynamic: dict[str, list[int]]) -> None:
    axes = {n: {0: "batch", **{d: f"{n}_{d}" for d in dynamic.get(n, ())}} for n in in_names + out_names}
    _register_symbolics(opset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notes
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=in_names, output_names=out_names,
                          dynamic_axes=axes, opset_version=opset, do_constant_folding=True)


@torch.no_grad()
def export_stop_model(sm: nn.Module, rule: Any, example_inputs: Any, out_dir: str | Path, *, task: str = "custom",
                      exit_costs: list[float] | None = None, dynamic_dims: dict[str, list[int]] | None = None,
                      opset: int = 17, extra: dict | None = None) -> Path:
    """Write ``sm`` (a :class:`~learn2stop.core.model.StoppingModel`) and its rule as ONNX graphs + manifest.

    Args:
        sm: the trained stop model (its ``model`` and ``policy``); it is copied, never changed.
        rule: the deployed rule, see :func:`rule_spec` (an InferenceConfig, a Calibration or a dict).
        example_inputs: a batch of real inputs (batch-first tensor or tree); the graphs are traced on
            it with a dynamic batch size, every other dimension fixed to these.
        out_dir: a new folder, an empty one, or a complete earlier export (kept at ``<out_dir>.previous`` once the
            new one is complete).
        task: the task's name, recorded in the manifest.
        exit_costs: cumulative cost of stopping at t = 1..T (default: the model's ``exit_costs``, else t).
        dynamic_dims: input leaf name -> dims besides the batch that may vary (images of any size:
            ``{"inputs": [2, 3]}``); every dim of the state and the outputs is then left free too.
    Returns:
        ``out_dir``.
    """
    try:
        import onnx  # noqa: F401  (the exporter's own dependency; checked here for a clear message)
    except ImportError:
        raise ExportError("export needs the 'onnx' package: pip install -e \".[deploy]\"") from None
    out = Path(out_dir)
    check_out_dir(out, "out_dir")
    model, policy = sm.model, getattr(sm, "policy", None)
    check_stepwise(model)
    check_inputs(example_inputs, "example inputs")
    T = model.num_steps
    spec = rule_spec(rule)
    plan = _schedule(spec, policy, T)
    # copies: tracing may touch Python attributes (counters), and the exporter needs tensor-only state dicts
    model = _without_extra_state(copy.deepcopy(model).eval().cpu())
    policy = _without_extra_state(copy.deepcopy(policy).eval().cpu()) if policy is not None and (plan["policy"] or plan["plan"]) else None
    inputs = torch.utils._pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, Tensor) else x, example_inputs)
    in_leaves, in_spec = tree_flatten(inputs)
    in_names = _leaf_names(inputs, "inputs")

    # One eager pass gives the state's and the output's structure (and checks the model runs on these inputs).
    state0 = model.initial_state(inputs)
    state1 = model.step(1, state0, inputs)
    output1 = model.readout(1, state1, inputs)
    state_leaves, state_spec = tree_flatten(state1)
    out_leaves, out_spec = tree_flatten(output1)
    state_names = [f"state.{i}" for i in range(len(state_leaves))]
    out_names = _leaf_names(output1, "output")
    dynamic = {k: sorted(int(d) for d in v) for k, v in (dynamic_dims or {}).items()}
    for name, dims in dynamic.items():
        leaf = dict(zip(in_names, in_leaves)).get(name)
        if leaf is None or any(not 1 <= d < leaf.dim() for d in dims):
            raise ExportError(f"dynamic_dims: {name!r} must name an input ({', '.join(in_names)}) and dims 1..{leaf.dim() - 1 if leaf is not None else '?'}; got {dims}")
    if dynamic:  # the state and outputs follow the inputs' sizes: leave all their dims free
        for n, x in [*zip(state_names, state_leaves), *zip(out_names, out_leaves)]:
            dynamic[n] = dynamic[f"next_{n}"] = list(range(1, x.dim()))
    costs = exit_costs if exit_costs is not None else member(model, "exit_costs")
    costs = [float(c) for c in (costs if costs is not None else range(1, T + 1))]
    if len(costs) != T:
        raise ExportError(f"exit_costs has {len(costs)} entries; the model has {T} steps")

    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing("out_dir", out):  # an error names the folder asked for, not this hidden one
        tmp.mkdir(parents=True)
    try:
        steps, state = [], state0
        for t in range(1, plan["last"] + 1):
            keep = t < plan["last"]
            readout = t in plan["readout"]
            kind = ("plan" if plan["plan"] == t else "replan" if plan["replan"] == t
                    else "logit" if t in plan["policy"] else None)
            g = _StepGraph(model, policy, t, n_state=0 if t == 1 else len(state_names), in_spec=in_spec,
                           state_spec=state_spec, keep_state=keep, readout=readout, policy_kind=kind,
                           n_in=len(in_leaves), out_spec=out_spec).eval()
            # (eval: the exporter puts the wrapper back in its own mode afterwards, recursively)
            args = tuple(in_leaves) if t == 1 else (*tree_flatten(state)[0], *in_leaves)
            g_in = in_names if t == 1 else state_names + in_names
            if kind == "replan":  # the previous step's output (the state before this step, read out)
                args += tuple(tree_flatten(model.readout(t - 1, state, inputs))[0])
                g_in = g_in + [f"previous.{n}" for n in out_names]
            g_out = ([f"next_{n}" for n in state_names] if keep else []) + (out_names if readout else [])
            if kind is not None:
                g_out.append({"plan": "stop_plan", "replan": "replan_log_q"}.get(kind, "stop_logit"))
            if kind is not None:  # what the policy returns here, checked once, in the user's terms
                B, got = in_leaves[0].shape[0], tuple(g(*args)[-1].shape)
                want, what = {"logit": ((B,), "one stop logit per sample"),
                              "plan": ((B, T - 1), f"(B, {T - 1}) stop logits"),
                              "replan": ((B, T), f"(B, {T}) log q_phi (its second plan)")}[kind]
                if got != want:
                    raise ExportError(f"{'planning ' if kind != 'logit' else ''}policy at step {t}: must return {what}; "
                                      f"got shape {got}")
            path = tmp / f"step_{t:02d}.onnx"
            try:
                _onnx_export(g, args, path, g_in, g_out, opset, dynamic)
            except (ImportError, ExportError):
                raise
            except OSError as e:
                raise ExportError(f"cannot write the export {out}: {_os_reason(e)}") from None
            except Exception as e:  # the exporter's errors are long; the first line says what failed
                raise ExportError(f"step {t} of {type(model).__name__} cannot be exported to ONNX: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
            steps.append({"t": t, "file": path.name, "sha256": sha256_file(path), "inputs": _used_inputs(path),
                          "outputs": g_out, "readout": readout, "policy": kind})
            if keep:
                state = model.step(t, state, inputs)
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "task": task, "num_steps": T, "last_step": plan["last"],
            "rule": spec,
            "policy": None if policy is None else {"kind": "plan" if plan["plan"] else "per_step",
                                                   "plan_step": plan["plan"], "replan_step": plan["replan"],
                                                   "asked_at": plan["policy"],
                                                   "never_stop_logit": NEVER_STOP_LOGIT},
            "inputs": _describe(in_names, in_leaves, dynamic), "outputs": _describe(out_names, out_leaves, dynamic),
            "state": _describe(state_names, state_leaves, dynamic), "exit_costs": costs, "steps": steps,
            "opset": opset, "exported_with": {"torch": torch.__version__}, **(extra or {}),
        }
        with writing("out_dir", out):
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n")
        replace_folder(tmp, out, export_mismatch, "out_dir", "export")  # an earlier export is kept at <out>.previous
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ----------------------------------------------------------------------------- the CLI command
def export_command(app: Any, cfg: Any, run: Any, *, out: str | None, task: str = "custom") -> dict:
    """``learn2stop <task> export --run-dir R --out DIR``: the run's stop model and deployed rule as ONNX."""
    from .core.calibration_file import load_calibration
    from .core.task import require_trained
    from .core.train import load_stage
    from .core.deploy import served_baseline

    if app.export_unsupported:
        raise ConfigError(f"export: {app.export_unsupported}")
    check_out_dir(out, "--out", run.run_dir)
    replacing = Path(out).is_dir() and any(Path(out).iterdir())
    require_trained(run.run_dir, app.stop_stage, "export")
    sm = load_stage(app, cfg, run.run_dir, app.stop_stage, "cpu")
    inference = app.inference(cfg)
    cal = load_calibration(run.run_dir) if inference.use_calibrated and not inference.sampled else None
    rule = cal if cal is not None else inference
    inputs = app.eval_batches(cfg, "test", "cpu")[0][0]
    example = torch.utils._pytree.tree_map(lambda x: x[:2] if isinstance(x, Tensor) else x, inputs)
    path = export_stop_model(sm, rule, example, out, task=task, dynamic_dims=app.export_dynamic_dims,
                             extra={"run_dir": str(Path(run.run_dir).resolve()), "stage": app.stop_stage})
    manifest = json.loads((path / MANIFEST).read_text())
    r = manifest["rule"]
    run.log(f"exported stage {app.stop_stage!r} of {run.run_dir} to {path}: {manifest['last_step']} step graphs, "
            f"rule {r['name']} (param {r['param']}, from {r['source']})"
            + (f"; the earlier export is kept in {previous_path(path)}" if replacing else ""))
    reason = served_baseline(app, cfg, run.run_dir)
    if reason is not None:
        run.log(f"note: the run deploys {app.baseline_label} at full depth, not this stop model: {reason}")
    return manifest

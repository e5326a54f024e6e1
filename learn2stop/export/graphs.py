"""The step graphs of an export: the rule as the manifest records it, which graphs exist, and tracing each.

The graphs are traced with torch's TorchScript-based exporter (``torch.onnx.export(dynamo=False)``, opset
17): it needs nothing beyond ``onnx`` and drops the inputs a step never reads, which tells the runtime what
to compact. It is deprecated since torch 2.9; a torch without it will need the dynamo exporter (onnxscript).
One op our policies use gets its ONNX form here (``logcumsumexp``). See :mod:`learn2stop.export` for the folder.
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.calibration_file import Calibration
from ..core.inference import InferenceConfig
from ..core.policy_calls import NEVER_STOP_LOGIT
from ..core.steps import check_stepwise
from ..core.protocols import PolicySteps, member
from ..core.signal_registry import SIGNALS
from ..core.signals import DepthSignal
from ..core.trees import check_inputs
from ..runtime.manifest import FORMAT, FORMAT_VERSION, sha256_file
from ..runtime.registry import list_rules
from ..utils.outputs import reason as _os_reason
from ..utils.outputs import replace_folder, writing
from .folder import ExportError, check_out_dir, export_mismatch, write_manifest


# ----------------------------------------------------------------------------- the rule
def rule_spec(rule: Any, source: str = "") -> dict:
    """The deployed rule as the manifest records it: ``{"name", "param", "threshold", "source"}``.

    ``rule`` is an :class:`~learn2stop.core.inference.InferenceConfig`, a
    :class:`~learn2stop.core.calibration_file.Calibration`, or a dict ``{"name": ..., "param": ...}``
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
            if param is None and "threshold" in rule:  # a score threshold alone (the onnxruntime backend's)
                threshold = rule["threshold"]
            elif not isinstance(param, (int, float)) or isinstance(param, bool) or math.isnan(param):
                raise ExportError(f"rule {name!r}: param must be a number; got {param!r}")
            else:
                threshold = rule.get("threshold", SIGNALS[name].from_param(float(param)))
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
                raise ExportError(f"rule {name!r}: threshold must be a number; got {threshold!r}")
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


def _schedule(spec: dict, policy: Any, T: int) -> dict:
    """Which step graphs exist, where the readout, the policy's logit or its plan are computed."""
    name = spec["name"]
    if spec["never_stops_early"]:
        return {"last": T, "readout": [T], "policy": [], "plan": None, "replan": None}
    if name == "fixed":
        depth = int(spec["param"])
        if not 1 <= depth <= T:
            field = {"inference config": "inference.param", "calibration.json": "calibration.json: threshold"}.get(
                spec["source"], "rule param")
            raise ExportError(f"{field}: a fixed depth must be in 1..{T} (the model's steps); got {depth}")
        return {"last": depth, "readout": [depth], "policy": [], "plan": None, "replan": None}
    if SIGNALS[name].needs_policy:
        if policy is None:
            raise ExportError(f"rule {name!r} needs a stopping policy, but the model has none")
        steps = PolicySteps.of(policy)
        plan, again = steps.plan, steps.replan
        if plan is not None:
            if isinstance(plan, bool) or not isinstance(plan, int) or not 1 <= plan <= T - 1:
                raise ExportError(f"policy.plan_step must be an integer in 1..{T - 1}; got {plan!r}")
            if again is not None and name != "price":
                raise ExportError(f"rule {name!r} reads one plan, and this policy plans again at step {again}: "
                                  "export its price rule")
            if again is not None and (isinstance(again, bool) or not isinstance(again, int) or not plan < again < T):
                raise ExportError(f"policy.replan_step must be an integer in {plan + 1}..{T - 1}; got {again!r}")
            return {"last": T, "readout": list(range(plan, T + 1)), "policy": [], "plan": plan, "replan": again}
        if name == "price":
            raise ExportError("rule 'price' reads a planned q_phi: it needs a planning policy (one with plan_step)")
        first = max(int(steps.first), 1)
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




def _graph_files(path: Path) -> tuple[list[str], list[str]]:
    """(the graph's inputs as ONNX Runtime will ask for them, the external-data files its tensors load). The
    exporter drops inputs a step never reads; a graph too large for one file keeps its weights beside it."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    graph = onnx.load(str(path), load_external_data=False).graph
    files: list[str] = []

    def tensors(g):  # every tensor of a graph: initializers and node attributes, subgraphs included
        yield from g.initializer
        yield from (s.values for s in g.sparse_initializer)
        for node in g.node:
            for a in node.attribute:
                yield from ([a.t] if a.HasField("t") else []) + list(a.tensors)
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from tensors(sub)

    for x in tensors(graph):
        if uses_external_data(x):
            where = ExternalDataInfo(x).location
            if Path(where).name != where or where in (".", ".."):
                raise ExportError(f"{path.name}: external data {where!r} is not a file beside the graph")
            if where not in files:
                files.append(where)
    return [i.name for i in graph.input], files


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
        opset: the ONNX opset of the graphs.
        extra: what the manifest also records, under ``extra`` (JSON with finite numbers; the runtime never reads it).
    Returns:
        ``out_dir``.
    """
    try:
        import onnx  # noqa: F401  (the exporter's own dependency; checked here for a clear message)
    except ImportError:
        raise ExportError("export needs the 'onnx' package: pip install -e \".[deploy]\"") from None
    out = Path(out_dir)
    check_out_dir(out, "out_dir")
    model, policy = sm.model, sm.policy
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
    if not all(math.isfinite(c) and c > 0 for c in costs) or costs != sorted(costs):
        raise ExportError(f"exit_costs: the cumulative cost of stopping at each step must be finite, positive and "
                          f"non-decreasing; got {costs}")

    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing("out_dir", out):  # an error names the folder asked for, not this hidden one
        tmp.mkdir(parents=True)
    try:
        steps, files, state = [], {}, state0
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
            reads, data = _graph_files(path)
            for name in (path.name, *data):
                files[name] = sha256_file(tmp / name)
            steps.append({"t": t, "file": path.name, "inputs": reads, "outputs": g_out, "readout": readout,
                          "policy": kind})
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
            "files": files, "opset": opset, "exported_with": {"torch": torch.__version__},
            **({"extra": extra} if extra else {}),
        }
        write_manifest(tmp, manifest, out)
        replace_folder(tmp, out, export_mismatch, "out_dir", "export")  # an earlier export is kept at <out>.previous
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

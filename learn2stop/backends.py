"""Where early exit runs: eager PyTorch, ``torch.compile``, or the exported graphs in ONNX Runtime.

A backend is a *runner* with the signature of :func:`~learn2stop.core.loop.run_with_early_exit`,
``runner(model, inputs, rule) -> Rollout``, so ``evaluate`` (the metric of what the backend outputs) and
``frontier`` (its wall-clock speed at every point) take any of them, side by side:

- ``torch``: the loop as it is (:func:`~learn2stop.core.loop.run_with_early_exit`).
- ``compile``: the same loop over the model's ``step`` and ``readout`` compiled by ``torch.compile``
  (dynamic shapes, since the batch shrinks; compiled once per model, on the first call).
- ``stream``: :class:`~learn2stop.core.streaming.StreamingRunner` over every input at once, with the batch size
  as its largest batch: freed rows are refilled by waiting inputs at every step, not once per batch (``frontier``
  then reads "samples/s at batch N" as the stream's throughput with at most N rows per step call).
- ``onnxruntime``: the model and its policy exported per rule kind (:func:`~learn2stop.export.export_stop_model`,
  into a temporary folder, once per model and rule kind or fixed depth) and run by
  :class:`~learn2stop.runtime.StopRuntime`, whose stop times and outputs match the torch loop's. Thresholds
  of one rule share an export. Needs the deploy extra; MAML's inner gradient steps do not export.
"""
from __future__ import annotations

import math
import shutil
import tempfile
from typing import Any, Callable

import numpy as np
import torch

from .core.timing import BackendError
from .core.loop import Rollout, run_with_early_exit
from .core.protocols import member
from .core.model import StoppingModel
from .core.policy_signals import PolicyRule
from .core.rules import FixedDepth, SignalRule
from .core.streaming import StreamingRunner
from .core.trees import batch_size, tree_cat, tree_leaves, tree_select
from .utils.registry import Registry

Runner = Callable[[Any, Any, Any], Rollout]
#: backend name -> a factory of its runner, called with ONNX Runtime's intra-op threads (registered below)
BACKENDS: Registry[Callable[[int], Runner]] = Registry("backend")
__all__ = ["BACKENDS", "BackendError", "CompiledRunner", "OnnxRunner", "StreamRunner", "check_exportable", "make_runner",
           "parse_backends"]


def parse_backends(value: str | None) -> list[str]:
    """``--backend torch,onnxruntime`` as a list of known backends (None: torch), each once; an empty name
    (``''``, ``'torch,,'``) is refused, not read as the default."""
    names = [n.strip() for n in ("torch" if value is None else value).split(",")]
    bad = [n for n in names if n not in BACKENDS]
    if bad or len(set(names)) != len(names):
        what = "an empty name" if "" in bad else f"unknown {', '.join(repr(n) for n in bad)}" if bad else "a repeated name"
        raise BackendError(f"--backend: give one or more of {', '.join(BACKENDS)}, comma-separated, each once; "
                           f"got {value!r} ({what})")
    return names


def check_exportable(command: str, backends: list[str], export_unsupported: str) -> None:
    """Refuse ``export`` and the onnxruntime backend for a task whose steps do not export, both with the task's own
    reason, before any work (an export attempt would fail deep in the tracer, with the tracer's words)."""
    if export_unsupported and command == "export":
        raise BackendError(f"export: {export_unsupported}")
    if export_unsupported and "onnxruntime" in backends:
        raise BackendError(f"--backend onnxruntime: {export_unsupported}")


def make_runner(name: str, threads: int = 1) -> Runner:
    """The runner of backend ``name`` (one of :data:`BACKENDS`); ``threads``: ONNX Runtime's intra-op threads."""
    if name not in BACKENDS:
        raise BackendError(f"backend: unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS.get(name)(threads)


class _Compiled:
    """A step-wise model whose ``step`` and ``readout`` are compiled; every other member is the model's."""

    def __init__(self, model: Any):
        self._model = model
        self.step = torch.compile(model.step, dynamic=True)
        self.readout = torch.compile(model.readout, dynamic=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class CompiledRunner:
    """``run_with_early_exit`` over compiled steps; one compiled copy per model, kept with the model."""

    def __init__(self):
        self._compiled: dict[int, tuple[Any, _Compiled]] = {}

    def __call__(self, model: Any, inputs: Any, rule: Any, **kw) -> Rollout:
        entry = self._compiled.get(id(model))
        if entry is None or entry[0] is not model:
            entry = self._compiled[id(model)] = (model, _Compiled(model))
        try:
            return run_with_early_exit(entry[1], inputs, rule, **kw)
        except Exception as e:  # torch.compile raises its own types (BackendCompilerFailed, Unsupported, ...)
            if "torch._dynamo" not in type(e).__module__ and "torch._inductor" not in type(e).__module__:
                raise
            raise BackendError(f"backend compile: torch.compile cannot compile {type(model).__name__}'s steps: "
                               f"{str(e).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- the stream
class StreamRunner:
    """Every input submitted at once to a :class:`~learn2stop.core.streaming.StreamingRunner` with ``max_batch``
    rows per step call (default: all of them), run until idle; the result in input order, as a Rollout.

    ``takes_all``: :func:`~learn2stop.core.timing.measure_speed` hands it all its inputs in one call with the
    batch size as ``max_batch`` (a stream refills only from requests that wait), where the other runners get
    one batch per call."""

    takes_all = True

    def __call__(self, model: Any, inputs: Any, rule: Any, max_batch: int | None = None, **kw) -> Rollout:
        if kw.get("record_probs") or kw.get("compact_every"):
            raise BackendError("backend stream: record_probs and compact_every are options of the torch loop")
        n = batch_size(inputs)
        stream = StreamingRunner(model, rule, max_batch=max_batch or n, capacity=max(n, 1))
        ids = [stream.submit(tree_select(inputs, slice(i, i + 1))) for i in range(n)]
        stream.run_until_idle()
        done = [stream.finished[i] for i in ids]
        stop_times = torch.tensor([f.stop_time for f in done], device=tree_leaves(inputs)[0].device)
        return Rollout(outputs=tree_cat([f.output for f in done]), stop_times=stop_times, num_steps=model.num_steps)


# ----------------------------------------------------------------------------- ONNX Runtime
def rule_export_key(rule: Any, num_steps: int) -> tuple[dict, float | None]:
    """(the rule spec an export needs, the threshold to run it at) for a rule of the core."""
    if isinstance(rule, FixedDepth):
        return {"name": "fixed", "param": rule.depth or num_steps}, None
    if isinstance(rule, PolicyRule) and rule.mode != "threshold":
        raise BackendError("backend onnxruntime: the runtime runs deterministic rules only, not a sampled policy")
    if isinstance(rule, SignalRule):
        thr = rule.threshold
        spec = {"name": rule.signal.name, "param": None, "threshold": thr if math.isfinite(thr) else math.inf}
        return spec, (thr if math.isfinite(thr) else None)
    raise BackendError(f"backend onnxruntime: {type(rule).__name__} cannot run in the runtime (it runs a fixed depth "
                       "and the threshold rules: policy, quantile, price, confidence, entropy, tolerance)")


class OnnxRunner:
    """Runs a core rule on the exported model in ONNX Runtime, exporting on first use (cached per model, rule
    kind and fixed depth), and gives the result as a :class:`~learn2stop.core.loop.Rollout` of tensors."""

    _dir = ""  # the scratch folder of its exports, once made (a runner whose import failed has none)

    def __init__(self, threads: int = 1):
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
        except ImportError:
            raise BackendError("backend onnxruntime needs the deploy extra: pip install -e \".[deploy]\"") from None
        self.threads = threads
        self._dir = tempfile.mkdtemp(prefix="learn2stop-ort-")
        self._runtimes: dict[tuple, tuple[Any, Any]] = {}

    def __del__(self):
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _runtime(self, model: Any, rule: Any, inputs: Any, spec: dict):
        from .export import ExportError, export_stop_model
        from .runtime import load

        policy = getattr(getattr(rule, "signal", None), "policy", None)
        never = spec.get("threshold") == math.inf
        key = (id(model), id(policy), spec["name"], spec["param"] if spec["name"] == "fixed" else never)
        entry = self._runtimes.get(key)
        if entry is None or entry[0] is not model:
            folder = f"{self._dir}/export-{len(self._runtimes)}"
            try:
                export_stop_model(StoppingModel(model, policy), spec, inputs, folder,
                                  exit_costs=member(model, "exit_costs"))
            except (ExportError, RuntimeError, TypeError) as e:
                raise BackendError(f"backend onnxruntime: {type(model).__name__} does not export: "
                                   f"{str(e).splitlines()[0]}") from None
            entry = self._runtimes[key] = (model, load(folder, threads=self.threads))
        return entry[1]

    def __call__(self, model: Any, inputs: Any, rule: Any, **kw) -> Rollout:
        if kw.get("record_probs") or kw.get("compact_every"):
            raise BackendError("backend onnxruntime: record_probs and compact_every are options of the torch loop")
        spec, threshold = rule_export_key(rule, model.num_steps)
        runtime = self._runtime(model, rule, inputs, spec)
        device = tree_leaves(inputs)[0].device
        feeds = ({k: v.detach().cpu().numpy() for k, v in inputs.items()} if isinstance(inputs, dict)
                 else inputs.detach().cpu().numpy())
        r = runtime.run(feeds, threshold=threshold)
        outputs = ({k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in r.outputs.items()}
                   if isinstance(r.outputs, dict) else torch.from_numpy(r.outputs).to(device))
        return Rollout(outputs=outputs, stop_times=torch.from_numpy(r.stop_times).to(device), num_steps=r.num_steps)


BACKENDS.register("torch")(lambda threads: run_with_early_exit)
BACKENDS.register("compile")(lambda threads: CompiledRunner())
BACKENDS.register("stream")(lambda threads: StreamRunner())
BACKENDS.register("onnxruntime")(lambda threads: OnnxRunner(threads))

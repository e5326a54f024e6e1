"""The early-exit loop over an export's step graphs, with batch compaction, in numpy + ONNX Runtime.

Per step t: run graph t on the rows still going; where the rule is asked, decide who stops; write the
stopped rows' outputs straight into preallocated arrays (no final concatenation or reordering), and
keep going with the others only (state, rule memory, and the inputs that later graphs still read). At
batch 1 a stop simply ends the loop. Semantics as :func:`learn2stop.core.loop.run_with_early_exit`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .manifest import ManifestError, read_manifest
from .rules import make_rule

#: ONNX Runtime's element types, by numpy's names (what the manifest declares)
_ORT_DTYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
               "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32", "tensor(int64)": "int64",
               "tensor(uint8)": "uint8", "tensor(bool)": "bool"}


def _check_providers(providers: Any, available: list[str]) -> list[str]:
    """The execution providers asked for (default: CPU), each one ONNX Runtime has here; else a ValueError naming it."""
    if providers is None:
        return ["CPUExecutionProvider"]
    if isinstance(providers, str) or not isinstance(providers, (list, tuple)) or not providers \
            or not all(isinstance(p, str) for p in providers):
        raise ValueError(f"providers must be a non-empty list of provider names; got {providers!r}")
    for p in providers:
        if p not in available:
            raise ValueError(f"providers: {p!r} is not available in this ONNX Runtime; available: {', '.join(available)}")
    return list(providers)


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an integer beyond float's range
        return False


def _declared(name: str, m: dict, state: dict) -> tuple[list, tuple[str, ...]]:
    """(shape, allowed dtypes) declared for a graph input or output of that name: by the manifest, or for a state
    leaf read at step t > 1 (whose shape may change from step to step), by the previous graph's output."""
    T = m["num_steps"]
    policy = {"stop_logit": [None], "stop_plan": [None, T - 1], "replan_log_q": [None, T]}
    if name in policy:
        return policy[name], ("float32", "float64", "float16")
    if name.startswith("state."):
        return state[name]
    table = {e["name"]: e for e in (*m["inputs"], *m["outputs"], *m["state"])}
    e = table[name.removeprefix("previous.").removeprefix("next_")]
    return e["shape"], (e["dtype"],)


def _check_graph(sess: Any, step: dict, m: dict, path: Path, manifest: Path, state: dict) -> dict:
    """A graph's own inputs and outputs (names, order of outputs, ranks, fixed dims, dtypes) as the manifest
    declares them, and the state it reads as the previous graph gives it: a graph swapped for another export's,
    or an edited shape or dtype, is refused here, not in a run. Returns the state it gives (for the next graph)."""
    got_in, got_out = sess.get_inputs(), sess.get_outputs()
    if sorted(a.name for a in got_in) != sorted(step["inputs"]):
        raise ManifestError(f"{path} reads {[a.name for a in got_in]}, but {manifest} says {step['inputs']}")
    if [a.name for a in got_out] != step["outputs"]:
        raise ManifestError(f"{path} gives {[a.name for a in got_out]}, but {manifest} says {step['outputs']}")
    given = {}
    for a, is_input in [*((a, True) for a in got_in), *((a, False) for a in got_out)]:
        dtype, dims = _ORT_DTYPES.get(a.type, a.type), list(a.shape or [])
        if a.name.startswith("next_state."):  # what the next graph reads as its state: its own, step by step
            given[a.name.removeprefix("next_")] = ([None] + [d if isinstance(d, int) and d > 0 else None
                                                             for d in dims[1:]], (dtype,))
            if step["t"] > 1:
                continue  # the manifest's state is step 1's (its shape may change from step to step)
        shape, dtypes = _declared(a.name, m, state)
        what = f"{path}: {'input' if is_input else 'output'} {a.name!r}"
        if dtype not in dtypes:
            raise ManifestError(f"{what} is {dtype} in the graph, but {manifest} declares {' or '.join(dtypes)}")
        if len(dims) != len(shape):
            raise ManifestError(f"{what} has rank {len(dims)} in the graph, but {manifest} declares shape {shape} "
                                f"(rank {len(shape)})")
        for i, (want, have) in enumerate(zip(shape, dims)):
            fixed = isinstance(have, int) and have > 0
            # a graph must take any batch, and any size where the manifest lets an input's dim vary
            free = is_input and want is None and (i == 0 or a.name.startswith("inputs"))
            if fixed and ((want is not None and want != have) or free):
                raise ManifestError(f"{what} has dim {i} = {have} in the graph, but {manifest} declares shape {shape}")
    return given


@dataclass
class RuntimeResult:
    """outputs: an array, or for a dict output a dict of arrays (its keys), in input order; stop_times: (B,) 1-based."""

    outputs: Any
    stop_times: np.ndarray
    num_steps: int

    @property
    def steps_computed(self) -> int:
        return int(self.stop_times.sum())

    @property
    def mean_depth(self) -> float:
        return float(self.stop_times.mean())


class StopRuntime:
    """An exported stop model, ready to run.

    Args:
        folder: the export (``manifest.json`` and the ``step_*.onnx`` graphs); checked on load: the manifest's
            fields and checksum, every file's sha256 and each graph's inputs and outputs against the manifest
            (:mod:`learn2stop.runtime.manifest`).
        threads: ONNX Runtime's intra-op threads (1 is fastest on a busy machine).
        providers: ONNX Runtime execution providers (default: CPU); each must be one ONNX Runtime has here, and
            the first must be the one that runs the graphs (no silent fallback).
    """

    def __init__(self, folder: str | Path, threads: int = 1, providers: list[str] | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ImportError("the runtime needs onnxruntime: pip install onnxruntime (or learn2stop[deploy])") from None
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1; got {threads!r}")
        self.folder = Path(folder)
        self.manifest = m = read_manifest(self.folder)
        self.num_steps, self.last_step = m["num_steps"], m["last_step"]
        self.inputs, self.outputs = m["inputs"], m["outputs"]
        self.rule_spec = m["rule"]
        self.exit_costs = m["exit_costs"]
        self._n_out = len(self.outputs)
        self._never_stop = np.float32(m["policy"]["never_stop_logit"] if m["policy"] else 0.0)
        self._providers = _check_providers(providers, ort.get_available_providers())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._sessions, self._steps, state = [], m["steps"], {}
        for s in self._steps:
            path = self.folder / s["file"]
            try:
                sess = ort.InferenceSession(str(path), opts, providers=self._providers)
            except Exception as e:  # ONNX Runtime raises its own exception types
                raise ManifestError(f"{path} cannot be loaded by ONNX Runtime: {str(e).splitlines()[0]}") from None
            if sess.get_providers()[:1] != self._providers[:1]:
                raise ValueError(f"providers: {self._providers[0]} is available but could not run {path} "
                                 f"(ONNX Runtime fell back to {', '.join(sess.get_providers())})")
            state = _check_graph(sess, s, m, path, self.folder / "manifest.json", state)
            self._sessions.append(sess)
        in_names = [i["name"] for i in self.inputs]
        # per step, fixed once: the inputs it reads, the state leaves it reads (the exporter drops the others,
        # by index into the previous step's state outputs), and how many state outputs it gives
        out_names = [o["name"] for o in self.outputs]
        self._plan = [([n for n in s["inputs"] if n in in_names],
                       [(n, int(n.split(".")[1])) for n in s["inputs"] if n.startswith("state.")],
                       len(s["outputs"]) - (self._n_out if s["readout"] else 0) - (s["policy"] is not None),
                       [(n, out_names.index(n.removeprefix("previous."))) for n in s["inputs"] if n.startswith("previous.")])
                      for s in self._steps]
        # whether the next step reads this step's output (a second plan's): only then is it kept and compacted
        self._next_reads_output = [bool(self._plan[i + 1][3]) if i + 1 < len(self._plan) else False
                                   for i in range(len(self._plan))]
        # after step t, only the inputs some later graph reads are compacted with the batch
        self._later_inputs = [sorted({n for s in self._steps[t:] for n in s["inputs"] if n in in_names})
                              for t in range(1, len(self._steps) + 1)]

    # ------------------------------------------------------------------ input checks
    def _check(self, inputs: Any) -> dict[str, np.ndarray]:
        """Inputs as {name: array}; wrong names, shapes, dtypes and NaN / inf are refused, naming the input."""
        if not isinstance(inputs, dict):
            if len(self.inputs) != 1:
                raise ValueError(f"this model takes several inputs; pass a dict with {[i['name'] for i in self.inputs]}")
            inputs = {self.inputs[0]["name"]: inputs}
        expected = {i["name"] for i in self.inputs}
        # a dict of inputs may use its own keys ("y") for the manifest's leaf names ("inputs.y")
        inputs = {k if k in expected or not isinstance(k, str) else f"inputs.{k}": v for k, v in inputs.items()}
        if set(inputs) != expected:
            raise ValueError(f"inputs: expected {sorted(expected)}; got {sorted(inputs)}")
        out, batch = {}, None
        for spec in self.inputs:
            name, x = spec["name"], inputs[spec["name"]]
            if not isinstance(x, np.ndarray):
                raise TypeError(f"input {name!r}: must be a numpy array; got {type(x).__name__}")
            shape = tuple(spec["shape"][1:])
            if x.ndim != len(shape) + 1 or any(d is not None and d != n for d, n in zip(shape, x.shape[1:])) \
                    or 0 in x.shape[1:]:
                want = ", ".join("any" if d is None else str(d) for d in shape)
                raise ValueError(f"input {name!r}: expected shape (B, {want}); got {x.shape}")
            if x.dtype != np.dtype(spec["dtype"]):
                raise ValueError(f"input {name!r}: expected dtype {spec['dtype']}; got {x.dtype} (convert it first)")
            if x.shape[0] == 0:
                raise ValueError(f"input {name!r}: empty batch")
            if batch is not None and x.shape[0] != batch:
                raise ValueError(f"input {name!r}: batch size {x.shape[0]} differs from the other inputs' {batch}")
            batch = x.shape[0]
            if np.issubdtype(x.dtype, np.floating):
                bad = ~np.isfinite(x.reshape(batch, -1)).all(axis=1)
                if bad.any():
                    raise ValueError(f"input {name!r}: NaN or inf values in {int(bad.sum())} sample(s); clean or drop them first")
            out[name] = np.ascontiguousarray(x)
        return out

    # ------------------------------------------------------------------ the loop
    def run(self, inputs: Any, threshold: float | None = None) -> RuntimeResult:
        """Early exit for a batch: ``inputs`` an array (B, ...) or a dict of arrays, as the manifest lists.

        ``threshold`` runs the manifest's rule at another threshold (score units; e.g. another point of a
        frontier) on the same graphs; a fixed depth, or a rule exported as never stopping early, has none.
        """
        feeds = self._check(inputs)
        B = next(iter(feeds.values())).shape[0]
        spec = self.rule_spec
        if threshold is not None:
            if spec["name"] == "fixed" or spec.get("never_stops_early"):
                raise ValueError(f"threshold: the export's rule ({spec['name']}"
                                 f"{', never stopping early' if spec.get('never_stops_early') else ''}) has no "
                                 "threshold to change; export the rule with a finite threshold")
            if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, (int, float, np.integer, np.floating)) \
                    or not _finite(threshold):
                raise ValueError(f"threshold must be a finite number (score units); got {threshold!r}")
            spec = {**spec, "threshold": float(threshold)}
        rule = make_rule(spec)
        rule.start(B)
        outs: list = [None] * self._n_out  # allocated at the first write (sizes may follow the inputs')
        stop_times = np.full(B, self.last_step, dtype=np.int64)
        active = np.arange(B)
        planned = None  # stop step per running row, once a planning policy has spoken
        previous: list[np.ndarray] = []  # the last readout of the running rows (a second plan reads it)
        state: list[np.ndarray] = []
        for i, (sess, step) in enumerate(zip(self._sessions, self._steps)):
            t = step["t"]
            reads, state_names, n_state, previous_names = self._plan[i]
            feed = {n: feeds[n] for n in reads}
            for name, j in state_names:
                feed[name] = state[j]
            for name, j in previous_names:  # a second plan reads the previous step's output of its rows
                feed[name] = previous[j]
            res = sess.run(None, feed)
            state = res[:n_state]
            if t == self.last_step:
                self._write(outs, res[n_state:n_state + self._n_out], active, None, B)
                break
            if not step["readout"]:
                continue
            output = res[n_state:n_state + self._n_out]
            if step["policy"] == "plan":  # the steps before the plan cannot stop any more
                plan = np.array(res[-1], dtype=np.float32)
                plan[:, :t - 1] = self._never_stop
                planned = np.maximum(rule.plan_stop_steps(plan, t), t)
                stop = planned == t
            elif step["policy"] == "replan":  # the rows planned past this step are planned again
                planned = np.where(planned > t, np.maximum(rule.replan_stop_steps(np.asarray(res[-1]), t), t), planned)
                stop = planned == t
            elif planned is not None:
                stop = planned == t
            else:
                logit = res[-1] if step["policy"] == "logit" else None
                if rule.uses_logit and logit is None:
                    continue  # the policy is not asked at this step (before its min_step)
                stop = rule.decide(t, output[0] if len(output) == 1 else output, logit)
            previous = output if self._next_reads_output[i] else []
            n_stop = int(stop.sum())
            if not n_stop:
                continue
            if n_stop == active.size:  # everyone left stops here (at batch 1: a stop ends the loop)
                self._write(outs, output, active, None, B)
                stop_times[active] = t
                break
            gone = np.flatnonzero(stop)
            self._write(outs, output, active[gone], gone, B)
            stop_times[active[gone]] = t
            keep = ~stop
            active = active[keep]
            state = [x[keep] for x in state]
            rule.compact(keep)
            if planned is not None:
                planned = planned[keep]
            previous = [x[keep] for x in previous]
            for n in self._later_inputs[i]:
                feeds[n] = feeds[n][keep]
        outputs = outs[0] if self._n_out == 1 else {o["name"].removeprefix("output."): a for o, a in zip(self.outputs, outs)}
        return RuntimeResult(outputs=outputs, stop_times=stop_times, num_steps=self.num_steps)

    @staticmethod
    def _write(outs: list, values: list[np.ndarray], rows: np.ndarray, pick: np.ndarray | None, batch: int) -> None:
        """Stopped rows straight into their place in the result (preallocated on the first write)."""
        for i, v in enumerate(values):
            if outs[i] is None:
                outs[i] = np.empty((batch, *v.shape[1:]), dtype=v.dtype)
            outs[i][rows] = v if pick is None else v[pick]

    def run_one(self, sample: Any) -> tuple[Any, int]:
        """One input without a batch axis (an array, or a dict of arrays): (its output, its stop step)."""
        batched = ({k: np.asarray(v)[None] if isinstance(v, np.ndarray) else v for k, v in sample.items()}
                   if isinstance(sample, dict) else (sample[None] if isinstance(sample, np.ndarray) else sample))
        r = self.run(batched)
        out = r.outputs[0] if self._n_out == 1 else {k: v[0] for k, v in r.outputs.items()}
        return out, int(r.stop_times[0])


def load(folder: str | Path, threads: int = 1, providers: list[str] | None = None) -> StopRuntime:
    """Load an export folder (checked against its manifest and checksums); see :class:`StopRuntime`."""
    return StopRuntime(folder, threads=threads, providers=providers)

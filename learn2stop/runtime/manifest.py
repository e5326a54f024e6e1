"""Read and verify an export's ``manifest.json``: every field, its own checksum and every file's (numpy-free, torch-free).

A manifest is refused, with one line naming the file and the field, unless:

- the file is at most :data:`MAX_BYTES` and nests at most :data:`MAX_DEPTH` brackets (checked on the raw text,
  before parsing: Python's json has no depth limit), is UTF-8 JSON with no key repeated;
- every field has its type, finite values and range (a rule's parameter range is its entry in the rule registry,
  a fixed depth lies within the steps, exit costs are positive and non-decreasing: they are cumulative), and the
  steps' graphs, inputs, outputs and policy calls agree with each other and with the rule;
- ``manifest_sha256`` is the sha256 of the rest of the manifest in canonical form (:func:`canonical_bytes`), so an
  edited field that is still valid (another threshold) is refused too;
- with ``verify``, every file in ``files`` (each graph and each external-data file a graph loads) is in the folder
  with its sha256.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from .registry import get_rule, list_rules

FORMAT = "learn2stop-onnx"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
MAX_BYTES = 4 << 20  # a manifest of a few hundred steps is tens of KB
MAX_DEPTH = 64
MAX_STEPS = 100_000
#: element types a graph's inputs and outputs may have (numpy's names; torch's for the same types)
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
POLICY_OUTPUT = {"logit": "stop_logit", "plan": "stop_plan", "replan": "replan_log_q"}
_FIELDS = {"format", "version", "task", "num_steps", "last_step", "rule", "policy", "inputs", "outputs", "state",
           "exit_costs", "steps", "files", "opset", "exported_with", "extra", "manifest_sha256"}
_OPTIONAL = {"extra"}
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_HEX = re.compile(r"[0-9a-f]{64}")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class ManifestError(ValueError):
    """An export folder that cannot be trusted: the message names the file and what is wrong."""


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks (the manifest's checksum of each file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical_bytes(manifest: dict) -> bytes:
    """The manifest without ``manifest_sha256`` as compact, key-sorted, ASCII JSON: what its checksum covers."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def seal(manifest: dict) -> dict:
    """The manifest with its ``manifest_sha256`` (over :func:`canonical_bytes`), as the exporter writes it."""
    return {**{k: v for k, v in manifest.items() if k != "manifest_sha256"},
            "manifest_sha256": hashlib.sha256(canonical_bytes(manifest)).hexdigest()}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    if _is_int(x):
        return abs(x) <= 1e300
    return isinstance(x, float) and math.isfinite(x)


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


class _Fields:
    """Checks one manifest, each refusal naming the file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, what: str, got: Any = ...) -> None:
        tail = "" if got is ... else f"; got {_short(got)}"
        raise ManifestError(f"{self.path}: '{field}' {what}{tail}; export the run again")

    def need(self, ok: bool, field: str, what: str, got: Any = ...) -> None:
        if not ok:
            self.fail(field, what, got)

    def keys(self, d: Any, field: str, required: set, optional: set = frozenset()) -> dict:
        self.need(isinstance(d, dict), field, "must be an object", d)
        for k in sorted(required):
            self.need(k in d, f"{field}.{k}" if field else k, "is missing")
        for k in d:
            self.need(k in required or k in optional, f"{field}.{k}" if field else k, "is not a field of this format")
        return d

    def int_in(self, x: Any, field: str, lo: int, hi: int) -> int:
        self.need(_is_int(x) and lo <= x <= hi, field, f"must be an integer in {lo}..{hi}", x)
        return x

    def text(self, x: Any, field: str) -> str:
        self.need(isinstance(x, str) and len(x) <= 10_000, field, "must be a string", x)
        return x

    def plain(self, x: Any, field: str) -> None:
        """Any JSON value whose numbers are finite (what the runtime stores and never reads)."""
        if isinstance(x, dict):
            for k, v in x.items():
                self.plain(v, f"{field}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                self.plain(v, f"{field}[{i}]")
        elif isinstance(x, float):
            self.need(math.isfinite(x), field, "must be a finite number", x)

    def tensors(self, entries: Any, field: str, prefix: str) -> list[dict]:
        self.need(isinstance(entries, list) and len(entries) <= 10_000, field, "must be a list", entries)
        names = []
        for i, e in enumerate(entries):
            f = f"{field}[{i}]"
            self.keys(e, f, {"name", "shape", "dtype"})
            name = self.text(e["name"], f"{f}.name")
            self.need(name == prefix or name.startswith(prefix + "."), f"{f}.name", f"must be {prefix!r} or {prefix}.<key>", name)
            self.need(name not in names, f"{f}.name", "repeats an earlier name", name)
            names.append(name)
            shape = e["shape"]
            self.need(isinstance(shape, list) and 1 <= len(shape) <= 16 and shape[0] is None
                      and all(d is None or (_is_int(d) and 1 <= d <= 2 ** 31) for d in shape[1:]),
                      f"{f}.shape", "must be [null, d1, ...] (the batch, then dims >= 1 or null), at most 16 dims", shape)
            self.need(e["dtype"] in DTYPES, f"{f}.dtype", f"must be one of {', '.join(DTYPES)}", e["dtype"])
        return entries


def _check_depth(text: str, path: Path) -> None:
    """Refuse nesting deeper than MAX_DEPTH on the raw text (strings blanked), before json parses it."""
    depth = 0
    for c in re.findall(r"[\[\]{}]", _STRINGS.sub('""', text)):
        depth += 1 if c in "[{" else -1
        if depth > MAX_DEPTH:
            raise ManifestError(f"{path}: nests deeper than {MAX_DEPTH} levels (no manifest does); export the run again")


def _no_repeats(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _parse(path: Path) -> Any:
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ManifestError(f"{path}: {size} bytes, more than a manifest's {MAX_BYTES} (not a manifest of ours); "
                            "export the run again")
    try:
        text = path.read_bytes().decode("utf-8")
        _check_depth(text, path)
        return json.loads(text, object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"{path} is corrupt (not valid JSON: {str(e)[:200]}); export the run again") from None


def check_manifest(m: Any, path: Path) -> dict:
    """Check every field of a parsed manifest and its own checksum (not the files); returns it."""
    c = _Fields(path)
    c.need(isinstance(m, dict) and m.get("format") == FORMAT, "format", f"must be {FORMAT!r} (not a manifest of ours)",
           m.get("format") if isinstance(m, dict) else m)
    c.need(m.get("version") == FORMAT_VERSION and _is_int(m.get("version")), "version",
           f"is not {FORMAT_VERSION}, the format version this runtime reads", m.get("version"))
    c.keys(m, "", _FIELDS - _OPTIONAL, _OPTIONAL)
    c.text(m["task"], "task")
    T = c.int_in(m["num_steps"], "num_steps", 1, MAX_STEPS)
    last = c.int_in(m["last_step"], "last_step", 1, T)
    _check_rule(c, m["rule"], T, last)
    policy = _check_policy(c, m["policy"], T)
    inputs = c.tensors(m["inputs"], "inputs", "inputs")
    outputs = c.tensors(m["outputs"], "outputs", "output")
    state = c.tensors(m["state"], "state", "state")
    c.need(len(inputs) >= 1, "inputs", "needs at least one input")
    c.need(len(outputs) >= 1, "outputs", "needs at least one output")
    c.need([s["name"] for s in state] == [f"state.{i}" for i in range(len(state))], "state",
           "must be named state.0, state.1, ... in order", [s["name"] for s in state])
    costs = m["exit_costs"]
    c.need(isinstance(costs, list) and len(costs) == T, "exit_costs", f"must be a list of {T} numbers (one per step)", costs)
    for i, x in enumerate(costs):
        c.need(_finite(x) and x > 0, f"exit_costs[{i}]", "must be a finite number > 0 (the cost of stopping there)", x)
        c.need(i == 0 or x >= costs[i - 1], f"exit_costs[{i}]", f"must be >= exit_costs[{i - 1}] ({costs[i - 1]}): "
               "the costs are cumulative", x)
    files = m["files"]
    c.need(isinstance(files, dict) and 1 <= len(files) <= 100_000, "files", "must map each file name to its sha256", files)
    for name, digest in files.items():
        c.need(bool(_SAFE_NAME.fullmatch(name)) and name != MANIFEST, f"files.{name}",
               "must name a file in the export folder (letters, digits, '_', '.', '-')")
        c.need(isinstance(digest, str) and bool(_HEX.fullmatch(digest)), f"files.{name}", "must be a sha256 (64 hex digits)", digest)
    _check_steps(c, m["steps"], m["rule"], policy, T, last, inputs, outputs, state, files)
    c.int_in(m["opset"], "opset", 1, 1000)
    c.need(isinstance(m["exported_with"], dict) and all(isinstance(v, str) for v in m["exported_with"].values()),
           "exported_with", "must map names to version strings", m["exported_with"])
    c.plain(m.get("extra"), "extra")
    digest = m["manifest_sha256"]
    c.need(isinstance(digest, str) and bool(_HEX.fullmatch(digest)), "manifest_sha256", "must be a sha256 (64 hex digits)", digest)
    c.need(hashlib.sha256(canonical_bytes(m)).hexdigest() == digest, "manifest_sha256",
           "does not match the manifest's content (edited or corrupt)")
    return m


def _check_rule(c: _Fields, rule: Any, T: int, last: int) -> None:
    c.keys(rule, "rule", {"name", "param", "threshold", "never_stops_early", "source"})
    runs = list_rules(runtime=True)
    c.need(rule["name"] in runs, "rule.name", f"must name one of {', '.join(runs)}", rule["name"])
    entry = get_rule(rule["name"])
    never = rule["never_stops_early"]
    c.need(isinstance(never, bool), "rule.never_stops_early", "must be true or false", never)
    c.text(rule["source"], "rule.source")
    param, thr = rule["param"], rule["threshold"]
    if entry.name == "fixed":
        c.need(thr is None, "rule.threshold", "must be null for a fixed depth", thr)
        if never:
            c.need(param is None, "rule.param", "must be null for full depth (never stopping early)", param)
            c.need(last == T, "last_step", f"must be num_steps ({T}) for full depth", last)
        else:
            c.int_in(param, "rule.param", 1, T)
            c.need(last == param, "last_step", f"must be the fixed depth, {param}", last)
        return
    c.need(param is None or (_finite(param) and entry.in_range(param)), "rule.param",
           f"({entry.param_name}) must be {entry.param_range}, or null", param)
    if never:
        c.need(thr is None, "rule.threshold", "must be null for a rule never stopping early", thr)
    else:
        c.need(_finite(thr), "rule.threshold", "must be a finite number (the rule's score threshold)", thr)
    c.need(last == T, "last_step", f"must be num_steps ({T}) for the {entry.name} rule", last)


def _check_policy(c: _Fields, policy: Any, T: int) -> dict | None:
    if policy is None:
        return None
    c.keys(policy, "policy", {"kind", "plan_step", "replan_step", "asked_at", "never_stop_logit"})
    c.need(policy["kind"] in ("plan", "per_step"), "policy.kind", "must be 'plan' or 'per_step'", policy["kind"])
    plan, again = policy["plan_step"], policy["replan_step"]
    if policy["kind"] == "plan":
        c.int_in(plan, "policy.plan_step", 1, T - 1)
        if again is not None:
            c.int_in(again, "policy.replan_step", plan + 1, T - 1)
    else:
        c.need(plan is None and again is None, "policy.plan_step", "must be null for a per-step policy", plan)
    asked = policy["asked_at"]
    c.need(isinstance(asked, list) and all(_is_int(t) and 1 <= t < T for t in asked) and asked == sorted(set(asked)),
           "policy.asked_at", f"must list increasing steps in 1..{T - 1}", asked)
    c.need(_finite(policy["never_stop_logit"]), "policy.never_stop_logit", "must be a finite number",
           policy["never_stop_logit"])
    return policy


def _check_steps(c: _Fields, steps: Any, rule: dict, policy: dict | None, T: int, last: int, inputs: list,
                 outputs: list, state: list, files: dict) -> None:
    c.need(isinstance(steps, list) and len(steps) == last, "steps", f"must describe steps 1..{last}, one entry each",
           steps if not isinstance(steps, list) else f"{len(steps)} entries")
    entry = get_rule(rule["name"])
    in_names, out_names = [i["name"] for i in inputs], [o["name"] for o in outputs]
    state_names = [s["name"] for s in state]
    seen, kinds = set(), {}
    for i, s in enumerate(steps):
        f, t = f"steps[{i}]", i + 1
        c.keys(s, f, {"t", "file", "inputs", "outputs", "readout", "policy"})
        c.need(s["t"] == t and _is_int(s["t"]), f"{f}.t", f"must be {t} (the steps in order)", s["t"])
        c.need(isinstance(s["file"], str) and s["file"] in files and s["file"] not in seen, f"{f}.file", "must be a file listed in 'files', "
               "one per step", s["file"])
        seen.add(s["file"])
        c.need(isinstance(s["readout"], bool), f"{f}.readout", "must be true or false", s["readout"])
        kind = s["policy"]
        c.need(kind in (None, *POLICY_OUTPUT), f"{f}.policy", "must be null, 'logit', 'plan' or 'replan'", kind)
        c.need(kind is None or s["readout"], f"{f}.policy", "needs the readout at its step (readout true)")
        if kind is not None:
            kinds.setdefault(kind, []).append(t)
        allowed = set(in_names) | (set(state_names) if t > 1 else set())
        if kind == "replan":
            allowed |= {f"previous.{n}" for n in out_names}
        reads = s["inputs"]
        c.need(isinstance(reads, list) and all(isinstance(n, str) and n in allowed for n in reads)
               and len(set(reads)) == len(reads), f"{f}.inputs",
               f"must list distinct graph inputs among {', '.join(sorted(allowed))}", reads)
        want = (([f"next_{n}" for n in state_names] if t < last else []) + (out_names if s["readout"] else [])
                + ([POLICY_OUTPUT[kind]] if kind else []))
        c.need(s["outputs"] == want, f"{f}.outputs", f"must be {want} (the state, the readout, the policy's output)",
               s["outputs"])
    c.need(steps[-1]["readout"], f"steps[{last - 1}].readout", "must be true: the last step computes the output")
    if policy is None:
        c.need(not kinds, "policy", "is null, but steps ask a policy", sorted(kinds))
    else:
        c.need(kinds.get("logit", []) == policy["asked_at"], "policy.asked_at",
               f"must be the steps whose policy is 'logit' ({kinds.get('logit', [])})", policy["asked_at"])
        for kind, step in (("plan", policy["plan_step"]), ("replan", policy["replan_step"])):
            c.need(kinds.get(kind, []) == ([] if step is None else [step]), f"policy.{kind}_step",
                   f"must be the step whose policy is {kind!r} ({kinds.get(kind, [])})", step)
    stops = not rule["never_stops_early"] and entry.name != "fixed"
    if stops and entry.needs_policy:
        c.need(bool(kinds), "rule.name", f"the {entry.name} rule reads a stopping policy, and no step asks one")
    if kinds.get("logit"):
        c.need(entry.needs_policy and not entry.plans, "rule.name", "must be a rule reading per-step stop logits "
               "(threshold, quantile): the steps ask a per-step policy", entry.name)
    if kinds.get("plan"):
        c.need(entry.needs_policy, "rule.name", "must be a rule reading a plan (threshold, quantile, price)", entry.name)
    if kinds.get("replan") or entry.plans and stops:
        c.need(entry.plans and bool(kinds.get("plan")), "rule.name",
               "and the steps disagree: a second plan is read by the price rule, which needs a plan step", entry.name)


def read_manifest(folder: str | Path, verify: bool = True) -> dict:
    """The manifest of an export folder, checked field by field and against its checksum; with ``verify``, every
    file it lists (graphs and their external data) is checked against its sha256 too."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder; give the folder written by 'learn2stop <task> export'")
    if not path.is_file():
        raise ManifestError(f"{path} is missing: {folder} is not an export of learn2stop")
    m = check_manifest(_parse(path), path)
    if verify:
        for name, digest in m["files"].items():
            file = folder / name
            if file.is_symlink() or not file.is_file():
                raise ManifestError(f"{file} is missing or not a plain file (listed in {path}); export the run again")
            if sha256_file(file) != digest:
                raise ManifestError(f"{file} does not match its sha256 in {path} (changed or corrupt); "
                                    "export the run again")
    return m

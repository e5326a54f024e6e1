"""Read and verify an export's ``manifest.json`` and the checksums of its graphs (numpy-free, torch-free)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .registry import list_rules

FORMAT = "learn2stop-onnx"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """An export folder that cannot be trusted: the message names the file and what is wrong."""


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks (the manifest's checksum of each graph)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _require(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise ManifestError(f"{path}: {what}; export the run again")


def _check_tensors(path: Path, entries, field: str) -> None:
    _require(isinstance(entries, list), path, f"'{field}' must be a list")
    for e in entries:
        _require(isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("shape"), list)
                 and isinstance(e.get("dtype"), str), path, f"'{field}' entries need a name, a shape and a dtype; got {e!r}")
        _require(e["shape"][:1] == [None] and all(d is None or (isinstance(d, int) and d >= 1) for d in e["shape"][1:]),
                 path, f"'{field}' entry {e['name']!r}: shape must be [null, d1, ...] with dims >= 1 or null; got {e['shape']}")


def read_manifest(folder: str | Path, verify: bool = True) -> dict:
    """The manifest of an export folder, checked field by field; with ``verify``, every graph's sha256 too."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder; give the folder written by 'learn2stop <task> export'")
    if not path.is_file():
        raise ManifestError(f"{path} is missing: {folder} is not an export of learn2stop")
    try:
        m = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"{path} is corrupt (not valid JSON: {e}); export the run again") from None
    _require(isinstance(m, dict) and m.get("format") == FORMAT, path, f"not a manifest of format {FORMAT!r}")
    _require(m.get("version") == FORMAT_VERSION, path,
             f"format version {m.get('version')!r}; this runtime reads version {FORMAT_VERSION}")
    T, last = m.get("num_steps"), m.get("last_step")
    _require(isinstance(T, int) and T >= 1 and isinstance(last, int) and 1 <= last <= T, path,
             f"num_steps / last_step must be integers with 1 <= last_step <= num_steps; got {T!r} / {last!r}")
    rule, runs = m.get("rule"), list_rules(runtime=True)
    _require(isinstance(rule, dict) and rule.get("name") in runs, path,
             f"'rule' must name one of {', '.join(runs)}; got {rule!r}")
    for field in ("inputs", "outputs", "state"):
        _check_tensors(path, m.get(field), field)
    _require(len(m["inputs"]) >= 1 and len(m["outputs"]) >= 1, path, "needs at least one input and one output")
    costs = m.get("exit_costs")
    _require(isinstance(costs, list) and len(costs) == T and all(isinstance(c, (int, float)) for c in costs), path,
             f"'exit_costs' must be a list of {T} numbers")
    steps = m.get("steps")
    _require(isinstance(steps, list) and [s.get("t") if isinstance(s, dict) else None for s in steps]
             == list(range(1, last + 1)), path, f"'steps' must describe steps 1..{last} in order")
    for s in steps:
        _require(isinstance(s.get("file"), str) and "/" not in s["file"] and "\\" not in s["file"]
                 and isinstance(s.get("sha256"), str) and isinstance(s.get("inputs"), list)
                 and isinstance(s.get("outputs"), list) and isinstance(s.get("readout"), bool)
                 and s.get("policy") in (None, "logit", "plan", "replan"),
                 path, f"step {s.get('t')}: needs file, sha256, inputs, outputs, readout and policy; got {s!r}")
    _require(steps[-1]["readout"], path, "the last step must compute the readout")
    if verify:
        for s in steps:
            graph = folder / s["file"]
            if not graph.is_file():
                raise ManifestError(f"{graph} is missing (listed in {path}); export the run again")
            if sha256_file(graph) != s["sha256"]:
                raise ManifestError(f"{graph} does not match its sha256 in {path} (changed or corrupt); "
                                    "export the run again")
    return m

"""The results tables of README.md and docs/*.md, written from run records so that a number cannot drift.

    python benchmarks/results.py RUN_DIR [RUN_DIR ...] [--threads N]  # record each run, then rewrite the tables
    python benchmarks/results.py                                       # rewrite the tables from docs/results/
    python benchmarks/results.py --check                               # exit 1 where a table differs from its record

Recording a run reads what ``learn2stop <task> reproduce`` wrote in its directory: ``fingerprint.json`` (the task),
``config.yaml`` (compared with the task's presets: the preset, and any field set apart from it, make the command),
``in_time.json`` (every rule calibrated to keep the baseline's full-depth quality, timed beside it: the deployed
rule, its depth and its speed), and every markdown table of the run's own reports (``table1.md``, ``results.md``,
``table7.md``, ``frontier.md``, ...; not a listing longer than :data:`MAX_ROWS` rows). It writes
``docs/results/<run-name>.json``: those numbers, the preset and the command, nothing else. ``--threads N`` says
the run was made with ``--threads N`` (the run directory does not record it).

A table is marked in a markdown file as::

    <!-- results:summary sparse-quick maml-quick -->    one row per run: baseline, deployed rule, depth, speed
    <!-- results:sparse-quick/in_time -->              a table of one run's record (here its in_time.md)
    ...
    <!-- /results -->

and everything between the two markers is rewritten. A run with no record yet renders "not recorded yet" with
the command that makes it (a run is named ``<task>-<preset>``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results"
FORMAT = 1

#: run-directory reports that are not tables of results (in_time.json is read instead)
NOT_TABLES = ("in_time.md",)
#: a longer table is a listing (the frontier's every point, kept in frontier.json), not a summary: not recorded
MAX_ROWS = 30

MARKER = re.compile(r"<!-- results:(?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- /results -->", re.S)


class RecordError(ValueError):
    """A run directory or a record that lacks what a table needs (the message names the file and the field)."""


# ----------------------------------------------------------------------------- records
def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise RecordError(f"{path} is missing: a finished 'reproduce' writes it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise RecordError(f"{path} is not valid JSON ({e})") from None


def markdown_tables(text: str) -> list[dict]:
    """The GitHub tables of a markdown text, each ``{"title", "headers", "rows"}`` (cells as written); the title is
    the nearest heading or paragraph line above the table."""
    tables, title, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        line = lines[i].strip()
        is_table = line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+",
                                                                                lines[i + 1].strip())
        if is_table:
            cells = lambda s: [c.strip() for c in s.strip().strip("|").split("|")]
            headers, rows = cells(line), []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append({"title": title, "headers": headers, "rows": rows})
            continue
        if line:
            title = line.lstrip("#").strip()
        i += 1
    return tables


def run_tables(run_dir: Path) -> dict[str, dict]:
    """Every table of the run's markdown reports of at most :data:`MAX_ROWS` rows, named by file stem and place in
    the file (``table7``, its second table ``table7.2``)."""
    out = {}
    for path in sorted(run_dir.glob("*.md")):
        if path.name in NOT_TABLES:
            continue
        for k, table in enumerate(markdown_tables(path.read_text(encoding="utf-8")), 1):
            if len(table["rows"]) <= MAX_ROWS:
                out[path.stem if k == 1 else f"{path.stem}.{k}"] = table
    return out


def preset_and_flags(task: str, config: dict) -> tuple[str, list[str]]:
    """The task's preset closest to the run's resolved config, and the flags (``--a.b value``) that set the rest."""
    from learn2stop.tasks import get_task
    from learn2stop.utils.config_files import preset_config
    from learn2stop.utils.config import to_dict

    spec = get_task(task)
    flat = lambda d, p="": ({k: v for key, val in d.items() for k, v in flat(val, f"{p}{key}.").items()}
                            if isinstance(d, dict) else {p[:-1]: d})
    have = flat(json.loads(json.dumps(config)))
    best = None
    for name in spec.presets:
        want = flat(json.loads(json.dumps(to_dict(preset_config(spec.config_class, spec.presets, name, task)))))
        diff = [f"--{k} {_flag_value(v)}" for k, v in have.items() if want.get(k) != v]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    return best


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def record_run(run_dir: str | Path, threads: int | None = None) -> dict:
    """The record of a finished ``reproduce`` run directory (see the module docstring)."""
    import yaml

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir}: not a run directory")
    task = _read_json(run_dir / "fingerprint.json").get("task")
    if not isinstance(task, str):
        raise RecordError(f"{run_dir / 'fingerprint.json'}: field 'task' is missing")
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise RecordError(f"{config_path} is missing: a training command writes it")
    preset, flags = preset_and_flags(task, yaml.safe_load(config_path.read_text(encoding="utf-8")))
    command = " ".join([f"learn2stop {task} reproduce --preset {preset}", *flags,
                        *([f"--threads {threads}"] if threads else [])])
    in_time = _read_json(run_dir / "in_time.json")
    where = run_dir / "in_time.json"
    rows = _field(in_time, "rows", where)
    deployed = _field(in_time, "deployed", where)
    base = next((r for r in rows if r.get("rule") == "baseline"), None)
    if base is None:
        raise RecordError(f"{where}: rows has no 'baseline' row")
    sizes = [str(n) for n in _field(in_time, "batch_sizes", where)]
    summary = {"metric": _field(in_time, "metric", where), "reference": _field(in_time, "reference", where),
               "calibration": _field(in_time, "calibration", where), "batch_sizes": sizes,
               "num_steps": _field(base, "mean_steps", f"{where}: the baseline row"),
               "baseline": {"metric": _field(base, "metric", f"{where}: the baseline row")},
               "rules": [], "deployed": deployed, "fastest": {str(n): r for n, r in in_time.get("fastest", {}).items()}}
    for r in rows:
        if r["rule"] == "baseline":
            continue
        rule = {"rule": r["rule"], "reached": bool(r.get("reached", True))}
        if rule["reached"]:
            at = f"{where}: the {r['rule']} row"
            rule.update({"param": r.get("param"), "metric": _field(r, "metric", at),
                         "mean_steps": _field(r, "mean_steps", at), "mean_cost": _field(r, "mean_cost", at),
                         "speedup": {n: r.get("speedup", {}).get(n) for n in sizes}})
            for key in ("description", "label"):  # what the rule is, where its name alone would mislead
                if key in r:
                    rule[key] = str(r[key])
        summary["rules"].append(rule)
    record = {"format": FORMAT, "run": run_dir.name, "task": task, "preset": preset, "command": command,
              "summary": summary, "tables": run_tables(run_dir)}
    check_record(record, f"the record of {run_dir}")
    return record


def _field(d: Any, name: str, where: Any) -> Any:
    if not isinstance(d, dict) or name not in d:
        raise RecordError(f"{where}: field '{name}' is missing")
    return d[name]


#: what every record must hold: dotted field -> allowed types
REQUIRED = {"format": int, "run": str, "task": str, "preset": str, "command": str, "summary": dict,
            "summary.metric": str, "summary.reference": str, "summary.calibration": str, "summary.batch_sizes": list,
            "summary.num_steps": (int, float), "summary.baseline": dict, "summary.baseline.metric": (int, float),
            "summary.rules": list, "summary.deployed": str, "summary.fastest": dict, "tables": dict}
RULE_FIELDS = {"rule": str, "reached": bool}
REACHED_FIELDS = {"metric": (int, float), "mean_steps": (int, float), "mean_cost": (int, float), "speedup": dict}
TABLE_FIELDS = {"title": str, "headers": list, "rows": list}


def check_record(record: Any, where: str) -> None:
    """Refuse a record that lacks a field a table reads, naming the field (``summary.baseline.metric``)."""
    def get(d, dotted, shown=None):
        for part in dotted.split("."):
            if not isinstance(d, dict) or part not in d:
                raise RecordError(f"{where}: field '{shown or dotted}' is missing")
            d = d[part]
        return d

    def typed(value, types, name):
        if isinstance(value, bool) and types is not bool:
            types = ()
        if not isinstance(value, types):
            raise RecordError(f"{where}: field '{name}' must be {getattr(types, '__name__', types)}; got {value!r}")

    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object")
    for name, types in REQUIRED.items():
        typed(get(record, name), types, name)
    if record["format"] != FORMAT:
        raise RecordError(f"{where}: field 'format' is {record['format']}; this script reads format {FORMAT} "
                          f"(record the run again)")
    for i, rule in enumerate(record["summary"]["rules"]):
        fields = {**RULE_FIELDS, **(REACHED_FIELDS if rule.get("reached") else {})}
        for name, types in fields.items():
            typed(get(rule, name, f"summary.rules[{i}].{name}"), types, f"summary.rules[{i}].{name}")
    for name, table in record["tables"].items():
        for field, types in TABLE_FIELDS.items():
            typed(get(table, field, f"tables.{name}.{field}"), types, f"tables.{name}.{field}")


def write_record(record: dict, records: Path = RECORDS) -> Path:
    """``records/<run>.json``, written atomically."""
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{record['run']}.json"
    fd, tmp = tempfile.mkstemp(dir=records, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def load_records(records: Path = RECORDS) -> dict[str, dict]:
    """Every record of ``records``, checked, by run name."""
    out = {}
    for path in sorted(records.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise RecordError(f"{path} is not valid JSON ({e})") from None
        check_record(record, str(path))
        if record["run"] != path.stem:
            raise RecordError(f"{path}: field 'run' is {record['run']!r}, not the file's name {path.stem!r}")
        out[path.stem] = record
    return out


# ----------------------------------------------------------------------------- rendering
def _num(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"


def _steps(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if float(v).is_integer() else f"{v:.2f}"


def pending_command(run: str) -> str:
    """How a run named ``<task>-<preset>`` is made and recorded."""
    task, _, preset = run.partition("-")
    return (f"`learn2stop {task} reproduce --preset {preset or 'quick'} --run-dir runs/{run}`, then "
            f"`python benchmarks/results.py runs/{run}`")


def summary_row(run: str, record: dict | None) -> str:
    """One README row: task, baseline at full depth, deployed stop model, mean depth, speed at the baseline's quality."""
    if record is None:
        task, _, preset = run.partition("-")
        return f"| {task} ({preset or 'quick'}) | not recorded yet: {pending_command(run)} | | | |"
    s = record["summary"]
    metric, sizes, T = s["metric"], s["batch_sizes"], s["num_steps"]
    rules = {r["rule"]: r for r in s["rules"]}
    task = f"{record['task']} ({record['preset']}): {metric}"
    base = f"{s['reference']}: {_num(s['baseline']['metric'])}"
    if s["deployed"] == "baseline":
        served = sizes[0]
        reached = [r for r in s["rules"] if r["reached"] and r["speedup"].get(served) is not None]
        # the rules that run fewer steps than the baseline: one at full depth is its computation, so a lead it
        # shows is the timing's noise
        early = [r for r in reached if r["mean_cost"] < 1]
        quickest = max(early, key=lambda r: r["speedup"][served], default=None)
        if not reached:
            note = ("the baseline: neither the policy rule nor a fixed depth of the stop model reaches its quality on "
                    "validation")
        elif quickest is None:
            note = "the baseline: no certified rule of the stop model runs fewer steps than it"
        else:
            x = quickest["speedup"][served]
            how = ("every certified early exit of the stop model runs slower" if x <= 1 else
                   "no certified early exit of the stop model is faster beyond the spread of the timing passes")
            name = quickest.get("label", quickest["rule"])
            note = f"the baseline: {how} at batch {served} (the fastest, {name}, {x:.2f}×)"
        return f"| {task} | {base} | {note} | {_steps(T)} of {_steps(T)} | 1.00× (the baseline itself) |"
    r = rules.get(s["deployed"])
    if r is None or not r["reached"]:
        raise RecordError(f"{record['run']}: summary.deployed is {s['deployed']!r}, which has no reached row in "
                          f"summary.rules")
    # a stop model with no lead at full depth has its rules matched to the baseline on validation, not certified
    how = "matched on validation, no guarantee" if "no guarantee" in s["calibration"] else "certified"
    name = (r["description"] if "description" in r else f"a fixed depth of {_steps(r['param'] or T)}, {how}"
            if r["rule"] == "fixed" else f"{r['rule']} rule, {how}")
    speed = " / ".join(f"{r['speedup'][n]:.2f}×" if r["speedup"].get(n) is not None else "-" for n in sizes)
    return (f"| {task} | {base} | **{_num(r['metric'])}** ({name}) | {_steps(r['mean_steps'])} of {_steps(T)} | "
            f"{speed} (batch {' / '.join(sizes)}) |")


def render_summary(runs: list[str], records: dict[str, dict]) -> str:
    head = ("| task (preset): metric | baseline, full depth | stop model, deployed rule | mean depth | "
            "speed at the baseline's quality |\n|---|---|---|---|---|")
    lines = [head, *(summary_row(run, records.get(run)) for run in runs)]
    made = [f"`{records[run]['command']}`" for run in runs if run in records]
    if made:
        lines.append("\nMade by " + ", ".join(made) + " (records in `docs/results/`).")
    return "\n".join(lines)


def render_table(run: str, name: str, records: dict[str, dict]) -> str:
    """A table of one run's record, with the command that made it."""
    record = records.get(run)
    if record is None:
        return f"Not recorded yet: {pending_command(run)}."
    if name == "in_time":
        return render_in_time(record)
    table = record["tables"].get(name)
    if table is None:
        raise RecordError(f"docs/results/{run}.json has no table {name!r}; its tables: "
                          f"{', '.join(['in_time', *record['tables']])}")
    lines = ["| " + " | ".join(table["headers"]) + " |", "|" + "|".join("---" for _ in table["headers"]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return "\n".join(lines) + f"\n\nMade by `{record['command']}` (`{name}` of `docs/results/{run}.json`)."


def render_in_time(record: dict) -> str:
    """Every rule of the stop model calibrated to keep the baseline's quality: its quality, depth and speed."""
    s = record["summary"]
    sizes = s["batch_sizes"]
    lines = [f"| rule | {s['metric']} | mean steps | cost % | " + " | ".join(f"× at batch {n}" for n in sizes) + " |",
             "|---|---|---|---|" + "---|" * len(sizes),
             f"| {s['reference']}" + (" (deployed)" if s["deployed"] == "baseline" else "")
             + f" | {_num(s['baseline']['metric'])} | {_steps(s['num_steps'])} | 100.0 | "
             + " | ".join("1.00×" for _ in sizes) + " |"]
    for r in s["rules"]:
        label = _rule_name(r) + (" (deployed)" if r["rule"] == s["deployed"] else "")
        if not r["reached"]:
            lines.append(f"| {label} | not reached on validation | | |" + " |" * len(sizes))
            continue
        lines.append(f"| {label} | {_num(r['metric'])} | {r['mean_steps']:.2f} | {100 * r['mean_cost']:.1f} | "
                     + " | ".join(f"{r['speedup'][n]:.2f}×" if r["speedup"].get(n) is not None else "-"
                                  for n in sizes) + " |")
    names = {r["rule"]: _rule_name(r) for r in s["rules"]}
    names["baseline"] = s["reference"]
    if s["fastest"]:
        lines.append("\nFastest at the baseline's quality: " + "; ".join(
            f"batch {n}: {names.get(r, r)}" for n, r in s["fastest"].items()) + ".")
    return ("\n".join(lines) + f"\n\nCalibrated on validation ({s['calibration']}), scored on test. Made by "
            f"`{record['command']}` (`in_time` of `docs/results/{record['run']}.json`).")


def _rule_name(r: dict) -> str:
    return f"fixed depth {_steps(r['param'])}" if r["rule"] == "fixed" and r.get("param") is not None else r["rule"]


def render_block(spec: str, records: dict[str, dict]) -> str:
    """The text of one marked block, from its marker's ``spec``."""
    words = spec.split()
    if not words:
        raise RecordError("an empty <!-- results: --> marker")
    if words[0] == "summary":
        if len(words) < 2:
            raise RecordError("<!-- results:summary RUN [RUN ...] -->: name the runs of the table")
        return render_summary(words[1:], records)
    run, slash, name = words[0].partition("/")
    if not slash or not name or len(words) > 1:
        raise RecordError(f"<!-- results:{spec} -->: expected 'summary RUN ...' or 'RUN/TABLE'")
    return render_table(run, name, records)


def render_text(text: str, records: dict[str, dict]) -> str:
    """``text`` with every marked block rewritten from ``records``."""
    return MARKER.sub(lambda m: f"<!-- results:{m['spec']} -->\n{render_block(m['spec'], records)}\n<!-- /results -->",
                      text)


def marked_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="*", help="finished reproduce run directories to record")
    parser.add_argument("--threads", type=int, default=None, help="the --threads the runs were made with")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table differs")
    args = parser.parse_args(argv)
    if args.check and args.run_dirs:
        parser.error("--check reads the committed records only; give no run directory")
    try:
        for run_dir in args.run_dirs:
            print(f"recorded {write_record(record_run(run_dir, args.threads)).relative_to(ROOT)}")
        records = load_records()
        stale = []
        for path in marked_files():
            text = path.read_text(encoding="utf-8")
            new = render_text(text, records)
            if new != text:
                stale.append(path.relative_to(ROOT))
                if not args.check:
                    path.write_text(new, encoding="utf-8")
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check and stale:
        print("tables differ from docs/results/: " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(map(str, stale))) if stale else "every table matches its record")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The results tables of README.md and docs/*.md equal what benchmarks/results.py renders from docs/results/."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _results():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _results()


@pytest.fixture(scope="module")
def records():
    return results.load_records()


def test_every_marked_table_equals_its_record(records):
    marked = 0
    for path in results.marked_files():
        text = path.read_text(encoding="utf-8")
        marked += len(results.MARKER.findall(text))
        assert results.render_text(text, records) == text, (
            f"{path.relative_to(ROOT)}: a results table differs from docs/results/; run python benchmarks/results.py")
    assert marked >= 5, "README.md and docs/*.md should mark their results tables"


def test_readme_has_the_summary_table_and_stays_short(records):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- results:summary " in text
    assert len(text.splitlines()) <= 150


def test_a_changed_number_is_caught(records):
    run = next(iter(records))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    changed = copy.deepcopy(records)
    changed[run]["summary"]["baseline"]["metric"] += 1.0
    assert results.render_text(text, changed) != text


@pytest.mark.parametrize("field", ["summary.baseline.metric", "summary.deployed", "command", "tables"])
def test_a_record_missing_a_field_is_refused_naming_it(records, field):
    record = copy.deepcopy(next(iter(records.values())))
    parent = record
    *path, last = field.split(".")
    for part in path:
        parent = parent[part]
    del parent[last]
    with pytest.raises(results.RecordError, match=f"field '{field}' is missing"):
        results.check_record(record, "a record")


def test_a_rule_missing_its_metric_is_refused_naming_it(records):
    record = copy.deepcopy(next(r for r in records.values() if any(x["reached"] for x in r["summary"]["rules"])))
    reached = next(i for i, r in enumerate(record["summary"]["rules"]) if r["reached"])
    del record["summary"]["rules"][reached]["metric"]
    with pytest.raises(results.RecordError, match=rf"field 'summary.rules\[{reached}\].metric' is missing"):
        results.check_record(record, "a record")


def test_a_record_file_missing_a_field_is_refused_on_load(records, tmp_path):
    run, record = next(iter(records.items()))
    record = copy.deepcopy(record)
    del record["summary"]["num_steps"]
    (tmp_path / f"{run}.json").write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(results.RecordError, match=r"\.json: field 'summary.num_steps' is missing"):
        results.load_records(tmp_path)


def test_a_run_directory_without_in_time_is_refused_naming_the_file(tmp_path):
    run = tmp_path / "sparse-quick"
    run.mkdir()
    (run / "fingerprint.json").write_text(json.dumps({"task": "sparse", "fields": {}}), encoding="utf-8")
    from learn2stop.tasks.sparse import preset
    from learn2stop.utils.config_files import save_yaml

    save_yaml(preset("quick"), run / "config.yaml")
    with pytest.raises(results.RecordError, match=r"in_time\.json is missing"):
        results.record_run(run)


def test_a_run_without_a_record_renders_the_command_that_makes_it():
    text = "<!-- results:sparse-paper-cpu/table1 -->\n<!-- /results -->"
    out = results.render_text(text, {})
    assert "Not recorded yet" in out and "learn2stop sparse reproduce --preset paper-cpu" in out


def test_markdown_tables_are_read_cell_by_cell():
    text = "# Table 7\n\n| a | b |\n|---|---|\n| 1.5 | x |\n| 2 | y |\n\nnote\n\n| c |\n|---|\n| 3 |\n"
    tables = results.markdown_tables(text)
    assert tables == [{"title": "Table 7", "headers": ["a", "b"], "rows": [["1.5", "x"], ["2", "y"]]},
                      {"title": "note", "headers": ["c"], "rows": [["3"]]}]


def test_the_preset_and_its_flags_are_read_off_the_config():
    from learn2stop.tasks.sparse import preset
    from learn2stop.utils.config import to_dict

    config = to_dict(preset("quick"))
    assert results.preset_and_flags("sparse", config) == ("quick", [])
    config["lista"]["num_steps"] = 12
    assert results.preset_and_flags("sparse", config) == ("quick", ["--lista.num_steps 12"])


def test_a_tiny_reproduce_is_recorded_and_rendered(tmp_path):
    """A real (tiny) sparse reproduce: its record names the preset and every flag set apart from it, holds the
    deployed rule's numbers as in_time.json has them and Table 1 as table1.md has it, and renders."""
    from learn2stop.cli import main

    from conftest import TINY

    run = tmp_path / "sparse-quick"
    assert main(["sparse", "reproduce", "--preset", "quick", "--run-dir", str(run), "--no-progress", *TINY]) == 0
    record = results.record_run(run, threads=1)
    assert record["task"] == "sparse" and record["preset"] == "quick" and record["run"] == "sparse-quick"
    assert record["command"].startswith("learn2stop sparse reproduce --preset quick --problem.m 13 --problem.n 27")
    assert record["command"].endswith("--threads 1") and "--lista.num_steps 5" in record["command"]
    in_time = json.loads((run / "in_time.json").read_text())
    s = record["summary"]
    assert s["deployed"] == in_time["deployed"] and s["num_steps"] == 5
    assert s["baseline"]["metric"] == next(r["metric"] for r in in_time["rows"] if r["rule"] == "baseline")
    assert [r["rule"] for r in s["rules"]] == [r["rule"] for r in in_time["rows"] if r["rule"] != "baseline"]
    table1 = (run / "table1.md").read_text()
    assert record["tables"]["table1"]["rows"][0][0] in table1 and "table2" in record["tables"]
    records = {"sparse-quick": record}
    text = "<!-- results:summary sparse-quick -->\n<!-- /results -->\n<!-- results:sparse-quick/table1 -->\n<!-- /results -->"
    out = results.render_text(text, records)
    assert "sparse (quick): NMSE (dB)" in out and "LISTA (T=5)" in out and record["command"] in out
    assert results.render_text(out, records) == out  # rendering is idempotent
    with pytest.raises(results.RecordError, match="has no table 'table9'"):
        results.render_text("<!-- results:sparse-quick/table9 -->\n<!-- /results -->", records)


def test_check_mode_passes_on_the_committed_docs(capsys):
    assert results.main(["--check"]) == 0


def test_a_deployed_baseline_says_whether_the_rules_were_slower_or_only_inside_the_timing_noise(records):
    record = copy.deepcopy(records["lm-quick"])
    s = record["summary"]
    s["deployed"] = "baseline"
    reached = [r for r in s["rules"] if r.get("reached") and r["speedup"].get(s["batch_sizes"][0]) is not None]
    assert reached
    for r in reached:
        r["speedup"][s["batch_sizes"][0]] = 0.9
    assert "every certified early exit of the stop model runs slower" in results.summary_row("lm-quick", record)
    early = [r for r in reached if r["mean_cost"] < 1]
    full = [r for r in reached if r["mean_cost"] >= 1]
    assert early and full
    early[0]["speedup"][s["batch_sizes"][0]] = 1.08
    full[0]["speedup"][s["batch_sizes"][0]] = 1.2  # the baseline's computation: its lead is noise, not cited
    row = results.summary_row("lm-quick", record)
    assert "faster beyond the spread of the timing passes" in row and "1.08×" in row and "1.20×" not in row
    s["rules"] = full
    assert "no certified rule of the stop model runs fewer steps" in results.summary_row("lm-quick", record)

"""The README's "Wrap your own step-wise model" section, run as written: each python block in a fresh process (in a
scratch folder, one thread), and what it prints checked against what the README says it shows."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Wrap your own step-wise model"
LINE = re.compile(r"^([\d.]+) steps: policy MSE ([\d.]+), fixed depth (\d+) ([\d.]+), oracle ([\d.]+)$")


def section_blocks(kind: str) -> list[str]:
    """The fenced blocks of language ``kind`` ("" for a plain block) in the README's section, up to the next
    second-level heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks, lang, body = [], None, []
    for line in text[start:end if end > 0 else None].splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return [b for k, b in blocks if k == kind]


def run_block(code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def comparison(lines: list[str]) -> list[tuple[float, ...]]:
    rows = [LINE.match(line) for line in lines if line.strip()]
    assert rows and all(rows), lines
    return [tuple(float(v) for v in r.groups()) for r in rows]


def test_the_section_has_the_two_examples():
    blocks = section_blocks("python")
    assert len(blocks) == 2
    assert "calibrate(" in blocks[0] and "attach_exits(" in blocks[1]


@pytest.mark.slow
def test_the_own_model_example_runs_and_its_policy_beats_fixed_depth_as_printed(tmp_path):
    code = section_blocks("python")[0]
    printed = comparison(run_block(code, tmp_path).splitlines())
    shown = comparison(section_blocks("")[0].splitlines())  # the output block the README shows after it
    assert len(printed) == len(shown) == 4
    for rows in (printed, shown):
        for steps, policy, depth, fixed, oracle in rows:
            assert depth >= steps  # the fixed depth compared runs at least as many steps
            assert oracle <= policy < fixed  # the policy is worth having; the oracle bounds it
    assert (tmp_path / "runs" / "mine" / "model" / "config.json").is_file()  # saved as one folder


def test_the_classifier_example_runs_and_prints_its_exit_costs(tmp_path):
    out = run_block(section_blocks("python")[1], tmp_path).splitlines()
    assert out == ["[889856, 3259392, 5619968]", "torch.Size([4])"]

"""Every benchmark script imports (its imports and module-level code are alive); runnable ones are run on
tiny configs by their own tests (e.g. runtime_speed --tiny)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # each script runs its work only under `if __name__ == "__main__"`
    if not path.name.startswith("_"):  # _name.py: a helper the scripts share, not a script
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"

"""The package's import graph: no circle among its modules, and no layer importing a layer above it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "learn2stop"
LAYERS = {"utils": 0, "runtime": 1, "core": 2, "export": 3, "backends": 3, "api": 3, "tasks": 4, "cli": 5}  # none imports a higher one


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The learn2stop modules ``path`` imports (module-level statements only, or every statement)."""
    tree = ast.parse(path.read_text())
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if node.level == 0 and not target.startswith("learn2stop"):
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            found.update(n if (PKG.parent / (n.replace(".", "/") + ".py")).exists()
                         or (PKG.parent / n.replace(".", "/")).is_dir() else target for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("learn2stop"))
    return found


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {t for t in _imports(p, top_level_only) if t in mods and t != m} for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]], skip_packages: bool) -> list[str] | None:
    """One import circle among modules (packages' ``__init__`` re-exports left out if asked), or None."""
    pkgs = {m for m in graph if (PKG.parent / m.replace(".", "/")).is_dir()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if skip_packages and n in pkgs:
                continue
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and not (skip_packages and m in pkgs) and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-deferred"])
def test_no_import_circle_between_modules(top_level_only):
    cycle = _cycle(_graph(top_level_only), skip_packages=True)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_layer_imports_a_layer_above_it():
    def layer(m: str) -> int:
        parts = m.split(".")
        return LAYERS.get(parts[1], -1) if len(parts) > 1 else -1

    upward = [f"{m} -> {t}" for m, targets in _graph(False).items() for t in targets
              if layer(m) >= 0 and layer(t) > layer(m)]
    assert not upward, "imports reaching up a layer: " + "; ".join(sorted(upward))


#: the most lines a module may hold: a longer one is split by concern
MAX_LINES = {"learn2stop/tasks": 300, "learn2stop": 400}


def test_no_module_is_longer_than_its_limit():
    def limit(path: Path) -> int:
        rel = path.relative_to(PKG.parent).as_posix()
        return min(n for prefix, n in MAX_LINES.items() if rel.startswith(prefix + "/"))

    long = [f"{p.relative_to(PKG.parent)}: {n} lines (limit {limit(p)})" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit(p)]
    assert not long, "modules over their line limit: " + "; ".join(long)

"""The engine's layering, read from the import graph (imports inside functions and under
TYPE_CHECKING count: a local import that only dodges a cycle is still a cycle).

core (target, caches, sampling, the loop, drafters) <- orchestration (generate, modes, registry,
calibrate, ...) <- front ends (engine.cli, engine.serve, engine.train, app)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# core and model loading, and everything under engine.drafters
CORE = {"engine", "engine.errors", "engine.paths", "engine.platform", "engine.sampling", "engine.target",
        "engine.caches", "engine.recurrent", "engine.shapes", "engine.compiled", "engine.skinny_gemm", "engine.cuda_skinny",
        "engine.speculative", "engine.batch", "engine.batch_cache", "engine.slot_kv", "engine.detokenize", "engine.loading", "engine.gguf",
        "engine.starter", "engine.processors", "engine.vision", "engine.images"}
FRONT_ENDS = ("engine.cli", "engine.serve", "engine.train")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("engine", "app"):
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, mods)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one engine module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if not w.startswith("engine"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v.startswith("engine") and v not in index:
            visit(v)
    return found


def _is_core(mod: str) -> bool:
    return mod in CORE or mod.startswith("engine.drafters")


def _is_cli(mod: str) -> bool:
    return mod == "engine.cli" or mod.startswith("engine.cli.")


def test_no_import_cycle_in_the_engine():
    assert _cycles(import_graph()) == []


def test_core_and_drafters_never_reach_up():
    graph = import_graph()
    breaks = [(m, o) for m, outs in graph.items() if _is_core(m) for o in outs
              if o.startswith("engine") and not _is_core(o)]
    assert breaks == [], "core modules (target, caches, sampling, the loop, drafters) import orchestration"


def test_only_the_cli_imports_the_cli_and_launches_the_app():
    graph = import_graph()
    assert [(m, o) for m, outs in graph.items() for o in outs if _is_cli(o) and not _is_cli(m)] == []
    assert [(m, o) for m, outs in graph.items() if m.startswith("engine") for o in outs
            if o.startswith("app") and not _is_cli(m)] == []


def test_orchestration_never_imports_a_front_end():
    graph = import_graph()
    orchestration = [m for m in graph if m.startswith("engine") and not _is_core(m) and not m.startswith(FRONT_ENDS)]
    assert [(m, o) for m in orchestration for o in graph[m] if o.startswith(FRONT_ENDS)] == []


def test_the_checker_sees_cycles_and_breaks(tmp_path, monkeypatch):
    """The graph reader itself: a function-level import closing a cycle is found."""
    graph = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": {"engine.a"}}
    assert _cycles(graph) == [["engine.a", "engine.b"]]
    real = import_graph()
    assert "engine.speculative" in real["engine.generate"]  # module-level import seen
    assert "engine.calibrate" in real["engine.modes"]  # function-level import seen

"""The serving engine's layout (issue 36 item 3): one engine loop that pipeline stages plug a step
strategy into (no Batcher subclass overriding ``run``), the engine split into loading, batch
caches, requests and the loop, no serving module over 800 lines, no import cycle between the
serving package and the distributed one (imports inside functions included)."""

from __future__ import annotations

import ast
import pathlib

import asyncside

PACKAGE = pathlib.Path(asyncside.__file__).parent
MAX_LINES = 800


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every asyncside module ``path`` imports, at any depth of its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("asyncside"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("asyncside"):
                continue
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from . import protocol`
    return out


def graph(paths: list[pathlib.Path]) -> dict[str, set[str]]:
    names = {module_name(p) for p in paths}
    return {module_name(p): {m for m in imports_of(p) if m in names and m != module_name(p)} for p in paths}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def serving_and_distributed() -> list[pathlib.Path]:
    return sorted([*(PACKAGE / "serving").glob("*.py"), *(PACKAGE / "distributed").glob("*.py")])


def test_no_import_cycle_between_serving_and_distributed() -> None:
    g = graph(serving_and_distributed())
    assert "asyncside.distributed.serve" in g["asyncside.serving.cli"]  # the graph sees lazy imports
    bad = [c for c in cycles(g) if any(m.startswith("asyncside.serving") for m in c)]
    assert bad == [], bad


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_serving_module_over_800_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "serving").glob("*.py")}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
    assert {"engine.py", "loading.py", "batch_caches.py", "requests.py"} <= set(sizes)


def test_nothing_subclasses_the_batcher_or_overrides_its_loop() -> None:
    for path in [*PACKAGE.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"Batcher", "batcher", "engine.Batcher"}, (path, node.name, bases)


def test_the_pipeline_plugs_a_step_strategy_into_the_one_batcher() -> None:
    from asyncside.distributed.serve import PipelineSteps
    from asyncside.serving.engine import BatchedSteps, Batcher, StepStrategy

    for strategy in (BatchedSteps, PipelineSteps):
        for method in ("check", "idle", "step"):
            assert callable(getattr(strategy, method)), (strategy, method)
    assert "run" not in vars(PipelineSteps)
    assert StepStrategy.__name__ == "StepStrategy" and Batcher.run is not None

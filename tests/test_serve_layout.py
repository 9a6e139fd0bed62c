"""The serving engine's layout (issue 36 item 3): one engine loop that pipeline stages plug a step
strategy into (no Batcher subclass overriding ``run``), the engine split into loading, batch
caches, requests and the loop, no serving module over 800 lines, no import cycle between the
serving package and the distributed one (imports inside functions included)."""

from __future__ import annotations

import ast
import pathlib

from _imports_support import PACKAGE, cycles, graph

MAX_LINES = 800


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

"""The front door: `asyncside.__all__`, docs/api.md and what imports agree, every exception class
the package defines derives from AsyncsideError, and the package has no import cycle."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

import asyncside

from _imports_support import cycles, graph

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncside"


def _documented() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^\| `(\w+)` \|", text, re.M))


def test_all_matches_the_docs_and_every_name_imports() -> None:
    assert set(asyncside.__all__) == _documented()
    for name in asyncside.__all__:
        assert getattr(asyncside, name) is not None, name
    assert asyncside.Runtime.__module__ == "asyncside.runtime"


def test_import_asyncside_stays_light() -> None:
    code = "import sys, asyncside; print(sorted(m for m in ('mlx', 'numpy', 'asyncside._native') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Exceptions that are not errors of asyncside's own: assertion failures a test helper raises on
# purpose (they must fail a test as assertions do), and private control flow never seen outside.
_EXEMPT = {"LoopBlockedError", "BlockingCallError", "DeadlineExceeded"}


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def test_every_exception_class_derives_from_asyncside_error() -> None:
    bad = []
    for name in _modules():
        if name.endswith("__main__"):
            continue
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == name
                    and not attr.startswith("_") and attr not in _EXEMPT and not issubclass(obj, Warning)
                    and not issubclass(obj, asyncside.AsyncsideError)):
                bad.append(f"{name}.{attr}")
    assert not bad, f"exception classes outside AsyncsideError: {bad}"


def test_no_import_cycle_between_modules() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    g = graph(paths)
    # A package's __init__ importing its own submodules is how a package is made, not a cycle.
    for m in g:
        g[m] = {t for t in g[m] if not t.startswith(m + ".")}
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("source", ["from asyncside import Runtime, ExpertStore, load_streaming_model, load"])
def test_the_readme_import_works(source: str) -> None:
    subprocess.run([sys.executable, "-c", source], check=True)


# Dotted names the docs show that are not Python attributes (a logger's name).
_NOT_ATTRIBUTES = {"asyncside.access"}


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_asyncside_name_the_docs_show_exists() -> None:
    """`asyncside.x.y` in README.md and docs/*.md (inline code, code blocks) names something a user can
    import or reach: `await asyncside.completed(ids)` sent them to a name the package never had."""
    wrong = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for dotted in re.findall(r"(?<![\w./])(asyncside(?:\.[A-Za-z_]\w*)+)", path.read_text()):
            dotted = dotted.rstrip(".")
            if dotted not in _NOT_ATTRIBUTES and not dotted.endswith((".py", ".md")) and not _resolves(dotted):
                wrong.add(f"{path.name}: {dotted}")
    assert not wrong, sorted(wrong)


def test_what_docs_api_shows_of_a_runtime_exists(make_expert_store: Any) -> None:
    """docs/api.md's Runtime keywords, `rt.` calls, `rt.plan.` attributes and `rt.memory[...]` keys are
    the runtime's own."""
    import anyio

    from asyncside import MemoryPlan, Runtime, load

    text = (ROOT / "docs" / "api.md").read_text()
    keywords = set(re.findall(r"Runtime\([^)]*?\b(\w+)=", text))
    assert keywords >= {"read_window", "rows_profile", "policy"}, keywords
    assert keywords <= set(inspect.signature(Runtime).parameters)
    assert set(re.findall(r"load\([^)]*?\b(\w+)=", text)) <= set(inspect.signature(load).parameters)
    calls = set(re.findall(r"`(?:await )?rt\.(\w+)", text))
    assert calls and all(hasattr(Runtime, name) for name in calls), calls
    plan_attrs = set(re.findall(r"rt\.plan\.(\w+)", text))
    keys = set(re.findall(r"rt\.memory\[\"(\w+)\"\]", text))

    from asyncside.memory import proc_self_bytes

    async def main() -> None:
        # A budget counts what the process holds already (a suite's process, late in its run, over
        # a GiB): 1 GiB beyond that.
        budget = proc_self_bytes("status", "VmRSS") + (1 << 30)
        async with Runtime(make_expert_store(), resident=0.5, memory=budget) as rt:
            assert isinstance(rt.plan, MemoryPlan)
            assert [a for a in plan_attrs if not hasattr(rt.plan, a)] == []
            assert keys - set(rt.memory) == set()

    anyio.run(main)

"""The front door: `asyncside.__all__`, docs/api.md and what imports agree, every exception class
the package defines derives from AsyncsideError, and the package has no import cycle."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import asyncside

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


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """Modules of the package that ``module`` imports, at import time or inside its functions (a
    deferred import is a dependency all the same); imports under TYPE_CHECKING do not count."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("asyncside"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("asyncside"):
                    found.add(target)
                    for a in node.names:  # `from . import memory` imports a module
                        found.add(f"{target}.{a.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.AsyncWith, ast.AsyncFor)):
                visit(node.body)
                for extra in getattr(node, "orelse", []), getattr(node, "finalbody", []):
                    visit(extra)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def test_no_import_cycle_between_modules() -> None:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {m: {t for t in _imports(p, m) if t in modules and t != m} for m, p in modules.items()}
    # A package's __init__ importing its own submodules is how a package is made, not a cycle.
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("source", ["from asyncside import Runtime, ExpertStore, load_streaming_model, load"])
def test_the_readme_import_works(source: str) -> None:
    subprocess.run([sys.executable, "-c", source], check=True)

"""Import graphs of the asyncside package for tests: which of its modules each module imports (at
any depth of its code: a deferred import is a dependency all the same), and the cycles among them."""

from __future__ import annotations

import ast
import pathlib

import asyncside

PACKAGE = pathlib.Path(asyncside.__file__).parent


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

"""The front door: `asyncside.__all__`, docs/api.md and what imports agree, every exception class
the package defines derives from AsyncsideError, and the package has no import cycle."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

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

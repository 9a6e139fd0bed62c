"""Comments and docstrings in asyncside/ and native/ carry no dates and no machine names.

A figure measured on one machine on one day goes stale in a comment; BENCHMARKS.md holds the
current figures with their machine and command, so a comment cites its section instead. The
patterns are few on purpose (a date, and the names of the machines this project has measured on),
so a hit is almost surely a comment to rewrite, not a false alarm.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What a comment or docstring may not contain, each with why.
FORBIDDEN = {
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),  # e.g. 2026-12-04: history lives in git
    "GPU model": re.compile(r"\b[HAB]\d00\b"),  # H200, A100, B200: say "MLX CUDA" or "a GPU"
    "dev machine": re.compile(r"\b(dev VM|this VM|the VM|these VMs|project's VMs|Firecracker)\b", re.IGNORECASE),
}

NATIVE_SUFFIXES = {".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh", ".mm"}
# A // comment (not inside a string: the native code puts no // in its string literals that matter
# here, and a false hit would only ask for a look) or a /* ... */ block.
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def _python_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text(encoding="utf-8")
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    # Attribute docstrings (a string right after an assignment) are docstrings too.
    for node in ast.walk(ast.parse(source)):
        for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if not isinstance(block, list):
                continue
            for prev, cur in zip(block, block[1:]):
                if isinstance(prev, (ast.Assign, ast.AnnAssign)) and isinstance(cur, ast.Expr) \
                        and isinstance(cur.value, ast.Constant) and isinstance(cur.value.value, str):
                    out.append((cur.lineno, cur.value.value))
    return out


def _native_texts(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in C_COMMENT.finditer(source)]


def _files() -> list[Path]:
    files = sorted((ROOT / "asyncside").rglob("*.py"))
    files += sorted(p for p in (ROOT / "native").rglob("*") if p.suffix in NATIVE_SUFFIXES)
    return files


def problems(path: Path) -> list[str]:
    """``file:line: kind: 'match'`` for each forbidden pattern in the file's comments and docstrings."""
    texts = _python_texts(path) if path.suffix == ".py" else _native_texts(path)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found = []
    for line, text in texts:
        for kind, pattern in FORBIDDEN.items():
            for m in pattern.finditer(text):
                found.append(f"{rel}:{line + text.count(chr(10), 0, m.start())}: {kind}: {m.group()!r}")
    return found


def test_the_scan_covers_both_trees() -> None:
    files = _files()
    assert any(p.suffix == ".py" for p in files) and any(p.suffix == ".cpp" for p in files)


def test_no_dates_or_machine_names_in_comments_or_docstrings() -> None:
    found = [p for path in _files() for p in problems(path)]
    assert not found, "cite a BENCHMARKS.md section instead:\n" + "\n".join(found)


@pytest.mark.parametrize(("name", "text", "kind"), [
    ("bad.py", "x = 1  # measured on 2026-12-04\n", "date"),
    ("bad.py", 'def f() -> None:\n    """Slower on the H200."""\n', "GPU model"),
    ("bad.py", 'X = 1\n"""On the dev VM, 2 ms."""\n', "dev machine"),
    ("bad.cpp", "int x;  // 0.2 ms on the dev VM\n", "dev machine"),
    ("bad.h", "/* an A100's\n   SMs */\nint y;\n", "GPU model"),
])
def test_each_pattern_is_found(tmp_path: Path, name: str, text: str, kind: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert [p.split(": ")[1] for p in problems(path)] == [kind]


def test_code_itself_is_not_scanned(tmp_path: Path) -> None:
    path = tmp_path / "ok.py"
    path.write_text('LOG = "run of 2026-12-04 on the H200"  # a string, not a comment\n')
    assert problems(path) == []

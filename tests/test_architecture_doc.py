"""docs/ARCHITECTURE.md is the contract between the modules: this keeps it true.

Every fenced ``python`` block of the page names its module on its first line (``# asyncside.store``)
and holds stubs. For each stub this imports the name and compares it with the code: a function's
or method's parameters (names, kinds, defaults, annotations) and return annotation against
``inspect.signature``, ``async`` against the code, decorators (classmethod, staticmethod,
property), a class's bases, attributes (dataclass fields with their annotations; other attributes
must be assigned in the class; constants must equal the documented value), and completeness: every
public method or property a documented class defines must be documented. The ReaderOptions table
must list exactly the native struct's fields and defaults, and the blocking-detector thresholds the
page states must be the code's.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
TEXT = DOC.read_text()
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@dataclasses.dataclass
class Stub:
    module: str
    qualname: str                 # "func" or "Class.member"
    node: ast.AST
    cls: str | None = None        # the class a member belongs to

    @property
    def id(self) -> str:
        return f"{self.module}.{self.qualname}"


def _blocks() -> list[tuple[str, ast.Module]]:
    out = []
    for m in _BLOCK.finditer(TEXT):
        src = m.group(1)
        first = src.splitlines()[0] if src.strip() else ""
        if not re.fullmatch(r"# asyncside(\.\w+)*", first.strip()):
            raise AssertionError(f"a python block of {DOC.name} does not start with '# <module>': {first!r}")
        out.append((first[2:].strip(), ast.parse(src)))
    return out


BLOCKS = _blocks()


def _stubs() -> tuple[list[Stub], list[Stub], list[Stub]]:
    """(functions and methods, attributes and constants, classes) documented on the page."""
    funcs: list[Stub] = []
    attrs: list[Stub] = []
    classes: list[Stub] = []
    for module, tree in BLOCKS:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append(Stub(module, node.name, node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                attrs.append(Stub(module, _target(node), node))
            elif isinstance(node, ast.ClassDef):
                classes.append(Stub(module, node.name, node))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        funcs.append(Stub(module, f"{node.name}.{item.name}", item, node.name))
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        attrs.append(Stub(module, f"{node.name}.{_target(item)}", item, node.name))
    return funcs, attrs, classes


def _target(node: ast.Assign | ast.AnnAssign) -> str:
    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
    assert isinstance(target, ast.Name), ast.unparse(node)
    return target.id


FUNCS, ATTRS, CLASSES = _stubs()


def _norm(annotation: str) -> str:
    return ast.unparse(ast.parse(annotation, mode="eval"))


def _code_annotation(a: Any) -> str | None:
    if a is inspect.Parameter.empty or a is inspect.Signature.empty:
        return None
    return _norm(a if isinstance(a, str) else inspect.formatannotation(a))


def _resolve(stub: Stub) -> tuple[Any, Any]:
    """(module, the documented object; for a member, its raw class attribute)."""
    mod = importlib.import_module(stub.module)
    if stub.cls is None:
        assert hasattr(mod, stub.qualname), f"{stub.id}: no such name in {stub.module}"
        return mod, getattr(mod, stub.qualname)
    cls = getattr(mod, stub.cls, None)
    assert cls is not None, f"{stub.module}.{stub.cls}: no such class"
    name = stub.qualname.split(".", 1)[1]
    try:
        return mod, inspect.getattr_static(cls, name)
    except AttributeError:
        raise AssertionError(f"{stub.id}: {stub.cls} has no member {name!r}") from None


def _unwrapped(stub_node: ast.FunctionDef | ast.AsyncFunctionDef, code: Any) -> tuple[Any, str | None]:
    """The function under the code's descriptor, as the stub's decorators say it is wrapped, or why not."""
    decorators = {ast.unparse(d) for d in stub_node.decorator_list}
    if "property" in decorators:
        if not isinstance(code, property):
            return None, f"documented as a property, is {type(code).__name__}"
        return code.fget, None
    if "classmethod" in decorators or "staticmethod" in decorators:
        kind = classmethod if "classmethod" in decorators else staticmethod
        if not isinstance(code, kind):
            return None, f"documented as a {kind.__name__}, is {type(code).__name__}"
        return code.__func__, None
    if isinstance(code, (property, classmethod, staticmethod)):
        return None, f"is a {type(code).__name__}, documented as a plain function"
    return code, None


def _documented_parameters(a: ast.arguments) -> list[tuple[str, inspect._ParameterKind, ast.expr | None, ast.expr | None]]:
    """The stub's parameters in order: (name, kind, default, annotation)."""
    positional = [*a.posonlyargs, *a.args]
    pos_defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    documented: list[tuple[str, inspect._ParameterKind, ast.expr | None, ast.expr | None]] = []
    for i, arg in enumerate(positional):
        kind = inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD
        documented.append((arg.arg, kind, pos_defaults[i], arg.annotation))
    if a.vararg:
        documented.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None, a.vararg.annotation))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        documented.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default, arg.annotation))
    if a.kwarg:
        documented.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None, a.kwarg.annotation))
    return documented


def _parameter_differences(name: str, kind: inspect._ParameterKind, default: ast.expr | None,
                           annotation: ast.expr | None, p: inspect.Parameter, namespace: dict[str, Any]) -> list[str]:
    """How one documented parameter differs from the code's (kind, default, annotation)."""
    problems: list[str] = []
    if kind != p.kind:
        problems.append(f"parameter {name}: documented {kind.description}, code {p.kind.description}")
    if default is None and p.default is not inspect.Parameter.empty:
        problems.append(f"parameter {name}: the code has a default ({p.default!r}), the page none")
    elif default is not None:
        if p.default is inspect.Parameter.empty:
            problems.append(f"parameter {name}: documented default {ast.unparse(default)}, the code has none")
        else:
            value = eval(compile(ast.Expression(default), "<doc>", "eval"), namespace)
            if not (value is p.default or value == p.default):
                problems.append(f"parameter {name}: documented default {ast.unparse(default)} = {value!r}, "
                                f"code {p.default!r}")
    doc_ann = ast.unparse(annotation) if annotation is not None else None
    code_ann = _code_annotation(p.annotation)
    if doc_ann != code_ann:
        problems.append(f"parameter {name}: documented annotation {doc_ann!r}, code {code_ann!r}")
    return problems


def signature_differences(stub_node: ast.FunctionDef | ast.AsyncFunctionDef, code: Any, namespace: dict[str, Any]) -> list[str]:
    """How the stub and the code's function differ (empty: they agree)."""
    problems: list[str] = []
    fn, wrong = _unwrapped(stub_node, code)
    if wrong is not None:
        return [wrong]
    if not callable(fn):
        return [f"is not callable ({type(fn).__name__})"]
    is_async = isinstance(stub_node, ast.AsyncFunctionDef)
    if is_async != (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        problems.append(f"documented {'async' if is_async else 'sync'}, code is {'async' if not is_async else 'sync'}")
    sig = inspect.signature(fn)
    documented = _documented_parameters(stub_node.args)
    params = list(sig.parameters.values())
    names_doc = [d[0] for d in documented]
    names_code = [p.name for p in params]
    if names_doc != names_code:
        return problems + [f"parameters {names_doc} documented, code has {names_code}"]
    for (name, kind, default, annotation), p in zip(documented, params):
        problems += _parameter_differences(name, kind, default, annotation, p, namespace)
    doc_ret = ast.unparse(stub_node.returns) if stub_node.returns is not None else None
    code_ret = _code_annotation(sig.return_annotation)
    if doc_ret != code_ret:
        problems.append(f"return annotation: documented {doc_ret!r}, code {code_ret!r}")
    return problems


@pytest.mark.parametrize("stub", FUNCS, ids=[s.id for s in FUNCS])
def test_documented_signature_matches_the_code(stub: Stub) -> None:
    mod, code = _resolve(stub)
    assert isinstance(stub.node, (ast.FunctionDef, ast.AsyncFunctionDef))
    problems = signature_differences(stub.node, code, vars(mod))
    assert not problems, f"{stub.id} in {DOC.name} no longer matches the code:\n  " + "\n  ".join(problems)


def _assigned_in_class(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if klass is object:
            continue
        if name in vars(klass) or name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(name)}\s*(:[^=\n]+)?=", src):
            return True
    return False


@pytest.mark.parametrize("stub", ATTRS, ids=[s.id for s in ATTRS])
def test_documented_attribute_exists(stub: Stub) -> None:
    mod = importlib.import_module(stub.module)
    node = stub.node
    name = stub.qualname.rsplit(".", 1)[-1]
    owner: Any = mod if stub.cls is None else getattr(mod, stub.cls)
    value_node = node.value
    if isinstance(node, ast.Assign) or value_node is not None:
        # A constant: it must exist and equal the documented value.
        assert value_node is not None
        assert hasattr(owner, name), f"{stub.id}: missing"
        documented = eval(compile(ast.Expression(value_node), "<doc>", "eval"), vars(mod))
        assert getattr(owner, name) == documented, f"{stub.id}: code has {getattr(owner, name)!r}"
        return
    assert stub.cls is not None, f"{stub.id}: module-level annotations are not part of the convention"
    cls = owner
    if dataclasses.is_dataclass(cls):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert name in fields, f"{stub.id}: not a field of the dataclass (fields: {list(fields)})"
        code_ann = _code_annotation(fields[name].type)
        assert code_ann == ast.unparse(node.annotation), f"{stub.id}: documented {ast.unparse(node.annotation)!r}, code {code_ann!r}"
        return
    annotations = {k: v for klass in reversed(cls.__mro__) for k, v in getattr(klass, "__annotations__", {}).items()}
    if name in annotations:
        code_ann = _code_annotation(annotations[name])
        assert code_ann == ast.unparse(node.annotation), f"{stub.id}: documented {ast.unparse(node.annotation)!r}, code {code_ann!r}"
    assert _assigned_in_class(cls, name), f"{stub.id}: {stub.cls} never sets or declares {name!r}"


def _documented_members() -> dict[tuple[str, str], set[str]]:
    members: dict[tuple[str, str], set[str]] = {}
    for stub in [*FUNCS, *ATTRS]:
        if stub.cls is not None:
            members.setdefault((stub.module, stub.cls), set()).add(stub.qualname.split(".", 1)[1])
    return members


MEMBERS = _documented_members()


@pytest.mark.parametrize("stub", CLASSES, ids=[s.id for s in CLASSES])
def test_documented_class_is_complete(stub: Stub) -> None:
    """Its bases are the documented ones, and every public method or property it defines is
    documented (on it, or on a documented class it inherits the member from)."""
    mod = importlib.import_module(stub.module)
    cls = getattr(mod, stub.qualname, None)
    assert inspect.isclass(cls), f"{stub.id}: no such class"
    assert isinstance(stub.node, ast.ClassDef)
    if stub.node.bases:
        documented = [ast.unparse(b).rsplit(".", 1)[-1] for b in stub.node.bases]
        assert documented == [b.__name__ for b in cls.__bases__], f"{stub.id}: bases"
    documented_here: set[str] = set()
    for klass in cls.__mro__:
        # A class documented under the package that re-exports it (asyncside.runtime.MemoryPlan,
        # defined in asyncside.runtime._plan) counts under either name.
        documented_here |= MEMBERS.get((klass.__module__, klass.__name__), set())
        documented_here |= MEMBERS.get((stub.module, klass.__name__), set())
    missing = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(raw) or isinstance(raw, (property, classmethod, staticmethod)):
            if name not in documented_here:
                missing.append(name)
    assert not missing, f"{stub.id}: public members not in {DOC.name}: {missing}"


def test_the_comparison_catches_drift() -> None:
    """The checker itself fails on a changed default, a renamed parameter, a changed annotation or
    a lost async (a test that cannot fail checks nothing)."""
    from asyncside import runtime
    from asyncside.runtime import Runtime

    def stub(src: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        node = ast.parse(src).body[0]
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        return node

    ns = vars(runtime)
    good = "def lookup(self, layer: int) -> mx.array: ..."
    assert signature_differences(stub(good), Runtime.lookup, ns) == []
    assert signature_differences(stub("def lookup(self, index: int) -> mx.array: ..."), Runtime.lookup, ns)
    assert signature_differences(stub("def lookup(self, layer: str) -> mx.array: ..."), Runtime.lookup, ns)
    assert signature_differences(stub("def lookup(self, layer: int, extra: int = 0) -> mx.array: ..."), Runtime.lookup, ns)
    assert signature_differences(stub("async def lookup(self, layer: int) -> mx.array: ..."), Runtime.lookup, ns)
    drain = "async def drain(self, layer: int | None = 1) -> None: ..."
    assert signature_differences(stub(drain), Runtime.drain, ns)


def _reader_options_table() -> dict[str, str]:
    section = TEXT.split("## Reader options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.M)
    assert rows, "no ReaderOptions table found"
    return dict(rows)


def test_reader_options_table_is_the_native_struct() -> None:
    from asyncside.readers import ReaderOptions

    table = _reader_options_table()
    assert list(table) == list(ReaderOptions.field_names())
    defaults = ReaderOptions()
    for field, default in table.items():
        assert ast.literal_eval(default) == getattr(defaults, field), f"ReaderOptions.{field}"


def test_blocking_thresholds_stated_are_the_code_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncside.testing_blocking import default_threshold

    monkeypatch.delenv("ASYNCSIDE_BLOCKING_THRESHOLD_MS", raising=False)
    stated_default = re.search(r"blocks\s+longer than the threshold: (\d+) ms by default", TEXT)
    stated_suite = re.search(r"this repository's suite sets (\d+) ms", TEXT)
    assert stated_default and stated_suite
    assert int(stated_default.group(1)) == round(default_threshold() * 1000)
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    suite = re.search(r'setdefault\("ASYNCSIDE_BLOCKING_THRESHOLD_MS", "(\d+)"\)', conftest)
    assert suite and stated_suite.group(1) == suite.group(1)


# ---------------------------------------------------------------------------------------------
# The layout block: every path it names exists, and it names every package and module of asyncside/.

# A line's leading names: "a.py", "a.py, b.py", "models/", "expert_faults.*", then a space or the end.
_LEAD = re.compile(r"([\w*]+(?:\.[\w*]+)*/?(?:,\s*[\w*]+(?:\.[\w*]+)*/?)*)(?:\s|$)")


def layout_entries(text: str) -> list[str]:
    """The paths the "Layout" section's code block names, relative to the repository root.

    A line's leading names (``a.py, b.py  what they do``, ``models/``) are paths under the
    directory named on the last less indented line; an indented line that does not start with a
    name continues a description.
    """
    section = text.split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    parents: list[tuple[int, str]] = []  # (indent, directory) of the open directories
    paths: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        lead = _LEAD.match(line.strip())
        names = [n for n in re.split(r",\s*", lead.group(1))] if lead else []
        if not all("." in n or n.endswith("/") for n in names):
            names = []
        if not names:
            continue  # a description's continuation
        while parents and parents[-1][0] >= indent:
            parents.pop()
        prefix = parents[-1][1] if parents else ""
        for name in names:
            paths.append(prefix + name)
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, prefix + names[0]))
    return paths


def test_layout_block_parses_names_and_nesting() -> None:
    text = "## Layout\n\n```\npkg/\n  a.py, b.py  two modules,\n               described\n  sub/       a package\n" \
           "    c.py       deeper\n  d.* one glob\n  more, words: not names\nnative/\n  e.cpp\n```\n"
    assert layout_entries(text) == ["pkg/", "pkg/a.py", "pkg/b.py", "pkg/sub/", "pkg/sub/c.py", "pkg/d.*",
                                    "native/", "native/e.cpp"]


def test_layout_names_only_what_exists() -> None:
    missing = [p for p in layout_entries(TEXT) if not any(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"{DOC.name}'s layout names paths that do not exist: {missing}"


def test_layout_names_every_package_and_module_of_asyncside() -> None:
    """Every package directory under asyncside/ and every top-level module is in the layout."""
    named = {p.rstrip("/") for p in layout_entries(TEXT)}
    pkg = ROOT / "asyncside"
    wanted = [d for d in sorted(pkg.rglob("__init__.py")) if d.parent != pkg]
    wanted_paths = [d.parent.relative_to(ROOT).as_posix() for d in wanted]
    wanted_paths += [f.relative_to(ROOT).as_posix() for f in sorted(pkg.glob("*.py"))
                     if not f.name.startswith("_")]
    omitted = [p for p in wanted_paths if p not in named]
    assert not omitted, f"{DOC.name}'s layout omits: {omitted}"

"""Run a slice of the suite against the lowest (or the newest) versions pyproject.toml allows.

    python tools/floors_check.py VENV [--newest] [--native SO] [--install-only] [TEST_FILE ...]

CI installs the newest release of every dependency, so a floor in pyproject.toml (``anyio>=...``)
is never tried there. This builds VENV with every dependency of the package and of its ``bench``
and ``test`` extras at its declared floor (pip's ``--constraint name==floor``; MLX stays at its
pin), or with ``--newest`` at the newest release the specifiers allow, and runs the test files one
at a time (default: :data:`SLICE`). A failure is either a floor that is too low or code that needs
something newer than it has to.

The package is not installed (installing it builds the native extension): VENV imports asyncside
from this checkout, and its ``_native`` from a copy of an extension already built against the
pinned MLX (``--native``; default: the one in the checkout's ``.venv``), put where its RPATH finds
libmlx. A dist-info carries the package's entry points (the ``asyncside`` command, the pytest
plugin). Needs the package index. docs/testing.md, "Dependency floors", says how the floors were
established.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: test files run by default: the runtime, the model walks, serving, the facade, the asyncio bridge
#: and the examples (which run the CLI, the pytest plugin and a server as a user does)
SLICE = ("tests/test_runtime.py", "tests/test_queued.py", "tests/test_models.py", "tests/test_serve.py",
         "tests/test_facade.py", "tests/test_bridge_asyncio.py", "tests/test_examples.py")

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;\s*(.*))?$")
_MARKER = re.compile(r"""^sys_platform\s*(==|!=)\s*['"]([^'"]+)['"]$""")


def _marker_holds(marker: str | None) -> bool:
    """Whether a requirement's marker holds here; only the ``sys_platform`` markers pyproject uses."""
    if not marker:
        return True
    m = _MARKER.match(marker.strip())
    if m is None:
        raise SystemExit(f"pyproject.toml: marker {marker!r} is not one this tool evaluates (sys_platform == / !=)")
    return (sys.platform == m.group(2)) == (m.group(1) == "==")


def requirements(pyproject: Path, extras: tuple[str, ...] = ("bench", "test")) -> list[str]:
    """The requirement strings of the package and of ``extras`` that hold on this platform, the
    package's own extras (``asyncside[bench]``) expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    todo = [*project["dependencies"], *(r for e in extras for r in optional[e])]
    while todo:
        raw = todo.pop(0)
        m = _REQ.match(raw)
        if m is None:
            raise SystemExit(f"pyproject.toml: requirement {raw!r} is not one this tool parses")
        if not _marker_holds(m.group(4)):
            continue
        if m.group(1) == project["name"]:
            todo.extend(r for e in (m.group(2) or "[]")[1:-1].split(",") if e for r in optional[e.strip()])
        elif raw not in out:
            out.append(raw)
    return out


def floor_constraints(reqs: list[str]) -> list[str]:
    """``name==version`` for each requirement's floor (``>=``) or pin (``==``)."""
    out = []
    for raw in reqs:
        m = _REQ.match(raw)
        assert m is not None
        for part in m.group(3).split(","):
            part = part.strip()
            if part.startswith((">=", "==")):
                out.append(f"{m.group(1)}=={part[2:].strip()}")
    return out


def _pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _site_packages(venv: Path) -> Path:
    found = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
    if len(found) != 1:
        raise SystemExit(f"{venv}: expected one lib/python3*/site-packages, found {found}")
    return Path(found[0])


def link_checkout(venv: Path, native: Path) -> None:
    """Make VENV import asyncside from this checkout, with ``native`` as its ``_native``."""
    site = _site_packages(venv)
    # The extension finds libmlx through its RPATH ($ORIGIN/../mlx/lib): it must sit in a
    # directory beside the venv's mlx. A directory without __init__.py there is only a namespace
    # portion, which the checkout's package (a regular one, on the path below) wins over.
    target = site / "asyncside" / native.name
    target.parent.mkdir(exist_ok=True)
    shutil.copy2(native, target)
    (site / "_asyncside_checkout.py").write_text(
        "import importlib.abc, importlib.util, sys\n\n\n"
        "class _Native(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'asyncside._native':\n"
        "            return None\n"
        f"        return importlib.util.spec_from_file_location(name, {str(target)!r})\n\n\n"
        "sys.meta_path.insert(0, _Native())\n")
    (site / "_asyncside_checkout.pth").write_text(f"import _asyncside_checkout\n{ROOT}\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = ["[console_scripts]", *(f"{k} = {v}" for k, v in project.get("scripts", {}).items())]
    for group, entries in project.get("entry-points", {}).items():
        points += ["", f"[{group}]", *(f"{k} = {v}" for k, v in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(points) + "\n")
    (info / "INSTALLER").write_text("tools/floors_check.py\n")
    for name, target_ref in project.get("scripts", {}).items():
        module, func = target_ref.split(":")
        script = venv / "bin" / name
        script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {func}\n"
                          f"sys.exit({func}())\n")
        script.chmod(0o755)


def _default_native() -> Path | None:
    found = glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages" / "asyncside" / "_native*.so"))
    return Path(found[0]) if found else None


def main(argv: list[str] | None = None) -> int:
    """Build the venv, link the checkout, run the test files one at a time; 1 if any failed."""
    ap = argparse.ArgumentParser(prog="tools/floors_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path, help="the virtual environment to build (created if missing)")
    ap.add_argument("tests", nargs="*", default=list(SLICE), help="test files to run, one pytest each")
    ap.add_argument("--newest", action="store_true", help="the newest versions allowed, not the floors")
    ap.add_argument("--native", type=Path, default=_default_native(),
                    help="a built asyncside/_native*.so (default: the checkout's .venv)")
    ap.add_argument("--install-only", action="store_true", help="build the venv and stop")
    args = ap.parse_args(argv)
    if args.native is None or not args.native.is_file():
        ap.error(f"--native: no built extension at {args.native} (build the checkout once: pip install -e .)")
    venv: Path = args.venv.absolute()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    reqs = requirements(ROOT / "pyproject.toml")
    # Wheels only: a source build of a dependency would test the local compiler, not the floor.
    pip_args = ["install", "--only-binary", ":all:"]
    if args.newest:
        _pip(venv, *pip_args, "--upgrade", "--upgrade-strategy", "eager", *reqs)
    else:
        constraints = venv / "floors-constraints.txt"
        constraints.write_text("\n".join(floor_constraints(reqs)) + "\n")
        _pip(venv, *pip_args, "--constraint", str(constraints), *reqs)
    link_checkout(venv, args.native.absolute())
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list"], check=True)
    if args.install_only:
        return 0
    failed = []
    for test in args.tests:
        cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).returncode != 0:
            failed.append(test)
    print(f"{len(args.tests) - len(failed)} of {len(args.tests)} test files passed" +
          (f"; failed: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``asyncside`` command's shape: ``python -m asyncside`` works, ``--help`` imports nothing heavy,
and each subcommand's options come from its own module only when that subcommand runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
from asyncside.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"mlx", "mlx_lm", "numpy", "anyio"}
               or m == "asyncside._native")
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    report = json.loads(out.stderr.strip().splitlines()[-1])
    return report, out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]], ids=["top", "bench"])
def test_help_imports_no_mlx(argv: list[str]) -> None:
    report, stdout = _probe(*argv)
    assert report["code"] == 0 and "usage: asyncside" in stdout
    assert report["heavy"] == [], f"`asyncside {' '.join(argv)}` imported {report['heavy']}"


def test_subcommand_help_builds_only_its_own_options() -> None:
    report, stdout = _probe("bench", "io", "--help")
    assert report["code"] == 0 and "--chunk-kib" in stdout and "--json" in stdout
    assert "mlx_lm" not in report["heavy"]  # the io bench needs the native reader options, not mlx-lm


def test_python_dash_m_asyncside() -> None:
    out = subprocess.run([sys.executable, "-m", "asyncside", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: asyncside") and "convert" in out.stdout and "bench" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncside", "nonsense"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'nonsense'" in bad.stderr


def test_every_subcommand_parser_builds() -> None:
    """Without argv the parser carries every subcommand's options (what --help of each shows)."""
    from asyncside.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "io", "--quick", "--json"])
    assert args.bench == "io" and args.quick and args.json
    args = parser.parse_args(["demo", "--resident", "0.5"])
    assert args.command == "demo" and args.resident == 0.5

"""Running the ``asyncside`` command in-process, as a test sees it: the exit status and stderr."""

from __future__ import annotations

import pytest

from asyncside import cli


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``asyncside ARGV``: (exit status, stderr); a SystemExit from argparse is its code."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    return rc, capsys.readouterr().err

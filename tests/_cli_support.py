"""Running the ``asyncside`` command in-process, as a test sees it: the exit status and stderr."""

from __future__ import annotations

import argparse

import pytest

from asyncside import cli


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``asyncside ARGV``: (exit status, stderr); a SystemExit from argparse is its code."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    return rc, capsys.readouterr().err


def offload_args(*argv: str) -> argparse.Namespace:
    """``asyncside bench offload ARGV`` parsed as the command parses it, with ``--json``."""
    from asyncside.bench import offload

    p = argparse.ArgumentParser()
    offload.add_offload_arguments(p)
    args = p.parse_args(list(argv))
    args.json = True
    return args

"""The larger-than-memory path on inputs the repository never made: numbers typed at the options,
shapes and routing traces written by hand, budgets from absurd to roomy. Every bad input is a
one-line usage error (exit status 2) naming the option or the file; nothing ends in a traceback.
"""

from __future__ import annotations

import argparse

import pytest

from asyncside import cli
from asyncside.bench import offload

MB = 1_000_000


def parse_offload(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    offload.add_offload_arguments(p)
    args = p.parse_args(list(argv))
    args.json = True
    return args


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``asyncside ARGV``: (exit status, stderr); a SystemExit from argparse is its code."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [
    ("--seconds", "0"), ("--seconds", "-1"), ("--seconds", "nan"), ("--seconds", "inf"),
    ("--tokens", "0"), ("--tokens", "-3"), ("--timeout", "0"), ("--timeout", "nan"),
    ("--store-ratio", "0"), ("--store-ratio", "-1"), ("--store-ratio", "nan"), ("--store-ratio", "many"),
])
def test_offload_numbers_are_checked_when_parsed(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero, negative or NaN --seconds/--tokens/--timeout/--store-ratio was taken (a ratio of 0 then
    divided by zero, NaN failed converting to an int, after the shapes were built): a usage error."""
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", "no-such-shape:2", option, value)
    assert rc == 2, err
    last = err.strip().splitlines()[-1]
    assert option in last and value in last and "Traceback" not in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--localities", "lowish"], ["--localities", "lowish", "low, middle, high"]),
    (["--systems", "vllm"], ["--systems", "vllm", "asyncside"]),
    (["--localities", ""], ["--localities", "--routing"]),
])
def test_offload_unknown_names_are_usage_errors(argv: list[str], words: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown preset or system, or nothing to replay, exited with status 1 like a failed run."""
    rc, err = run_cli(capsys, "bench", "offload", "--shapes", "no-such-shape:2", *argv)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


def test_python_m_offload_says_a_usage_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m asyncside.bench.offload`` refuses as ``asyncside bench offload`` does (no traceback)."""
    rc = offload.main(["--systems", "vllm"])
    err = capsys.readouterr().err
    assert rc == 2 and "--systems" in err and "Traceback" not in err, err

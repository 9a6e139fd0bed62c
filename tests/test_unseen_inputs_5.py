"""Inputs the repository never made, fifth sweep: a negative size after its option as people type it
(``--memory -1G``, not ``--memory=-1G``). What is refused is one line naming the option and what went
wrong.
"""

from __future__ import annotations

import argparse

import pytest
from _cli_support import run_cli

#: every option of every command that takes a SIZE, with the command that has it
SIZE_OPTIONS = [
    (("demo",), "--memory", "memory"), (("demo",), "--host-tier", "host tier"),
    (("serve",), "--memory", "memory"), (("serve",), "--host-tier", "host tier"),
    (("serve",), "--prompt-cache-bytes", "size"), (("serve",), "--mlx-cache-limit", "size"),
    (("bench", "serve"), "--memory", "memory"), (("bench", "serve"), "--host-tier", "host tier"),
    (("bench", "serve"), "--prompt-cache-bytes", "size"), (("bench", "serve"), "--mlx-cache-limit", "size"),
    (("bench", "offload"), "--memory", "memory"),
]


@pytest.mark.parametrize(("command", "option", "what"), SIZE_OPTIONS)
@pytest.mark.parametrize("value", ["-1G", "-.5G", "-1e3M"])
def test_a_negative_size_after_its_option_says_what_is_wrong(command: tuple[str, ...], option: str, what: str,
                                                            value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncside demo --memory -1G`` said "argument --memory: expected one argument": argparse took
    ``-1G`` for an option (only ``-1`` and ``-.5`` look like numbers to it). It says what
    ``--memory=-1G`` says."""
    rc, err = run_cli(capsys, *command, option, value)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line == f"asyncside {' '.join(command)}: error: argument {option}: {what} '{value}': expected a size >= 0"
    rc, joined = run_cli(capsys, *command, f"{option}={value}")
    assert rc == 2 and joined.strip().splitlines()[-1] == line, joined


def test_an_abbreviated_size_option_is_read_as_argparse_reads_it(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, "demo", "--mem", "-1G")
    assert rc == 2 and err.strip().endswith("error: argument --memory: memory '-1G': expected a size >= 0"), err


@pytest.mark.parametrize("argv", [["demo", "--memory", "--tokens", "4"], ["demo", "--memory"],
                                  ["serve", "--prompt-cache-bytes", "--port", "0"]])
def test_a_size_option_followed_by_an_option_still_needs_its_value(argv: list[str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and err.strip().endswith(f"error: argument {argv[1]}: expected one argument"), err


def test_a_negative_number_after_any_other_option_is_left_to_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    """Only SIZE options are joined with their value: ``--tokens -1`` is argparse's own negative number."""
    rc, err = run_cli(capsys, "demo", "--tokens", "-1")
    assert rc == 2 and "argument --tokens" in err and "expected one argument" not in err, err
    rc, err = run_cli(capsys, "demo", "--memory", "1G", "--", "-1G")
    assert rc == 2 and "unrecognized arguments:" in err and "memory" not in err, err


def _commands(parser: argparse.ArgumentParser, name: str = "asyncside") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                found += _commands(p, f"{name} {sub}")
    return found


def test_every_size_option_is_shown_as_size() -> None:
    """The parser joins the value of an option shown as SIZE: an option taking a size (``1G`` is a
    GiB) shown otherwise would say "expected one argument" to ``-1G`` again."""
    from asyncside.argtypes import CommandParser
    from asyncside.cli import build_parser

    sized = []
    for name, parser in _commands(build_parser()):
        assert isinstance(parser, CommandParser), name
        for action in parser._actions:
            try:
                takes_size = callable(action.type) and action.type("1G") == 1 << 30
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                takes_size = False
            if takes_size:
                assert action.metavar == "SIZE", (name, action.option_strings)
                sized.append((name, action.option_strings[0]))
    assert len(sized) >= len(SIZE_OPTIONS), sized

"""What README.md and docs/*.md show a newcomer to type: every `asyncside ...` command line they
show (in a code block, wrapped usage lines included, or in inline code) names only options its
subcommand has, so copying one never ends in argparse's "unrecognized arguments"."""

from __future__ import annotations

import argparse
import pathlib
import re
from collections.abc import Iterator

from asyncside.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
COMMAND = re.compile(r"(?:^|\s)(?:asyncside|-m asyncside\.cli) ([a-z].*)")
# Prose often names a command without the program: `demo --routing FILE`, `bench serve --json`.
BARE = re.compile(r"^((?:demo|serve|convert|routing|bench) .*)")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _command_texts(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each code-block line, with its wrapped continuation lines joined, and of each
    inline code span."""
    in_block = False
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block
            if pending:
                yield pending
                pending = None
            continue
        if in_block:
            code = line.split("  #")[0]  # a trailing comment is prose
            if pending and (pending[1].endswith("\\") or re.match(r"\s+\[", code)):
                pending = (pending[0], pending[1].rstrip("\\") + " " + code.strip())
                continue
            if pending:
                yield pending
            pending = (n, code)
        else:
            for m in re.finditer(r"`([^`]+)`", line):
                yield n, m.group(1)
    if pending:
        yield pending


def _documented_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(where, subcommand path, options) of every asyncside command line in the docs (with or
    without the program's name); `a|b` alternatives of a subcommand name, and `info X | preset Y`
    alternatives of a whole tail, are each a command of their own."""
    for path in DOCS:
        for n, text in _command_texts(path.read_text()):
            m = COMMAND.search(text) or BARE.match(text)
            if m is None:
                continue
            words = m.group(1).split()
            for alternative in " ".join(words[1:]).split(" | "):
                rest = alternative.split()
                for command in words[0].split("|"):
                    if rest and re.fullmatch(r"[a-z]+(\|[a-z]+)*", rest[0]):
                        for sub in rest[0].split("|"):
                            yield f"{path.name}:{n}", f"{command} {sub}", rest[1:]
                    else:
                        yield f"{path.name}:{n}", command, rest


def test_every_option_a_doc_shows_exists() -> None:
    parser = build_parser()
    top = _subcommands(parser)
    wrong = []
    seen = 0
    for where, name, rest in _documented_commands():
        command, _, sub = name.partition(" ")
        if command not in top:
            continue
        target = top[command]
        subs = _subcommands(target)
        if subs:
            if sub not in subs:
                continue  # a positional argument, not a subcommand
            target = subs[sub]
        else:
            name = command
        seen += 1
        missing = {o for w in rest for o in OPTION.findall(w)} - _options(target)
        if missing:
            wrong.append(f"{where}: asyncside {name} has no {sorted(missing)}")
    assert seen > 20, "the docs' commands were not found"
    assert not wrong, "\n".join(wrong)


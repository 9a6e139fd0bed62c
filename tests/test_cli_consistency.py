"""One meaning per option across the subcommands, and every refusal a one-line usage error."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncside.cli import build_parser
from asyncside.store import ExpertStore

# The three subcommands taking --resident, with the positional arguments each needs.
RESIDENT_COMMANDS = {"demo": ["demo"], "serve": ["serve"], "convert": ["convert", "model", "store"]}


def parse(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", sorted(RESIDENT_COMMANDS))
@pytest.mark.parametrize("text, value", [("0", 0.0), ("0%", 0.0), ("0.25", 0.25), ("25%", 0.25), ("1", 1.0),
                                         (" 100% ", 1.0)])
def test_resident_means_the_same_everywhere(command: str, text: str, value: float) -> None:
    """0 is nothing resident (every expert streamed through the least rows) in all three."""
    assert parse([*RESIDENT_COMMANDS[command], "--resident", text]).resident == value


@pytest.mark.parametrize("command", sorted(RESIDENT_COMMANDS))
@pytest.mark.parametrize("bad", ["-0.1", "1.5", "110%", "nan", "inf", "lots", ""])
def test_resident_refused_the_same_everywhere(command: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([*RESIDENT_COMMANDS[command], "--resident", bad], capsys)
    assert err.startswith(f"asyncside {command}: error: argument --resident: expected a fraction in [0, 1], got {bad}")


def test_resident_auto_only_where_it_means_something(capsys: pytest.CaptureFixture[str]) -> None:
    """``auto`` sizes the pools to the memory budget: a run's setting, not a store's recorded set."""
    for command in ("demo", "serve"):
        assert parse([*RESIDENT_COMMANDS[command], "--resident", "AUTO"]).resident == "auto"
    err = refused([*RESIDENT_COMMANDS["convert"], "--resident", "auto"], capsys)
    assert "got auto" in err and "'auto'" not in err


def test_resident_zero_runs(expert_store: ExpertStore) -> None:
    """The value the parsers give for ``--resident 0`` is one the Runtime takes: the least rows."""
    from asyncside.runtime import Runtime
    from asyncside.runtime._plan import min_rows

    resident = parse(["demo", "--resident", "0"]).resident

    async def rows() -> dict[Any, int]:
        async with Runtime(expert_store, resident=resident) as rt:
            return dict(rt.memory["rows"])

    assert set(anyio.run(rows).values()) == {min(min_rows(expert_store), expert_store.layer(0).n_experts)}

"""Unseen inputs, round 14: a new user's machine and files, as the Python API and the command line
meet them: where the store lives, the store changing under a running process, and the process
itself (signals, pipes, limits). What is refused is one line naming the file or argument."""

from __future__ import annotations

import pathlib

import anyio
import pytest

from asyncside import ExpertStore, Runtime
from asyncside.runtime import PlanArgumentError


@pytest.mark.parametrize(("resident", "rows"), [("25%", 8), (" 50% ", 16), ("0.25", 8), ("AUTO", None)])
def test_a_runtime_takes_a_residency_as_the_command_line_writes_it(resident: str, rows: int | None,
                                                                  quick_store: pathlib.Path) -> None:
    """``Runtime(store, resident="25%")`` was refused ("expected a fraction in [0, 1] or 'auto', got
    '25%'") though ``demo --resident 25%`` takes it: a string is read by the one parser the command
    line uses, and what it refuses is refused naming ``resident``."""
    async def go() -> dict[int, int]:
        async with Runtime(ExpertStore.open(quick_store), resident=resident, min_side_rows=1) as rt:
            assert rt.plan is not None
            return dict(rt.plan.rows)

    planned = anyio.run(go)
    if rows is not None:
        assert set(planned.values()) == {rows}
    for bad in ("125%", "x", "", "auto%"):
        with pytest.raises(PlanArgumentError, match=r"^resident: expected a fraction in \[0, 1\], got "):
            Runtime(ExpertStore.open(quick_store), resident=bad)

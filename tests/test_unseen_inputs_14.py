"""Unseen inputs, round 14: a new user's machine and files, as the Python API and the command line
meet them: where the store lives, the store changing under a running process, and the process
itself (signals, pipes, limits). What is refused is one line naming the file or argument."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import anyio
import pytest

from asyncside import ExpertStore, Runtime
from asyncside.errors import StoreError
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


@pytest.mark.parametrize(("how", "said"), [
    ("budget", "the plan chose O_DIRECT (the 1.5 MiB of records outside the pools exceed "),
    ("argument", "O_DIRECT was asked for: leave out direct=True (--direct)"),
    ("variable", "O_DIRECT was asked for by $ASYNCSIDE_DIRECT: set it to 0"),
])
def test_a_filesystem_that_refuses_o_direct_says_how_to_read_buffered(how: str, said: str, quick_store: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store on a filesystem that refuses O_DIRECT (EINVAL when opened: an older tmpfs such as
    /dev/shm, some FUSE mounts) under a budget that made the plan read past the page cache failed
    with "(the filesystem refuses direct I/O; read it buffered)", naming no way to: the plan had
    chosen O_DIRECT itself. The refusal says why the reads were direct and what reads buffered;
    with direct=False the same runtime runs."""
    import errno
    import os

    import asyncside.runtime._plan as plan_mod

    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0) and str(quick_store) in str(path):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)  # the budget is the plan's alone
    monkeypatch.delenv("ASYNCSIDE_DIRECT", raising=False)
    kwargs: dict[str, Any] = {"memory": "257M"} if how == "budget" else {"direct": True} if how == "argument" else {}
    if how == "variable":
        monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")

    async def go(**extra: Any) -> bool:
        async with Runtime(ExpertStore.open(quick_store), reader="aiofiles", **{**kwargs, **extra}) as rt:
            assert rt.plan is not None
            return rt.plan.direct

    with pytest.raises(StoreError) as info:
        anyio.run(go)
    assert "cannot open with O_DIRECT" in str(info.value) and said in str(info.value), str(info.value)
    assert anyio.run(functools.partial(go, direct=False)) is False

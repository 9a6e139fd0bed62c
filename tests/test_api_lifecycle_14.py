"""The Python API inside someone else's program, round 14: a user's own async program, notebook
and test suite around ``load()`` and the Runtime. An interruption or misuse ends in a clear error
and leaves no runtime open behind it: no pools, reads or descriptors held with nothing left to
close them.
"""

from __future__ import annotations

import pathlib
import signal
import threading
from typing import Any

import pytest


def test_load_interrupted_while_its_runtime_is_entered_leaves_it_closed(quick_store: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in a notebook while ``load()`` waited for its runtime to be entered: the interruption
    reached the caller, but the runtime task went on, entered the runtime and held its pools, reads
    and descriptors until the process ended, with no model returned to close it. The runtime is
    now closed once ``load()`` has raised."""
    from asyncside import facade
    from asyncside.runtime import _fills

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    shared: list[Any] = []
    real_setup = _fills.HostFills.setup

    async def setup_then_interrupt(self: Any, *args: Any, **kwargs: Any) -> None:
        # Inside the entry, on the runtime thread, with the pools allocated: Ctrl-C now.
        shared.append(self._s)
        await real_setup(self, *args, **kwargs)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        import anyio

        await anyio.sleep(60)  # the entry is still going when the interruption lands

    monkeypatch.setattr(_fills.HostFills, "setup", setup_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        facade.load(quick_store, progress=False)
    assert shared, "the runtime was never entered"
    assert shared[0].closed and shared[0].exited, "the runtime load() was entering is still open"


@pytest.mark.parametrize("other_loop", ["asyncio", "uvloop"])
def test_a_runtime_used_from_another_loop_of_its_thread_is_refused(expert_store: Any, other_loop: str) -> None:
    """A Runtime entered on one event loop and used from another loop of the same thread (a second
    ``asyncio.run``, a pytest-asyncio fixture on another loop scope than its test's) passed the
    check of threads: an ``ensure`` that read waited for a completion only the first loop, which
    nobody ran then, would deliver, and hung. Each call is refused at once, naming the way out;
    the runtime goes on on its own loop and closes clean."""
    import asyncio

    import uvloop

    from asyncside import Runtime
    from asyncside.audit import audit_problems
    from asyncside.errors import AsyncsideError

    rt = Runtime(expert_store, resident=0.25)
    loop = asyncio.new_event_loop()
    entered, leave = loop.create_future(), asyncio.Event()

    async def owner() -> None:
        async with rt:
            entered.set_result(None)
            await leave.wait()
            await rt.ensure(0, [1, 2])

    task = loop.create_task(owner())
    loop.run_until_complete(entered)

    async def other() -> None:
        said = r"the runtime is used from another event loop than the one that entered it"
        with pytest.raises(AsyncsideError, match=said):
            await rt.ensure(0, [1, 2])
        with pytest.raises(AsyncsideError, match=said):
            rt.prefetch(0, [3])
        with pytest.raises(AsyncsideError, match=said):
            rt.lease(0, [1])

    try:
        if other_loop == "uvloop":
            uvloop.run(asyncio.wait_for(other(), 600))  # a hang guard, never a timing assertion
        else:
            asyncio.run(asyncio.wait_for(other(), 600))
        loop.call_soon(leave.set)
        loop.run_until_complete(task)
    finally:
        loop.close()
    assert audit_problems(rt) == []

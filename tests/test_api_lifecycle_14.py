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

"""A Runtime whose exit is interrupted still closes: a BaseException (a KeyboardInterrupt) raised
while the exit waits for the queued steps to finish reaches the caller, and the runtime is closed
all the same: its task group and read scheduler exited, later calls refused as after any exit.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from _fault_helpers import LOOPS, run_guarded

from asyncside import ExpertStore, Runtime
from asyncside.errors import AsyncsideError
from asyncside.models import ForwardOptions


class Interrupt(BaseException):
    """What a KeyboardInterrupt landing in the exit's wait stands for."""


@pytest.mark.parametrize("loop", LOOPS)
def test_an_exit_interrupted_while_queued_steps_finish_still_closes(loop: Any, quick_store: pathlib.Path) -> None:
    """The exit waits (shielded) for the queued steps and takes the lent rows back; an interrupt
    there skipped the rest of the exit: the runtime stayed open with its rows lent (a lease after it
    failed on a lent row, not on a closed runtime), its scheduler and task group never exited, and
    on trio the event loop's run then failed with an internal error."""
    from asyncside.models import load_streaming_model

    sm = load_streaming_model(quick_store)
    prompt = list(sm.tokenizer.encode("Mixture of experts stream"))

    async def main() -> Runtime:
        rt = Runtime(ExpertStore.open(quick_store), resident=0.25)
        with pytest.raises(Interrupt):
            async with rt:
                tokens = [t async for t in sm.generate(prompt, max_tokens=2, source=rt,
                                                       options=ForwardOptions(mode="queued"))]
                assert len(tokens) == 2 and rt.queued_active  # the exit has queued steps to wait for
                real = rt.queued.quiesce

                async def interrupted() -> None:
                    rt.queued.quiesce = real  # type: ignore[method-assign]
                    raise Interrupt("at the exit")

                rt.queued.quiesce = interrupted  # type: ignore[method-assign]
        with pytest.raises(AsyncsideError, match="the runtime is closed"):
            rt.lease(min(rt.store.layers), [0])
        return rt

    rt = run_guarded(main, loop=loop)
    assert rt._s.exited  # private on purpose: the scheduler and the task group were exited

"""A lease released after a computation that fails: ``rt.release_after(x, leases)`` whose ``x``
fails on its stream releases the rows and leaves the runtime running. The release task raised the
computation's error inside the runtime's task group, which cancelled the whole ``async with
Runtime(...)`` body (whatever it was doing) and raised the error again, in an ExceptionGroup, at
the exit; the step's own awaiter is the one to hear of the failure.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest
from _fault_helpers import LOOPS, run_guarded

from asyncside import ExpertStore, Runtime
from asyncside.audit import audit_problems
from asyncside.bridge import ComputationError, completed


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failed_computation_releases_its_leases_and_the_runtime_goes_on(loop: Any,
                                                                          quick_store: pathlib.Path) -> None:
    failing = mx.array([1.0]) * 2  # the computation whose failure the completion reports

    async def completion(x: mx.array, **kwargs: Any) -> None:
        if x is failing:
            await anyio.lowlevel.checkpoint()
            raise ComputationError("the stream failed")
        await completed(x, **kwargs)

    async def main() -> tuple[Runtime, list[str]]:
        done: list[str] = []
        rt = Runtime(ExpertStore.open(quick_store), resident=0.25, completed=completion)
        async with rt:
            layer = min(rt.store.layers)
            await rt.ensure(layer, [1, 2])
            rt.release_after(failing, [(layer, rt.lease(layer, [1, 2]))])
            with pytest.raises(ComputationError):
                await completion(failing)  # the awaiter hears of the failure
            while rt.ledger(layer).pinned_rows():  # the release task runs once the failure is known
                await anyio.lowlevel.checkpoint()
            done.append("released")
            await rt.prefetch(layer, [5, 6, 7])  # the runtime's tasks still run
            await rt.ensure(layer, [9])
            done.append("served")
        return rt, done

    rt, done = run_guarded(main, loop=loop)
    assert done == ["released", "served"]  # the body ran to its end: nothing cancelled it
    assert audit_problems(rt) == []


@pytest.mark.parametrize("loop", LOOPS)
def test_leases_released_before_their_task_ran_leave_the_task_nothing_to_do(loop: Any,
                                                                            quick_store: pathlib.Path) -> None:
    """``release_computed()`` (a queued step about to be built) releases the leases whose
    computation already finished, before their release task first ran: the task then found its
    entry gone and raised KeyError in the runtime's task group, which failed the runtime's exit
    (seen under load in a cancellation sweep)."""

    async def main() -> Runtime:
        rt = Runtime(ExpertStore.open(quick_store), resident=0.25)
        async with rt:
            layer = min(rt.store.layers)
            await rt.ensure(layer, [1, 2])
            x = mx.array([1.0]) * 2
            rt.release_after(x, [(layer, rt.lease(layer, [1, 2]))])  # its task is spawned, not run yet
            mx.eval(x)
            rt._leases.release_computed()  # released here, before the task's first step
            assert rt.ledger(layer).pinned_rows() == {}
            for _ in range(5):
                await anyio.lowlevel.checkpoint()  # the task runs now
            await rt.ensure(layer, [9])
        return rt

    rt = run_guarded(main, loop=loop)
    assert audit_problems(rt) == []

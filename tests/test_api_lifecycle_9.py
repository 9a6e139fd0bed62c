"""The Python API's lifecycle and misuse, ninth sweep: a Runtime entered twice or again after its
exit, calls made before it is entered or after it closed, cancellation and abandonment of
``sm.generate(..., source=rt)`` under a budget that reads past the page cache with a trace's
predictions, on asyncio, uvloop and trio. Each ends with the runtime closed, its ledgers clean,
no descriptor or thread left behind, and the next run's tokens equal to an uninterrupted run's;
what is refused says what and why, to the awaiter.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import pytest
from _fault_helpers import LOOPS, run_guarded

from asyncside import ExpertStore, Runtime
from asyncside.audit import audit_problems
from asyncside.errors import AsyncsideError
from asyncside.runtime import _plan as plan_mod

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def sm(quick_store: pathlib.Path) -> Any:
    """The quick model, replaying a trace that carries predictions (``predictor="trace"``)."""
    from asyncside.models import load_streaming_model
    from asyncside.routing import synthetic

    model = load_streaming_model(quick_store)
    trace = synthetic(tokens=64, n_layers=len(model.moe_layers), n_experts=32, top_k=4, skew=0.8, overlap=0.3,
                      layer_corr=0.1, seed=1, prediction_precision=0.8)
    model.set_routing(trace)
    return model


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> str:
    """A budget whose page cache cannot hold the store's records outside the pools: O_DIRECT reads
    (the plan made as if the process held nothing, whatever the test process holds)."""
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    return "257M"


def _runtime(sm: Any, memory: str) -> Runtime:
    return Runtime(ExpertStore.open(sm.store.path), resident=0.25, memory=memory)


def _prompt(sm: Any) -> list[int]:
    return list(sm.tokenizer.encode("Mixture of experts stream"))


async def _generate(sm: Any, rt: Runtime, n: int = MAX_TOKENS) -> list[int]:
    return [t async for t in sm.generate(_prompt(sm), max_tokens=n, source=rt, predictor="trace")]


@pytest.fixture(scope="module")
def reference(sm: Any, quick_store: pathlib.Path) -> list[int]:
    """An uninterrupted run's tokens, under the same budget."""
    saved = plan_mod._resident_now
    plan_mod._resident_now = lambda: 0
    try:
        async def main() -> tuple[list[int], bool]:
            async with _runtime(sm, "257M") as rt:
                assert rt.plan is not None and rt.plan.direct, rt.plan and rt.plan.describe()
                return await _generate(sm, rt), rt.plan.direct
        tokens, _ = anyio.run(main)
    finally:
        plan_mod._resident_now = saved
    assert len(tokens) == MAX_TOKENS
    return tokens


def _clean(rt: Runtime) -> None:
    problems = audit_problems(rt)
    assert problems == [], problems


# ---- a Runtime is entered once -------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_a_runtime_entered_again_is_refused_and_the_running_one_goes_on(loop: Any, sm: Any, budget: str,
                                                                        reference: list[int]) -> None:
    """``async with rt`` inside ``async with rt`` failed with "a Scheduler can be entered once" from
    the scheduler, after the second entry had replaced the running runtime's change event and
    marked it closed: the outer block, catching the error, found a runtime that refused every call.
    Entering again after the exit failed alike, naming the scheduler. Both are refused up front,
    naming the Runtime and the way out; the running one goes on and gives the reference tokens."""
    async def main() -> None:
        rt = _runtime(sm, budget)
        async with rt:
            with pytest.raises(AsyncsideError, match=r"this Runtime is running: a Runtime is entered once.*"
                                                     r"make a new Runtime\(store, \.\.\.\) to run again"):
                async with rt:
                    pass
            assert await _generate(sm, rt) == reference
        _clean(rt)
        with pytest.raises(AsyncsideError, match=r"this Runtime was entered before and is closed: a Runtime is "
                                                 r"entered once"):
            async with rt:
                pass
        _clean(rt)
        async with _runtime(sm, budget) as fresh:
            assert await _generate(sm, fresh) == reference

    run_guarded(main, loop=loop)


def test_calls_before_entering_say_the_runtime_is_not_running(sm: Any, budget: str) -> None:
    """``await rt.ensure(0, ...)`` and ``rt.prefetch(0, ...)`` on a Runtime not yet entered said
    "layer 0 is not streamed by this runtime (layers: [])", sending the caller after a wrong layer."""
    async def main() -> None:
        rt = _runtime(sm, budget)
        with pytest.raises(AsyncsideError, match=r"the runtime is not running \(use `async with Runtime"):
            await rt.ensure(0, [1, 2])
        with pytest.raises(AsyncsideError, match=r"the runtime is not running \(use `async with Runtime"):
            rt.prefetch(0, [1, 2])

    anyio.run(main)

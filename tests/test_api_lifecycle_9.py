"""The Python API's lifecycle and misuse, ninth sweep: a Runtime entered twice or again after its
exit, calls made before it is entered or after it closed, cancellation and abandonment of
``sm.generate(..., source=rt)`` under a budget that reads past the page cache with a trace's
predictions, on asyncio, uvloop and trio. Each ends with the runtime closed, its ledgers clean,
no descriptor or thread left behind, and the next run's tokens equal to an uninterrupted run's;
what is refused says what and why, to the awaiter.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import anyio
import pytest
from _fault_helpers import LOOPS, direct_budget, run_guarded

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
def budget(monkeypatch: pytest.MonkeyPatch, quick_store: pathlib.Path) -> str:
    """A budget whose page cache cannot hold the store's records outside the pools: O_DIRECT reads
    (the plan made as if the process held nothing, whatever the test process holds): the pools,
    the plan's headroom and 1 MiB."""
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    return _direct_budget(quick_store)


def _direct_budget(path: pathlib.Path) -> str:
    return str(direct_budget(ExpertStore.open(path)))


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
            async with _runtime(sm, _direct_budget(quick_store)) as rt:
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


# ---- generate's arguments --------------------------------------------------------------------------


def _refusal(sm: Any, rt: Runtime, **kwargs: Any) -> BaseException:
    args: dict[str, Any] = {"prompt_ids": _prompt(sm), "max_tokens": 2, "source": rt, **kwargs}

    async def first() -> None:
        async for _ in sm.generate(**args):
            pass

    async def main() -> BaseException:
        with pytest.raises((TypeError, ValueError)) as info:
            await first()
        return info.value

    return anyio.run(main)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"max_tokens": "3"}, r"max_tokens: expected a number of tokens >= 0 \(an int\), got '3'"),
    ({"max_tokens": 2.5}, r"max_tokens: expected a number of tokens >= 0 \(an int\), got 2\.5"),
    ({"max_tokens": True}, r"max_tokens: expected a number of tokens >= 0 \(an int\), got True"),
    ({"max_tokens": None}, r"max_tokens: expected a number of tokens >= 0 \(an int\), got None"),
    ({"max_tokens": -1}, r"max_tokens: expected a number of tokens >= 0 \(an int\), got -1"),
    ({"prompt_ids": "Mixture"}, r"prompt_ids: expected token ids \(ints\), got str; encode text first"),
    ({"prompt_ids": [1.5, 2.7]}, r"prompt_ids: expected a flat sequence of token ids \(ints\), got list of float64"),
    ({"prompt_ids": [[1, 2]]}, r"prompt_ids: expected a flat sequence of token ids \(ints\), got list 2-d"),
    ({"prompt_ids": None}, r"prompt_ids: expected a flat sequence of token ids \(ints\), got NoneType 0-d"),
    ({"source": None}, r"source: expected an expert source \(a running asyncside.Runtime.*got NoneType"),
    ({"source": "STORE_DIR"}, r"source: expected an expert source \(a running asyncside.Runtime.*got str"),
    ({"options": 3}, r"options: expected an asyncside.ForwardOptions or None, got int"),
    ({"trace": 3}, r"trace: expected a RoutingTrace recorder .* got int; replay a routing trace with sm.set_routing"),
])
def test_generate_refuses_a_bad_argument_naming_it(kwargs: dict[str, Any], said: str, sm: Any, budget: str) -> None:
    """A str or None for max_tokens failed on a comparison, 2.5 in range() and True ran one token;
    text for prompt_ids ended in int()'s "invalid literal", float ids were truncated to other tokens
    without a word, a nested list failed in int(); source=None or a path, and options or trace of
    another type, raised an AttributeError from inside the first step. Each is refused at the
    first ``__anext__``, naming the argument and what is expected."""
    rt = _runtime(sm, budget)  # never entered: the refusal comes before any step
    exc = _refusal(sm, rt, **kwargs)
    assert re.search(said, str(exc)), str(exc)


def test_generate_takes_token_ids_of_any_integer_kind(sm: Any, budget: str, reference: list[int]) -> None:
    """numpy and MLX integer arrays and numpy ints are token ids and counts as lists and ints are."""
    import mlx.core as mx
    import numpy as np

    prompt = _prompt(sm)

    async def main() -> list[list[int]]:
        async with _runtime(sm, budget) as rt:
            out = []
            for ids in (np.array(prompt, dtype=np.int64), mx.array(prompt, dtype=mx.uint32), tuple(prompt)):
                out.append([t async for t in sm.generate(ids, max_tokens=np.int64(MAX_TOKENS), source=rt,
                                                         predictor="trace")])
            _clean(rt)
            return out

    assert anyio.run(main) == [reference] * 3


# ---- one event loop ----------------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_a_runtime_used_from_another_threads_loop_is_refused(loop: Any, sm: Any, budget: str,
                                                             reference: list[int]) -> None:
    """A Runtime entered on one thread's loop and generated from on another's hung on asyncio (an
    await of the owner loop's event) and failed on trio with anyio's "no running event loop",
    leaving a lease open in the ledger. It is refused at once, naming the way out; the owner goes
    on and closes clean."""
    import threading

    rt = _runtime(sm, budget)
    entered, leave = threading.Event(), threading.Event()

    async def owner() -> list[int]:
        async with rt:
            entered.set()
            await anyio.to_thread.run_sync(leave.wait)
            return await _generate(sm, rt)

    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(tokens=anyio.run(owner)), daemon=True)
    thread.start()
    try:
        assert entered.wait(600)

        async def other() -> None:
            with pytest.raises(AsyncsideError, match=r"the runtime is used from thread .*, but it runs on the event "
                                                     r"loop that entered it"):
                await _generate(sm, rt)
            with pytest.raises(AsyncsideError, match=r"runs on the event loop that entered it"):
                await rt.ensure(0, [1])
            with pytest.raises(AsyncsideError, match=r"runs on the event loop that entered it"):
                rt.lease(0, [1])

        run_guarded(other, loop=loop)
    finally:
        leave.set()
        thread.join(float(os.environ.get("ASYNCSIDE_HANG_LIMIT_S", "600")))  # a hang guard, as run_guarded's
    assert not thread.is_alive(), "the runtime's own loop hung after another loop used it"
    assert out["tokens"] == reference
    _clean(rt)


# ---- Runtime arguments and a lease after exit (the round's leftovers) ---------------------------

@pytest.mark.parametrize(("kwargs", "said"), [
    ({"direct": "yes"}, "direct: expected None (the plan chooses), True or False, got 'yes'"),
    ({"verify": "no"}, "verify: expected True or False, got 'no'"),
    ({"completed": 3}, "completed: expected None or an async function of an array, got 3"),
    ({"layers": 3}, "layers: expected the indices of the layers to stream (or None: every one), got 3"),
    ({"layers": "01"}, "layers: expected the indices of the layers to stream (or None: every one), got '01'"),
])
def test_runtime_arguments_of_the_wrong_kind_are_named(quick_store: pathlib.Path, kwargs: dict[str, Any],
                                                       said: str) -> None:
    """direct="yes", verify="no" and completed=3 were taken without a word; layers=3 failed with
    "'int' object is not iterable"."""
    with pytest.raises(TypeError) as caught:
        Runtime(ExpertStore.open(quick_store), **kwargs)
    assert str(caught.value) == said


def test_a_path_for_the_store_says_how_to_open_one(quick_store: pathlib.Path) -> None:
    """``Runtime("dir")`` was "AttributeError: 'str' object has no attribute 'layers'"."""
    with pytest.raises(TypeError, match=r"store: expected an ExpertStore \(ExpertStore.open\(path\)\), got str"):
        Runtime(str(quick_store))  # type: ignore[arg-type]


@pytest.mark.parametrize(("memory", "said"), [
    (1.5, "memory 1.5 is 1 byte; expected at least 4K"), ("16", "memory '16' is 16 bytes; expected at least 4K")])
def test_a_runtime_refuses_a_budget_of_bytes_as_load_does(quick_store: pathlib.Path, memory: Any, said: str) -> None:
    """``Runtime(memory=1.5)`` was a budget of one byte, refused when entered as "the memory budget
    is 0.0 MiB"; ``load`` and ``--memory`` refuse such a figure as it is given."""
    with pytest.raises(ValueError) as caught:
        Runtime(ExpertStore.open(quick_store), memory=memory)
    assert str(caught.value).startswith(said), caught.value


def test_a_lease_after_exit_is_refused(quick_store: pathlib.Path) -> None:
    """``rt.lease()`` after the runtime closed pinned a row, which the audit then reported as a
    lease never released."""
    async def main() -> Runtime:
        async with Runtime(ExpertStore.open(quick_store), resident=0.25) as rt:
            pass
        with pytest.raises(AsyncsideError, match="the runtime is closed: no more prefetch/ensure/lease"):
            rt.lease(0, [0])
        return rt

    rt = anyio.run(main)
    assert audit_problems(rt) == []

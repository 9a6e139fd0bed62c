"""Interrupted steps leave nothing behind: a generation over a Runtime cancelled at any await of
its steps, or whose model code raises a BaseException (an interrupt, a MemoryError) anywhere in a
step, in each step mode: queued, per-layer, whole, and queued under a budget that reads past the
page cache (streamed switches prefetching a trace's predictions). Afterwards ``rt.quiesce()``
returns, no row is left pinned by a lease, no build is left begun, the audit is clean, the
runtime's next generation gives the uninterrupted tokens, and after the exit the audit is still
clean (no lease open).
"""

from __future__ import annotations

import pathlib
import types
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import anyio
import pytest
from _fault_helpers import direct_budget, run_guarded

from asyncside import ExpertStore, Runtime
from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.models import ForwardOptions
from asyncside.models import per_layer as per_layer_mod
from asyncside.models import queued as queued_mod
from asyncside.models import walk as walk_mod
from asyncside.runtime import _plan as plan_mod
from asyncside.runtime import _queued as queued_side_mod

MAX_TOKENS = 3
#: the step modes, and the queued one under a budget that reads past the page cache (prefill chunks
#: per layer, decode steps queued) with streamed switches prefetching a trace's predictions
MODES = ["queued", "per-layer", "whole", "queued-streamed"]
#: asyncio and trio: the two backends' cancellations are delivered differently
BACKENDS = [pytest.param(("asyncio", {}), id="asyncio"), pytest.param(("trio", {}), id="trio")]


class Interrupt(BaseException):
    """What a KeyboardInterrupt or a MemoryError raised inside a step's model code stands for: no
    ``except Exception`` catches it."""


@pytest.fixture(scope="module")
def models(quick_store: pathlib.Path) -> dict[str, Any]:
    """The quick model as it is, and one replaying a trace that carries predictions."""
    from asyncside.models import load_streaming_model
    from asyncside.routing import synthetic

    traced = load_streaming_model(quick_store)
    traced.set_routing(synthetic(tokens=64, n_layers=len(traced.moe_layers), n_experts=32, top_k=4, skew=0.8,
                                 overlap=0.3, layer_corr=0.1, seed=1, prediction_precision=0.8))
    return {"plain": load_streaming_model(quick_store), "traced": traced}


class _Run:
    """One mode's generation: its model, runtime and options."""

    def __init__(self, models: dict[str, Any], mode: str) -> None:
        self.streamed = mode == "queued-streamed"
        self.sm = models["traced" if self.streamed else "plain"]
        self.options = (ForwardOptions(mode="queued", streamed_switch=True) if self.streamed
                        else ForwardOptions(mode=mode))

    def runtime(self) -> Runtime:
        store = ExpertStore.open(self.sm.store.path)
        # Streamed: the pools, the plan's headroom and 1 MiB of page cache, which cannot hold the
        # store's records outside the pools (reads past the page cache).
        budget = direct_budget(store) if self.streamed else None
        return Runtime(store, resident=0.25, memory=budget)

    async def generate(self, rt: Runtime) -> list[int]:
        prompt = list(self.sm.tokenizer.encode("Mixture of experts stream"))
        return [t async for t in self.sm.generate(prompt, max_tokens=MAX_TOKENS, source=rt, options=self.options,
                                                  predictor="trace" if self.streamed else "lookahead")]


@pytest.fixture
def run(models: dict[str, Any], mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[_Run, list[int]]:
    """The mode's generation and its uninterrupted tokens."""
    if mode == "queued-streamed":
        # The plan made as if the process held nothing: the budget's page cache cannot hold the
        # store's records outside the pools, so the plan reads past it (tests/test_api_lifecycle_9.py).
        monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    r = _Run(models, mode)

    async def main() -> list[int]:
        async with r.runtime() as rt:
            assert rt.plan is not None and rt.plan.direct == r.streamed
            return await r.generate(rt)

    tokens = anyio.run(main)
    assert len(tokens) == MAX_TOKENS
    return r, tokens


async def _left_clean(r: _Run, rt: Runtime, reference: list[int], what: str) -> None:
    """After an interrupted generation: nothing begun, lent or leased is left, and the runtime serves."""
    await rt.quiesce()  # a step left begun would make this wait forever (run_guarded says so)
    assert not rt.queued_active, what
    # Leases whose release waits for a computation still in flight are not left behind: wait for
    # those computations (private on purpose: the runtime releases them by itself, but later).
    for x, _held in list(rt._leases._pending.values()):
        await completed(x)
    rt.release_computed()
    pinned = {layer: rt.ledger(layer).pinned_rows() for layer in rt.store.layers}
    assert not any(pinned.values()), (what, f"rows still leased: {pinned}")
    assert audit_problems(rt) == [], what
    assert await r.generate(rt) == reference, what


@types.coroutine
def _cancel_at(coro: Coroutine[Any, Any, Any], k: int, scope: anyio.CancelScope,
               seen: list[int]) -> Generator[Any, Any, Any]:
    """Run ``coro`` in the calling task, cancelling ``scope`` as it suspends for the ``k``-th time
    (whatever it awaits there: the loop gets what it yields, unchanged), so the cancellation lands
    in that await whatever the event loop. ``seen[0]`` counts its suspensions."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            yielded = coro.throw(error) if error is not None else coro.send(value)
        except StopIteration as stop:
            return stop.value
        seen[0] += 1
        if seen[0] == k:
            scope.cancel()
        try:
            value, error = (yield yielded), None
        except BaseException as exc:  # delivered to the coroutine at its await, as the task would
            value, error = None, exc


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", BACKENDS)
def test_a_generation_cancelled_at_any_await_leaves_nothing_behind(loop: Any, mode: str,
                                                                   run: tuple[_Run, list[int]]) -> None:
    """Cancel the generation at its 1st, 2nd, ... await until one runs to its end: every
    cancellation lands inside a step (a build's checkpoint, a schedule's wait, a token's await, an
    ensure, a completion), and each leaves the runtime as clean and usable as an uninterrupted one."""
    r, reference = run

    async def sweep() -> int:
        k = 0
        while True:
            k += 1
            seen = [0]
            async with r.runtime() as rt:
                got = None
                with anyio.CancelScope() as scope:
                    got = await _cancel_at(r.generate(rt), k, scope, seen)
                if got is not None:
                    assert got == reference
                    return k - 1
                assert scope.cancelled_caught, k
                await _left_clean(r, rt, reference, f"cancelled at await {k}")
            assert audit_problems(rt) == [], k

    cancelled = run_guarded(sweep, loop=loop)
    # The sweep went through the steps' awaits, not just the first (on the CPU each layer is an
    # await too; on a GPU a queued step is one)
    assert cancelled > MAX_TOKENS


def _raise_at(k: int, real: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    def boom(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            raise Interrupt(f"call {k}")
        return real(*args, **kwargs)
    return boom


#: the model's own code a step calls: its attention and MLP layers, the expert gathers over the pools,
#: and the final norm and head (each strategy module imports the gather under its own name)
MODEL_CODE = [(walk_mod.DecoderWalk, "attend"), (walk_mod.DecoderWalk, "logits"),
              (per_layer_mod, "pooled_switch_apply"), (queued_mod, "pooled_switch_apply")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", BACKENDS)
def test_model_code_that_raises_in_a_step_leaves_nothing_behind(loop: Any, mode: str, run: tuple[_Run, list[int]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of the model's own code in a generation raises in turn: the step is abandoned and
    the error reaches the caller, with nothing left begun or leased. A per-layer step whose final
    head raised kept every lease it took (the head was built outside the step's release on error):
    the next generation's ensure then waited forever for rows nobody would unpin, and the audit
    reported the leases after the exit."""
    r, reference = run

    async def sweep() -> int:
        raised = 0
        for owner, name in MODEL_CODE:
            real = getattr(owner, name)
            k = 0
            while True:
                k += 1
                calls = [0]
                async with r.runtime() as rt:
                    monkeypatch.setattr(owner, name, _raise_at(k, real, calls))
                    try:
                        got = await r.generate(rt)
                    except Interrupt:
                        got = None
                    finally:
                        monkeypatch.setattr(owner, name, real)
                    if got is not None:  # fewer calls than k: every one of them raised in turn
                        assert got == reference
                        break
                    raised += 1
                    await _left_clean(r, rt, reference, f"{name} raised at call {k}")
                assert audit_problems(rt) == [], (name, k)
        return raised

    assert run_guarded(sweep, loop=loop) > 0


@pytest.mark.parametrize("mode", ["queued"])
@pytest.mark.parametrize("loop", BACKENDS)
def test_a_step_whose_end_raises_is_not_left_begun(loop: Any, mode: str, run: tuple[_Run, list[int]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``end_step`` raising inside its own bookkeeping (a MemoryError there, an interrupt) left the
    step counted as being built: every quiesce, the runtime's shielded exit too, then waited for it
    for ever. The build ends there whatever happens."""
    r, reference = run

    def failing_deque(*args: Any) -> Any:
        raise Interrupt("the step's bookkeeping")

    async def main() -> None:
        async with r.runtime() as rt:
            monkeypatch.setattr(queued_side_mod, "deque", failing_deque)
            try:
                with pytest.raises(Interrupt):
                    await r.generate(rt)
            finally:
                monkeypatch.setattr(queued_side_mod, "deque", deque)
            left = rt.queued._building  # private on purpose: a build left begun is the point
            while rt.queued._building:  # so that the exit returns even when the assertion fails
                rt.queued.abandon()
            assert left == 0, "the step whose end raised is still counted as being built"
            await _left_clean(r, rt, reference, "end_step raised")

    run_guarded(main, loop=loop)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "queued"])  # queued steps lend rows, lease none
@pytest.mark.parametrize("loop", BACKENDS[:1])
def test_a_release_after_that_raises_once_it_took_the_leases_releases_them_once(
        loop: Any, mode: str, run: tuple[_Run, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``release_after`` of a generation in turn takes its leases and then raises (an interrupt
    arriving just after the call did its work). A whole-model step handed its leases to
    ``release_after`` inside the block whose handler releases them on error, so they were released
    twice: at once by the handler, and again by the release task the first call had started, whose
    KeyError then failed the runtime's exit."""
    r, reference = run
    real = Runtime.release_after

    async def sweep() -> int:
        raised = 0
        k = 0
        while True:
            k += 1
            calls = [0]

            def took_then_raised(self: Runtime, x: Any, leases: Any, k: int = k, calls: list[int] = calls) -> None:
                held = list(leases)
                real(self, x, held)
                if held:
                    calls[0] += 1
                    if calls[0] == k:
                        raise Interrupt(f"after release_after call {k}")

            async with r.runtime() as rt:
                monkeypatch.setattr(Runtime, "release_after", took_then_raised)
                try:
                    got = await r.generate(rt)
                except Interrupt:
                    got = None
                finally:
                    monkeypatch.setattr(Runtime, "release_after", real)
                if got is not None:  # fewer calls with leases than k: each has raised in turn
                    assert got == reference
                    return raised
                raised += 1
                await _left_clean(r, rt, reference, f"release_after raised after call {k}")
            assert audit_problems(rt) == [], k

    assert run_guarded(sweep, loop=loop) > 0

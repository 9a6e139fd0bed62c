"""The Python API inside someone else's program, round 14: a user's own async program, notebook
and test suite around ``load()`` and the Runtime. An interruption or misuse ends in a clear error
and leaves no runtime open behind it: no pools, reads or descriptors held with nothing left to
close them.
"""

from __future__ import annotations

import pathlib
import re
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
    # Ctrl-C as a notebook's kernel takes it, whatever the test runner inherited (one started in
    # the background has SIGINT ignored, and the signal would be lost).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            facade.load(quick_store, progress=False)
    finally:
        signal.signal(signal.SIGINT, before)
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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_runtime_entered_by_one_task_and_exited_by_another_closes(make_expert_store: Any, loop: str) -> None:
    """As pytest-asyncio runs an async fixture (its set-up in one task, its teardown in another):
    the exit failed with anyio's "Attempted to exit cancel scope in a different task than it was
    entered in". It now closes: every read settled, the ledgers audit clean, later calls refused.
    (On device pools, MLX CUDA, a read that lands as the runtime closes is not uploaded: its
    prefetch fails saying so.)"""
    import asyncio

    import uvloop

    from asyncside import Runtime
    from asyncside.audit import audit_problems
    from asyncside.errors import AsyncsideError
    from asyncside.pools import device_pools_default

    rt = Runtime(make_expert_store(n_experts=64), resident=0.1)

    async def main() -> None:
        await asyncio.create_task(rt.__aenter__())
        await rt.ensure(0, [40, 41, 42])
        prefetch = rt.prefetch(1, [50, 51])
        await asyncio.create_task(rt.__aexit__(None, None, None))
        try:
            await prefetch
        except ExceptionGroup as group:
            assert device_pools_default(), group
            assert all("the runtime closed before the upload" in str(e) for e in group.exceptions), group
        assert rt._s.exited and audit_problems(rt) == []
        with pytest.raises(AsyncsideError, match="the runtime is closed"):
            await rt.ensure(0, [1])

    if loop == "uvloop":
        uvloop.run(asyncio.wait_for(main(), 600))  # a hang guard, never a timing assertion
    else:
        asyncio.run(asyncio.wait_for(main(), 600))


FIXTURE_PROJECT = '''
import pytest
import pytest_asyncio

from asyncside import Runtime
from asyncside.audit import audit_problems

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared_runtime(tmp_path_factory):
    from asyncside.store import ExpertStore
    from asyncside.testing import random_layers

    store = ExpertStore.create(tmp_path_factory.mktemp("s") / "store", random_layers(2, 64))
    async with Runtime(store, resident=0.1) as rt:
        yield rt
    assert rt._s.exited and audit_problems(rt) == []


@pytest_asyncio.fixture
async def own_runtime(tmp_path):
    from asyncside.store import ExpertStore
    from asyncside.testing import random_layers

    store = ExpertStore.create(tmp_path / "store", random_layers(2, 64))
    async with Runtime(store, resident=0.1) as rt:
        yield rt
    assert rt._s.exited and audit_problems(rt) == []


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("experts", [[1, 2, 3], [40, 41], [60]])
async def test_shared(shared_runtime, experts):
    await shared_runtime.ensure(0, experts)


@pytest.mark.asyncio
async def test_own(own_runtime):
    await own_runtime.ensure(1, [10, 20, 30])


def test_after_the_module():
    pass
'''


def test_a_pytest_asyncio_fixture_that_opens_a_runtime_closes_it(tmp_path: pathlib.Path) -> None:
    """docs/testing.md's async fixture, ``async with Runtime(store) as rt: yield rt``: pytest-asyncio
    runs a fixture's set-up and its teardown in two tasks, and the runtime's exit in the second
    failed with anyio's "Attempted to exit cancel scope in a different task than it was entered
    in": an error in the teardown of every test that used it. It now closes clean from any task
    of its loop, in a function-scoped fixture and in a module-scoped one."""
    import subprocess
    import sys

    (tmp_path / "test_fixture.py").write_text(FIXTURE_PROJECT)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\n"
                                         "asyncio_default_fixture_loop_scope = function\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and re.search(r"\b5 passed\b", r.stdout) and " error" not in r.stdout, (
        r.stdout + r.stderr)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_one_model_generating_on_two_threads_loops_under_budgets_wakes_the_waiter(quick_store: pathlib.Path,
                                                                                   backend: str) -> None:
    """One loaded StreamingModel shared by two threads, each with its event loop and a Runtime
    under a memory budget, whose KV allowance holds one generation at a time: the second waited
    for the first to end, but the first's end set the waiter's event from its own thread. asyncio
    never woke the waiter (the loop slept on: a hang), trio failed an assertion in the first. The
    second now runs once the first has ended; both give the tokens of a run alone."""
    import dataclasses

    import anyio

    from asyncside import ExpertStore, Runtime
    from asyncside.memory import proc_self_bytes
    from asyncside.models import load_streaming_model

    sm = load_streaming_model(quick_store)
    prompt = list(sm.tokenizer.encode("Mixture of experts stream"))
    first_token, out = threading.Event(), {}

    async def generate(name: str) -> list[int]:
        budget = proc_self_bytes("status", "VmRSS") + (1 << 30)  # a budget counts the process's own memory
        async with Runtime(ExpertStore.open(quick_store), resident=0.25, memory=budget) as rt:
            assert rt.plan is not None
            need = sm.kv_need(rt.plan, len(prompt), 8)
            assert need is not None
            rt._plan = dataclasses.replace(rt.plan, kv_allowance_bytes=need[0] * 3 // 2)  # room for one
            tokens = []
            async for t in sm.generate(prompt, max_tokens=8, source=rt, stop_at_eos=False):
                tokens.append(t)
                if name == "first" and len(tokens) == 1:
                    first_token.set()
                    await anyio.sleep(0.5)  # still generating while the second one starts
            return tokens

    def thread(name: str) -> None:
        if name == "second":
            first_token.wait(600)
        try:
            out[name] = anyio.run(generate, name, backend=backend)
        except BaseException as exc:  # re-raised below, on the test's thread
            out[name] = exc

    reference = anyio.run(generate, "alone")
    threads = [threading.Thread(target=thread, args=(name,), daemon=True) for name in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)  # a hang guard, never a timing assertion
    assert not any(t.is_alive() for t in threads), "a generation waiting for the allowance was never woken"
    assert out == {"first": reference, "second": reference}
    assert sm._kv.held == 0

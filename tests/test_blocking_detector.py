"""The blocking-call detector and its ``no_blocking`` fixture catch a blocked event loop.

Each check blocks the loop on purpose (``time.sleep``, ``mx.eval`` of work a native gate holds
back, a large matrix product) and asserts the detector reports it, with the loop thread's stack;
a responsive loop must report nothing. The fixture itself is exercised end to end in a child
pytest run (pytest-asyncio and anyio tests alike), since a failing test is what it produces.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import anyio
import anyio.lowlevel
import mlx.core as mx
import numpy as np
import pytest

import asyncside._native.testing as native_testing
from asyncside.bridge import completed
from asyncside.testing_blocking import BlockingCallError, BlockingDetector, LoopBlockedError

pytestmark = pytest.mark.anyio


async def test_catches_time_sleep_on_the_loop(anyio_backend: object) -> None:
    async with BlockingDetector(threshold=0.05, raise_on_exit=False) as det:
        time.sleep(0.2)  # the deliberate blocking call
    sampled = [inc for inc in det.incidents if "time.sleep(0.2)" in inc.stack]
    assert sampled, det.incidents
    assert sampled[0].blocked_s > det.threshold
    with pytest.raises(LoopBlockedError, match="blocked for"):
        det.check()


async def test_a_garbage_collector_pause_is_a_warning_not_a_block(anyio_backend: object) -> None:
    """A full collection of a large heap on the loop thread stalls it (a whole test session's
    heap does, at random points): reported as a gc pause, not as a blocking call; a real block
    in the same detector still fails."""
    import gc

    heap = [[i] for i in range(1_500_000)]  # tracked objects: a slow full collection
    async with BlockingDetector(threshold=0.01, raise_on_exit=False) as det:
        await anyio.lowlevel.checkpoint()
        gc.collect()
        await anyio.lowlevel.checkpoint()
    del heap
    assert det.gc_pauses, det.incidents
    assert all(inc.gc_s > 0 for inc in det.gc_pauses)
    assert "garbage collector" in det.gc_pauses[0].describe()
    det.check()  # does not raise
    async with BlockingDetector(threshold=0.05, raise_on_exit=False) as det:
        time.sleep(0.2)
    with pytest.raises(LoopBlockedError, match="blocked for"):
        det.check()


async def test_catches_mx_eval_of_unfinished_work(anyio_backend: object) -> None:
    gate = native_testing.StreamGate()
    x = gate.hold(mx.array(np.ones((64, 64), np.float32))) @ mx.array(np.ones((64, 64), np.float32))
    opener = threading.Timer(0.2, gate.open)  # the stream cannot finish x before this fires
    opener.start()
    try:
        async with BlockingDetector(threshold=0.05, raise_on_exit=False) as det:
            mx.eval(x)  # waits on the loop thread for the gated stream
    finally:
        opener.join()
    assert any("mx.eval(x)" in inc.stack for inc in det.incidents), det.incidents
    with pytest.raises(LoopBlockedError):
        det.check()


async def test_catches_mx_synchronize_on_a_stuck_stream(anyio_backend: object) -> None:
    # The gate times out by itself after 0.2 s, failing the stream; synchronize then raises.
    gate = native_testing.StreamGate(timeout_s=0.2)
    # On the gate's CPU stream whatever the default device (on MLX CUDA, scheduling GPU work behind
    # the held CPU stream waited for the gate itself, before synchronize).
    with mx.stream(mx.cpu):
        x = gate.hold(mx.array(np.ones(4, np.float32))) + 1.0
    mx.async_eval(x)
    async with BlockingDetector(threshold=0.05, raise_on_exit=False) as det:
        # The CPU stream's synchronize: with no stream named it waits for the default device's,
        # which on MLX CUDA is the GPU's, and the gate timed out later in another test's eval.
        with pytest.raises(RuntimeError, match="never opened"), mx.stream(mx.cpu):
            mx.synchronize()
    assert any("mx.synchronize()" in inc.stack for inc in det.incidents), det.incidents


async def test_reports_a_block_the_watchdog_could_not_watch(anyio_backend: object) -> None:
    # The loop thread keeps the GIL for the whole block (a long switch interval and pure Python
    # work), so the watchdog cannot run, let alone sample, until it ends: still reported.
    previous = sys.getswitchinterval()
    async with BlockingDetector(threshold=0.05, raise_on_exit=False) as det:
        await anyio.sleep(0.02)  # the watchdog has a ping in flight
        sys.setswitchinterval(5.0)
        try:
            start = time.thread_time()  # 0.2 s of this thread's CPU, however loaded the machine
            while time.thread_time() - start < 0.2:
                pass
        finally:
            sys.setswitchinterval(previous)
        await anyio.sleep(0.05)  # let the loop answer and the watchdog look again
    assert det.incidents, "a 200 ms block went unreported"
    inc = det.incidents[0]
    assert inc.blocked_s > det.threshold
    # Any stack is sampled late (the watchdog could not run): the report says why.
    assert inc.watchdog_lag_s > det.threshold
    assert "woke" in inc.describe() and "late" in inc.describe()


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_catches_mx_eval_of_a_big_computation(anyio_backend: object) -> None:
    rng = np.random.default_rng(0)
    with mx.stream(mx.cpu):  # a GPU computes this in well under the threshold
        a = mx.array((rng.standard_normal((512, 512)) / 23).astype(np.float32))
        x = a
        for _ in range(3):  # ~0.8 GFLOP: far beyond 2 ms for MLX on a CPU (hundreds of ms here)
            x = x @ a
    async with BlockingDetector(threshold=0.002, raise_on_exit=False) as det:
        mx.eval(x)
    assert det.incidents
    assert any("mx.eval(x)" in inc.stack for inc in det.incidents), det.incidents


async def test_quiet_on_a_responsive_loop(anyio_backend: object) -> None:
    # Generous threshold: this checks the watchdog fires on blocking, not on a busy CI machine.
    a = mx.array(np.ones((128, 128), np.float32))
    async with BlockingDetector(threshold=0.5) as det:
        for i in range(20):
            await anyio.sleep(0.01)
            await completed(a * float(i))
    assert det.incidents == []
    assert det.pings_answered > 0  # the watchdog was really watching


async def test_strict_mode_refuses_known_blocking_calls(anyio_backend: object) -> None:
    plain_eval = mx.eval
    unscheduled = mx.array(np.ones(4, np.float32)) * 2.0
    async with BlockingDetector(threshold=1.0, strict=True, raise_on_exit=False) as det:
        with pytest.raises(BlockingCallError, match="mx.eval"):
            mx.eval(unscheduled)
        mx.eval(mx.array([1.0, 2.0]))  # already available: returns at once, allowed
        with pytest.raises(BlockingCallError, match=r"time\.sleep"):
            time.sleep(0.001)
        with pytest.raises(BlockingCallError, match="synchronize"):
            mx.synchronize()
        await anyio.to_thread.run_sync(time.sleep, 0.001)  # off the loop thread: allowed
        await completed(unscheduled)  # the non-blocking way is untouched by strict mode
    assert mx.eval is plain_eval  # patches undone
    assert [inc.call for inc in det.incidents if inc.call] == [
        "mx.eval() of arrays that are not yet available",
        "time.sleep(0.001)",
        "mx.synchronize()",
    ]
    with pytest.raises(LoopBlockedError, match="strict mode refused"):
        det.check()


async def test_tells_a_parked_loop_from_a_blocked_one(anyio_backend: object) -> None:
    """Starvation (a ready loop parked in its selector) is told apart from a blocking call."""
    from asyncside.testing_blocking import _current_loop_handle, _parked

    handle = _current_loop_handle()

    def sample_later() -> bool | None:
        time.sleep(0.05)
        return _parked(handle)

    # The loop waits for this worker: it is parked in its selector (or uvloop's C loop).
    assert await anyio.to_thread.run_sync(sample_later) is True
    # The loop thread blocks in a call while the worker samples it.
    box: list[bool | None] = []
    worker = threading.Thread(target=lambda: box.append(sample_later()))
    worker.start()
    time.sleep(0.2)  # the deliberate blocking call
    worker.join()
    assert box == [False]


def test_detector_needs_a_running_loop() -> None:
    with pytest.raises(RuntimeError, match="inside an asyncio or trio event loop"):
        BlockingDetector().start()
    with pytest.raises(ValueError, match="threshold must be > 0"):
        BlockingDetector(threshold=0)


# -- the fixture, end to end in a child pytest run ----------------------------------------------

_CHILD_CONFTEST = """
import pytest
from asyncside.testing_blocking import no_blocking  # noqa: F401

@pytest.fixture(params=[("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
                ids=["asyncio", "uvloop", "trio"])
def anyio_backend(request):
    return request.param
"""

_CHILD_TESTS = """
import time
import anyio
import pytest
import mlx.core as mx
from asyncside.testing_blocking import BlockingCallError

@pytest.mark.asyncio
async def test_asyncio_sleep_fails(no_blocking):
    time.sleep(0.2)

@pytest.mark.anyio
async def test_anyio_sleep_fails(anyio_backend, no_blocking):
    time.sleep(0.2)

@pytest.mark.anyio
async def test_clean_passes(anyio_backend, no_blocking):
    for _ in range(5):
        await anyio.sleep(0.01)

@pytest.mark.asyncio
@pytest.mark.no_blocking(threshold=1.0)
async def test_marker_threshold_passes(no_blocking):
    time.sleep(0.1)

@pytest.mark.asyncio
@pytest.mark.no_blocking(threshold=1.0, strict=True)
async def test_strict_raises(no_blocking):
    mx.eval(mx.array([1.0]) + 1)

@pytest.mark.anyio
@pytest.mark.no_blocking(threshold=1.0, strict=True)
async def test_strict_swallowed_still_fails(anyio_backend, no_blocking):
    try:
        time.sleep(0.001)
    except BlockingCallError:
        pass
"""


def test_no_blocking_fixture_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CHILD_CONFTEST))
    (tmp_path / "test_child.py").write_text(textwrap.dedent(_CHILD_TESTS))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    no_blocking: configure the no_blocking fixture\n"
    )
    report = tmp_path / "report.xml"
    env = {k: v for k, v in os.environ.items() if k != "ASYNCSIDE_BLOCKING_THRESHOLD_MS"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        error = case.find("error")
        name = case.get("name", "")
        outcomes[name] = "failed" if failure is not None else "error" if error is not None else "passed"
        node = failure if failure is not None else error
        messages[name] = (node.get("message", "") + (node.text or "")) if node is not None else ""
    expected = {
        "test_asyncio_sleep_fails": "failed",
        "test_anyio_sleep_fails[asyncio]": "failed",
        "test_anyio_sleep_fails[uvloop]": "failed",
        "test_anyio_sleep_fails[trio]": "failed",
        "test_clean_passes[asyncio]": "passed",
        "test_clean_passes[uvloop]": "passed",
        "test_clean_passes[trio]": "passed",
        "test_marker_threshold_passes": "passed",
        "test_strict_raises": "failed",
        "test_strict_swallowed_still_fails[asyncio]": "failed",
        "test_strict_swallowed_still_fails[uvloop]": "failed",
        "test_strict_swallowed_still_fails[trio]": "failed",
    }
    assert outcomes == expected, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in ("test_asyncio_sleep_fails", "test_anyio_sleep_fails[trio]"):
        assert "LoopBlockedError" in messages[name] and "time.sleep(0.2)" in messages[name], messages[name]
    assert "BlockingCallError" in messages["test_strict_raises"]
    assert "strict mode refused time.sleep(0.001)" in messages["test_strict_swallowed_still_fails[trio]"]

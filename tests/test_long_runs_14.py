"""Long runs, round 14: a process that goes on. A batch job or a notebook opens and closes many
runtimes (``asyncio.run`` per item, ``load()`` per cell): what each one takes, the process gets
back, so the fiftieth costs what the first did."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from asyncside import ExpertStore, Runtime
from asyncside.models.loading import load_streaming_model

from _facade_support import dirs, reference  # noqa: F401  (the fixtures)


def _thread_counts(script: str, store: pathlib.Path) -> list[int]:
    """The OS threads of a fresh interpreter running ``script`` (with ``STORE`` bound to
    ``store``), as it prints them, one count a line."""
    code = textwrap.dedent("""
        import gc, os, pathlib, time
        STORE = pathlib.Path(%r)

        def threads():
            # The threads anyio's workers leave behind end as their task ends: wait for those.
            gc.collect()
            for _ in range(50):
                before = len(os.listdir("/proc/self/task"))
                time.sleep(0.02)
                if len(os.listdir("/proc/self/task")) == before:
                    break
            return len(os.listdir("/proc/self/task"))
    """) % str(store) + textwrap.dedent(script)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [int(line) for line in out.stdout.split()]


def test_runtimes_opened_in_turn_leave_no_thread_behind(quick_store: pathlib.Path) -> None:
    """Each Runtime built its host pools in an anyio worker thread, which ends with the task that
    ran the runtime; MLX keeps a stream (and its scheduler thread) for every thread that ran an op,
    after that thread ended. So every ``asyncio.run`` of a runtime, and every ``load()`` then
    ``close()``, left one more OS thread in the process for good: a notebook's fiftieth model
    held fifty. The pools are now built on one thread kept for the process."""
    counts = _thread_counts("""
        import asyncio
        from asyncside import ExpertStore, Runtime
        from asyncside.facade import load

        async def once():
            async with Runtime(ExpertStore.open(STORE), resident=0.25):
                pass

        asyncio.run(once())
        print(threads())
        for _ in range(4):
            asyncio.run(once())
        print(threads())
        model, _tok = load(STORE, resident=0.25)
        model.close()
        print(threads())
        for _ in range(4):
            model, _tok = load(STORE, resident=0.25)
            model.close()
        print(threads())
    """, quick_store)
    assert counts[1] == counts[0] and counts[3] == counts[2], counts


@pytest.fixture
def device_cache_limit() -> Iterator[None]:
    """MLX's buffer cache limited as off the CPU (by the device's memory), not by the CPU's small
    default, which hid the growth; restored afterwards."""
    before = mx.set_cache_limit(1 << 34)
    try:
        yield
    finally:
        mx.set_cache_limit(before)
        mx.clear_cache()


def test_a_long_generation_keeps_mlx_buffer_cache_as_mlx_lm_does(
        dirs: tuple[pathlib.Path, pathlib.Path], reference: tuple[Any, Any],  # noqa: F811  (the fixtures)
        device_cache_limit: None) -> None:
    """StreamingModel.generate (the demo's, a Runtime user's) never cleared MLX's buffer cache,
    where mlx-lm's generate_step clears it every so many tokens: every buffer size the KV cache
    outgrew stayed cached, so on a GPU (whose cache limit is its memory) a long generation's cache
    grew without bound, past the memory plan's headroom. It now holds what mlx-lm's holds."""
    tokens = 1030  # just past a clear of mlx-lm's: what either holds then is what the period left
    prompt = [1, 2, 3, 4]
    mx.clear_cache()
    want = [int(t) for t, _ in generate_step(mx.array(prompt), reference[0], max_tokens=tokens)]
    mlx_lm_cache = mx.get_cache_memory()
    mx.clear_cache()
    sm = load_streaming_model(dirs[1])

    async def run() -> list[int]:
        async with Runtime(ExpertStore.open(dirs[1]), resident=0.25) as rt:
            return [t async for t in sm.generate(prompt, max_tokens=tokens, source=rt, stop_at_eos=False)]

    assert anyio.run(run) == want
    assert mx.get_cache_memory() <= 2 * mlx_lm_cache + (1 << 20), (mx.get_cache_memory(), mlx_lm_cache)

"""Long runs, round 14: a process that goes on. A batch job or a notebook opens and closes many
runtimes (``asyncio.run`` per item, ``load()`` per cell): what each one takes, the process gets
back, so the fiftieth costs what the first did."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap


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

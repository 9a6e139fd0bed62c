"""Helpers for the fault-class tests: a hang guard, descriptor counting, ledger checks."""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


def run_guarded(fn: Callable[..., Any], *args: Any, loop: tuple[str, dict[str, Any]], limit_s: float | None = None) -> Any:
    """``anyio.run(fn, *args)`` on ``loop`` in a daemon thread; fails the test if it never returns.

    A hang inside a shielded scope cannot be cancelled from the loop itself, so the test would
    hang with it; here the test fails instead, with the stuck thread's stack. ``limit_s`` (default
    $ASYNCSIDE_HANG_LIMIT_S, else 600) is only a hang detector, generous because a loaded CI
    machine is slow: never a performance assertion.
    """
    if limit_s is None:
        limit_s = float(os.environ.get("ASYNCSIDE_HANG_LIMIT_S", "600"))
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = anyio.run(fn, *args, backend=loop[0], backend_options=loop[1])
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    t = threading.Thread(target=target, name="guarded loop", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        frame = sys._current_frames().get(t.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
        pytest.fail(f"the loop did not return within {limit_s:.0f} s (hung); its thread:\n{stack}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def open_fds() -> set[int]:
    """This process's open descriptors (Linux: /proc/self/fd), after a collection."""
    gc.collect()
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:  # the listdir's own descriptor, closed by now
            continue
        fds.add(fd)
    return fds


def describe_fds(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} -> ?")
    return out


def assert_ledgers_clean(rt: Any) -> None:
    """Every ledger audits clean, nothing FILLING, and every LIVE row is listed in lookup()."""
    for layer, report in rt.audit().items():
        assert report.ok, (layer, report.problems)
        ledger = rt.ledger(layer)
        assert not ledger.pending(), (layer, ledger.pending())
        table = np.array(rt.lookup(layer))
        assert np.array_equal(table, ledger.lookup()), (layer, "lookup() is stale")

"""Memory budgets for tests that run ``bench offload``, and stand-ins for its runs.

A test's ``--memory`` was written for the CPU, where a run's process holds little before its model.
On MLX CUDA it holds several times more (the CUDA runtime and MLX's device state), and the same
budget holds no run: the bench refuses it before anything runs. :func:`offload_budget` keeps the
room a test's budget leaves beyond a run's process on every device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from asyncside.bench import offload

#: at least what a run's process holds on the CPU before its model (``offload.process_baseline``)
CPU_PROCESS_BYTES = 128 * 2**20


def offload_budget(cpu_budget: int) -> int:
    """``cpu_budget`` where a run's process holds what it does on the CPU; where it holds more
    (:func:`offload.process_baseline`, measured in a child once per test process), a budget that
    leaves the same room beyond it."""
    return max(cpu_budget, offload.process_baseline() + cpu_budget - CPU_PROCESS_BYTES)


def stand_in_runs(monkeypatch: pytest.MonkeyPatch, rows: int) -> list[dict[str, Any]]:
    """Replace ``bench offload``'s child runs (and its cgroup, cache drop and disk probe) by
    stand-ins: each reports three tokens, and asyncside and the slot cache ``rows`` rows in each of
    two layers. Returns the specs the runs were asked for, in order."""
    asked: list[dict[str, Any]] = []

    def child(spec: dict[str, Any], cgroup: Any, timeout: float, **_kw: Any) -> dict[str, Any]:
        asked.append(spec)
        run: dict[str, Any] = {"system": spec["system"], "status": "ok", "tokens": [1, 2, 3],
                               "decode_tokens_per_s": 1.0, "read_bytes": 0, "stats": {}, "rows_per_layer": None}
        if spec["system"] != "mlx-lm":
            run.update(stats={"hits": 3, "misses": 3}, rows_per_layer={"0": rows, "1": rows})
        return run

    monkeypatch.setattr(offload, "_child", child)
    monkeypatch.setattr(offload, "check_cgroups", lambda limit: (True, "cgroup v1"))
    monkeypatch.setattr(offload, "MemoryCgroup", lambda limit: contextlib.nullcontext())
    monkeypatch.setattr(offload, "drop_caches", lambda: True)
    monkeypatch.setattr(offload, "_bandwidth", lambda store, depth: {"GBps": 1.0, "queue_depth": 1})
    return asked


def stand_in_timed_reads(monkeypatch: pytest.MonkeyPatch, module: Any, record: int) -> None:
    """Replace ``module``'s read counter and measured generation (``bench offload``'s or the three
    tiers' child run) by a disk that reads three records before each token and, once the run ends,
    three more: the step queued ahead of the last token, which reads until the runtime drains."""
    disk = [0]
    monkeypatch.setattr(module, "_read_bytes", lambda: disk[0])

    async def generate(rt: Any, sm: Any, layers: Any, prompt: list[int], max_tokens: int, predictor: str,
                       arrived: Callable[[int], bool], started: Any = None) -> tuple[float, int, dict[str, Any]]:
        io1, t0 = disk[0], time.perf_counter()
        for tok in range(max_tokens):
            disk[0] += 3 * record
            await anyio.sleep(0.01)
            if arrived(tok):
                break
        disk[0] += 3 * record
        rows = {str(layer): 4 for layer in layers}
        return t0, io1, {"stats": {"hits": 0, "misses": 0, "bytes_read": 0}, "rows": rows, "warm": {}}

    generated: Callable[..., Coroutine[Any, Any, tuple[float, int, dict[str, Any]]]] = generate
    monkeypatch.setattr(module, "generate_measured", generated)

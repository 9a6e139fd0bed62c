"""The plan's refusal under a budget the machine sets (a memory cgroup, MemAvailable): what it
names must be what would fit, never an empty figure or a memory= the machine caps again."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from asyncside import ExpertStore, memory
from asyncside.errors import AsyncsideError
from asyncside.runtime import _plan as plan_mod

MiB = 1 << 20


def _store(path: pathlib.Path) -> ExpertStore:
    return ExpertStore.create(path, {layer: {"w": np.zeros((64, 1 << 16), np.uint8)} for layer in range(2)})


def _refusal(store: ExpertStore, **kw: object) -> str:
    args: dict[str, object] = dict(resident=0.5, pinned=None, side_rows=None, min_side_rows=8, memory=None,
                                   direct=None, host_tier="auto", tier_possible=False)
    args.update(kw)
    with pytest.raises(AsyncsideError) as info:
        plan_mod.plan_memory(store, list(store.layers), **args)  # type: ignore[arg-type]
    return str(info.value)


def test_a_refusal_under_a_cgroup_names_what_would_fit(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE`` (no --memory) in a memory cgroup too small for the
    smallest pools ended "no resident fraction fits beside the headroom: a larger memory budget
    for the smallest pools,  for these": no figure, and a dangling clause. It names the room the
    smallest pools and these need. With ``--memory 2G`` in that cgroup the refusal named
    "memory=... or more", which the cgroup capped again to the same budget: it says the cgroup
    caps memory= and must allow as much."""
    store = _store(tmp_path / "s")
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 100 * MiB)
    cgroup = memory.MemoryBudget(memory.MIN_HEADROOM // 2, "cgroup v1 memory.limit_in_bytes = 228.0 MiB")
    monkeypatch.setattr(memory, "available_memory", lambda: cgroup)
    least = memory.pool_bytes(store, 0.0) + memory.MIN_HEADROOM
    these = memory.pool_bytes(store, 0.5) + memory.MIN_HEADROOM
    said = _refusal(store)
    assert said.endswith(f"no resident fraction fits beside the headroom: a larger memory budget (at least "
                         f"{memory.describe_bytes(least)} free) for the smallest pools, at least "
                         f"{memory.describe_bytes(these)} free for these"), said
    said = _refusal(store, memory="2G")
    assert "capped by cgroup v1 memory.limit_in_bytes = 228.0 MiB" in said, said
    assert said.endswith("; memory= is capped by cgroup v1 memory.limit_in_bytes = 228.0 MiB, which must allow "
                         "as much too"), said
    # A memory= the machine does not cap: the figure alone, as before.
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(1 << 40, "MemAvailable"))
    said = _refusal(store, memory=100 * MiB + memory.MIN_HEADROOM)
    assert "memory=" in said and "capped" not in said, said

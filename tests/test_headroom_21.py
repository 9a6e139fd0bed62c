"""The memory plan's headroom, estimated from the model instead of a fixed 256 MiB.

The headroom (MLX's buffers, the KV caches) was ``MIN_HEADROOM`` for every model: on a small budget
half of it, kept from the pools and the page cache whatever the model, while the reader's O_DIRECT
staging slab (64 MiB, registered with io_uring) sat inside it uncounted. The plan now estimates it
from the model's config.json (one sequence's KV cache at the planned context, a forward of a short
prompt chunk, the staging slab where reads bypass the page cache, MLX's cache and the process's
growth), at least a floor; a model whose config does not say its widths keeps the fixed figure.
BENCHMARKS.md, "Memory we use", has the budget sweep in memory cgroups.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from asyncside import memory
from asyncside.kv_layout import kv_layout
from asyncside.runtime import Runtime, _plan
from asyncside.store import ExpertStore

MiB = 1 << 20


def _plan_of(store: ExpertStore, budget: int, **kw: object) -> _plan.MemoryPlan:
    args: dict[str, object] = dict(resident="auto", pinned=None, side_rows=None, min_side_rows=None, memory=None,
                                   direct=None, host_tier="auto", tier_possible=False)
    args.update(kw)
    return _plan.plan_memory(store, list(store.layers), **args)  # type: ignore[arg-type]


def test_the_headroom_is_estimated_from_the_model(quick_store: pathlib.Path) -> None:
    """Its parts: the KV cache of the planned context from config.json, a short chunk's forward,
    the reader's staging slab only where reads go past the page cache; the sum below the old fixed
    figure for a small model, at least the floor."""
    store = ExpertStore.open(quick_store)
    config = json.loads((quick_store / "config.json").read_text())
    direct = _plan.estimate_headroom(store, direct=True)
    buffered = _plan.estimate_headroom(store, direct=False)
    assert direct.estimated and buffered.estimated
    assert direct.kv == kv_layout(config, 4 if config.get("torch_dtype") == "float32" else 2).bytes_for(
        _plan.PLANNED_CONTEXT)
    assert direct.staging == _plan.reader_staging_bytes() > 0 and buffered.staging == 0
    assert direct.total - buffered.total == direct.staging or buffered.total == _plan.HEADROOM_FLOOR
    assert _plan.HEADROOM_FLOOR <= buffered.total < direct.total < memory.MIN_HEADROOM
    assert _plan.plan_headroom(store) == direct.total


def test_a_small_budget_the_fixed_headroom_refused_now_plans(quick_store: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of the least pools and the estimated headroom: refused with the fixed 256 MiB (the
    pools need ... and 256.0 MiB of headroom), planned now, the printed plan saying what its
    headroom holds; the forwards' room excludes the staging slab and the slack, and the KV allowance is the
    estimate's KV part plus the page cache's unused room."""
    store = ExpertStore.open(quick_store)
    least = _plan_of(store, 0, resident=0.0).pool_bytes
    budget = memory.MemoryBudget(_plan.plan_headroom(store) + least + 8 * MiB, "a test limit")
    assert budget.available < memory.MIN_HEADROOM
    monkeypatch.setattr(memory, "available_memory", lambda: budget)
    monkeypatch.setattr(_plan, "_resident_now", lambda: 0)
    plan = _plan_of(store, 0, memory=budget.available, direct=True)
    parts = plan.headroom_parts
    assert parts is not None and parts.estimated and plan.headroom_bytes == parts.total < memory.MIN_HEADROOM
    assert "headroom estimated: KV cache of 2,048 positions" in plan.describe(), plan.describe()
    assert "the reader's O_DIRECT staging 64.0 MiB" in plan.describe()
    assert plan.kv_allowance_bytes == (parts.kv or 0) + plan.kv_spare_bytes
    # a prompt chunk's buffers get the forward part alone: the slack is what the run grows by beside
    # them (MLX's cache of freed buffers, the process), which a long prompt took past the budget
    assert plan.forward_room_bytes == parts.total - (parts.kv or 0) - parts.staging - parts.slack
    assert plan.prompt_chunk(1 << 20) <= 2 * _plan.PLANNED_CHUNK
    assert plan.as_dict()["headroom_parts"]["staging_bytes"] == parts.staging


def test_buffered_reads_keep_no_staging_slab_in_the_headroom(quick_store: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that holds the whole store in the page cache reads buffered: its headroom has no
    staging slab, and what that leaves goes to the page cache."""
    store = ExpertStore.open(quick_store)
    store_bytes = sum(store.layer(i).blob_bytes for i in store.layers)
    budget = memory.MemoryBudget(memory.MIN_HEADROOM + 2 * store_bytes, "a test limit")
    monkeypatch.setattr(memory, "available_memory", lambda: budget)
    plan = _plan_of(store, 0, resident=0.5)
    assert not plan.direct
    assert plan.headroom_bytes == _plan.estimate_headroom(store, direct=False).total
    assert plan.page_cache_bytes == budget.available - plan.pool_bytes - plan.headroom_bytes


def test_a_store_without_a_config_keeps_the_fixed_headroom(tmp_path: pathlib.Path) -> None:
    """Nothing to estimate from (a store written without its model's config): the fixed figure."""
    rng = np.random.default_rng(0)
    store = ExpertStore.create(tmp_path / "s", {0: {"w": rng.integers(0, 255, size=(8, 4096), dtype=np.uint8)}})
    parts = _plan.estimate_headroom(store, direct=True)
    assert not parts.estimated and parts.total == memory.MIN_HEADROOM
    assert "the fixed figure" in parts.describe()


def test_a_runtime_plans_the_staging_slab_its_reader_allocates(quick_store: pathlib.Path) -> None:
    """``Runtime(reader_options=...)`` with a smaller staging slab: the plan counts that slab."""
    from asyncside.readers import ReaderOptions

    options = ReaderOptions()
    options.staging_bytes = 8 * MiB
    options.direct = True
    rt = Runtime(ExpertStore.open(quick_store), reader="threads", reader_options=options, memory="2G")
    parts = rt.plan_now().headroom_parts
    assert parts is not None and parts.staging == 8 * MiB


def test_the_demo_runs_in_a_cgroup_of_a_budget_the_fixed_headroom_refused(quick_store: pathlib.Path) -> None:
    """``asyncside demo --memory SIZE`` on the quick model inside a memory cgroup of SIZE: what a
    fresh process holds before its model, the plan's headroom and 64 MiB for the model, its
    tokenizer and the run's growth. The fixed headroom refused that (the process alone took more
    than SIZE less 256 MiB); it now runs, every token, with no OOM kill and its peak resident size
    inside the budget."""
    from asyncside.bench.offload import MemoryCgroup, check_cgroups, process_baseline

    base = process_baseline()
    budget = -(-(base + _plan.plan_headroom(ExpertStore.open(quick_store)) + 64 * MiB) // MiB) * MiB
    assert budget < base + memory.MIN_HEADROOM  # what the fixed headroom refused
    ok, why = check_cgroups(budget)
    if not ok:
        pytest.skip(f"no memory cgroup here: {why}")
    cmd = [sys.executable, "-m", "asyncside", "demo", "--model", str(quick_store), "--memory", str(budget),
           "--tokens", "4", "--reference", "none", "--json", "--direct"]
    with MemoryCgroup(budget, name="asyncside-test-headroom") as cg:
        out = subprocess.run(cg.wrap(cmd), capture_output=True, text=True, timeout=300)
        kills = cg.oom_kills()
    assert kills == 0 and out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["memory"]["headroom_bytes"] < memory.MIN_HEADROOM
    assert res["peak_rss_bytes"] <= budget

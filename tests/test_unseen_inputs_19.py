"""Unseen inputs, round 19: model shapes and memory limits the repository never tried (records of
many MiB, budgets capped by a memory cgroup), as ``bench offload``, ``demo`` and the runtime's plan
meet them. What is refused is one line naming what did not fit and what would."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from asyncside.store import ExpertStore


def test_the_offload_bandwidth_probe_takes_a_store_of_records_of_many_mib(tmp_path: pathlib.Path) -> None:
    """``bench offload --stores STORE`` of a wide model (records of about a hundred MiB: a hidden
    size of 1024 and an expert width of 8192 in float32) ended before any run in ``OverflowError:
    Integer value 2147487744 is outside the supported range``: the disk probe gave its pools 32
    rows of records whatever their size, more than MLX allocates in one array (and gigabytes of
    this process's memory). Its rows and each pass's reads are bounded in bytes; the probe runs,
    and says the reads it kept in flight."""
    from asyncside.bench import offload

    record = 68 << 20  # 32 rows of it pass what one MLX array may hold
    store = ExpertStore.create(tmp_path / "store", {0: {"w": np.zeros((2, record), np.uint8)}})
    got = offload._bandwidth(str(store.path), None, passes=1, records=2)
    assert got["GBps"] > 0 and got["record_bytes"] >= record, got
    assert got["queue_depth"] * got["record_bytes"] <= offload.PROBE_POOL_BYTES, got


def test_a_pool_of_more_than_two_gib_is_allocated_and_aliases_its_rows(tmp_path: pathlib.Path) -> None:
    """``Runtime(store, resident=1.0)`` over a layer whose pool of one segment passes 2 GiB (an
    8-bit DeepSeek-V3's experts are 14 MiB a matrix, 256 of them; here 33 rows of 64 MiB) failed
    to start in ``OverflowError: Integer value 2214596608 is outside the supported range``: the
    pool's buffer was one flat array of bytes, more than an MLX dimension holds. It is a flat array
    of a wider unit, viewed as the segment's dtype: the rows past 2 GiB are aligned, and bytes
    written through a row's address are what MLX reads there."""
    from asyncside.pools import PoolSet

    shape = (16384, 1024)  # 64 MiB of uint32, as quantized weights are stored
    records = np.stack([np.full(shape, 7, np.uint32), np.arange(np.prod(shape), dtype=np.uint32).reshape(shape)])
    store = ExpertStore.create(tmp_path / "store", {0: {"w": records}})
    pools = PoolSet(store.layer(0), 33)
    pool = pools.arrays["w"]
    assert pool.shape == (33, *shape) and pools.aligned and pools.row_address("w", 32) % 4096 == 0
    seg = store.layer(0).segment("w")
    pools.row_view("w", 32)[:] = store.read_record(0, 1)[seg.offset : seg.offset + seg.nbytes]
    assert np.array_equal(np.array(pool[32]), records[1]) and int(pool[31].sum().item()) == 0


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroups_tmpfs_files_are_not_room_for_the_pools(version: str, tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --resident auto`` in a memory cgroup (a container of 1200M) that had
    written 500 MB to a tmpfs (a RAM-disk store, /dev/shm, a tmpfs /tmp) planned the pools into
    those 500 MB: the cgroup's page cache was counted as room it reclaims, tmpfs pages included
    (they are in memory.stat's ``cache`` / ``file``, and are never reclaimed without swap), and the
    process was killed by the cgroup's OOM killer before its first token. They are taken off the room."""
    from asyncside import memory

    mount = tmp_path / "memory"
    mount.mkdir()
    limit, usage, page_cache, tmpfs = 96 << 20, 80 << 20, 70 << 20, 60 << 20  # below any machine's MemAvailable
    if version == "v1":
        (mount / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (mount / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (mount / "memory.stat").write_text(f"cache {page_cache}\nrss {usage - page_cache}\nshmem {tmpfs}\n"
                                           f"total_cache {page_cache}\ntotal_shmem {tmpfs}\n")
        kind = "cgroup cgroup rw,memory"
    else:
        (mount / "memory.max").write_text(f"{limit}\n")
        (mount / "memory.current").write_text(f"{usage}\n")
        (mount / "memory.stat").write_text(f"anon {usage - page_cache}\nfile {page_cache}\nshmem {tmpfs}\n")
        kind = "cgroup2 cgroup2 rw"
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("4:memory:/\n" if version == "v1" else "0::/\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"35 31 0:32 / {mount} rw,relatime - {kind}\n")
    monkeypatch.setattr(memory, "PROC_CGROUP", cgroup)
    monkeypatch.setattr(memory, "PROC_MOUNTINFO", mountinfo)
    assert memory.available_memory().available == limit - usage + (page_cache - tmpfs)


def test_the_demo_says_the_reference_needs_more_than_the_budget_when_it_does(quick_store: pathlib.Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --model STORE --memory 362M`` chose the slot cache as its reference saying
    "the model's 2.2 MiB fit half of the 362.0 MiB budget, but with them held the streaming run
    would need 362.0 MiB": the need was a few bytes past the budget, and both read the same. The
    need is named rounded up to a whole MiB, above the budget it does not fit."""
    import re

    import asyncside.memory as memory
    from asyncside.demo import choose_reference, reference_model_bytes
    from asyncside.runtime._plan import NEED_MARGIN, min_rows, plan_headroom

    store = ExpertStore.open(quick_store)
    monkeypatch.setattr(memory, "proc_self_bytes", lambda *a: 100 << 20)
    pools = memory.pool_bytes(store, 0.0, min_rows=min_rows(store))
    need = (100 << 20) + reference_model_bytes(store) + pools + plan_headroom(store) + NEED_MARGIN
    chosen, why = choose_reference(store, "auto", need - 1, "auto")
    said = re.search(r"fit half of the ([0-9.]+) MiB budget, but .* would need ([0-9.]+) MiB", why)
    assert chosen == "slot-cache" and said is not None, why
    assert float(said.group(2)) > float(said.group(1)), why


def test_offload_names_a_store_too_small_for_the_ratio_once(quick_store: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``bench offload --stores DIR/store`` refused a store smaller than --store-ratio budgets with
    "--stores DIR/store: the store store (2 MB) is less than 4x the budget": the store's label is its
    directory's name, which the lead had named already. It is named once."""
    from asyncside.bench import offload
    from tests._cli_support import run_cli

    monkeypatch.setattr(offload, "process_baseline", lambda: 250 * 10**6)  # what a fresh run's process holds
    rc, err = run_cli(capsys, "bench", "offload", "--stores", str(quick_store), "--memory", "400M",
                      "--localities", "low", "--quiet")
    assert rc == 2 and f"--stores {quick_store}: the store (" in err and "is less than 4x the budget" in err, err
    assert f"the {quick_store.name} store" not in err, err


def test_a_budget_larger_than_the_machine_reads_back_in_its_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``asyncside demo --memory 100T`` (larger than the machine, capped to what it has) printed the
    budget as "memory=102400.00 GiB ... capped by MemAvailable": a size of a TiB or more reads in TiB."""
    from asyncside import memory
    from asyncside.runtime import _plan as plan_mod

    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(16 << 30, "MemAvailable"))
    budget = plan_mod.resolve_budget("100T")
    assert budget.available == 16 << 30 and budget.source.startswith("memory=100.00 TiB, "), budget
    assert budget.source.endswith("capped by MemAvailable"), budget
    assert memory.describe_bytes(3 << 30) == "3.00 GiB" and memory.describe_bytes(1 << 40) == "1.00 TiB"

"""Unseen inputs, round 19: model shapes and memory limits the repository never tried (records of
many MiB, budgets capped by a memory cgroup), as ``bench offload``, ``demo`` and the runtime's plan
meet them. What is refused is one line naming what did not fit and what would."""

from __future__ import annotations

import pathlib

import numpy as np

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

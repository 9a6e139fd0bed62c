"""Streamed resolves read their O_DIRECT records in order (native/chunked_read.h, ``read_ordered``).

One background job reads a begin's absent records through one ring, at most
``_native.fault_read_window()`` pieces in flight, so the first record lands first instead of sharing
the disk with every other one (BENCHMARKS.md, "Streamed reads in order"). The rows hold the records'
bytes at every window, in place or through the bounce buffers; a failure stops what follows it, and
the records it left unread say so; a table dropped while the read runs waits for it; a decode is
token for token mlx-lm's; window 0 is the former side-by-side reads; bad windows are refused.
"""

from __future__ import annotations

import errno
import gc
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import (
    assert_rows_hold,
    direct_decode,
    direct_fault_table,
    drain_events,
    eval_failed_step,
    import_native_with,
    model_store,
    native_read_settings_kept,
)

from asyncside import _native
from asyncside.models import reference_generate

CPU = mx.default_stream(mx.cpu)
RING = _native.io_uring_available()[0]
RECORD = 3 * 8192  # direct_fault_table(block=8192): 24 KiB records


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    with native_read_settings_kept():
        yield


def ordered_reads() -> int:
    return int(_native.fault_counters()["ordered_reads"])


def stream(table: object, experts: list[int]) -> list[int]:
    """One begin of ``experts`` (absent) and a finish of them all; the rows it gave."""
    ids = mx.array(experts, dtype=mx.uint32)
    rows = _native.begin_rows(ids, table, CPU)[: len(experts)]
    return eval_failed_step(_native.finish_rows(ids, rows, table, CPU))


def takes_direct_reads(pools: Any) -> bool:
    """Whether O_DIRECT reads may land in these host pools' rows (not in CUDA managed memory)."""
    return all(_native.testing.direct_reads_land_in_pool(a) for a in pools.arrays.values())


@pytest.mark.parametrize("layout", ["blocks", "odd"])
@pytest.mark.parametrize("window", [1, 2, 5, 32])
def test_an_ordered_read_lands_every_records_bytes(tmp_path: pathlib.Path, layout: str, window: int) -> None:
    """Four records of six 4 KiB pieces each: a window smaller than a record, one that straddles
    records, and one larger than the whole read; in place ("blocks") and through the bounce
    buffers, reused piece after piece ("odd")."""
    store, pools, table = direct_fault_table(tmp_path, layout, block=8192, seed=5)
    _native.set_fault_read_chunk(4096)
    _native.set_fault_read_window(window)
    before, chunk_ops = ordered_reads(), _native.fault_counters()["chunk_ops"]
    in_place = _native.fault_counters()["direct_in_place"]
    assert sorted(stream(table, [6, 14, 1, 9])) == [0, 1, 2, 3]
    assert_rows_hold(store, pools, table, [6, 14, 1, 9])
    assert all(int(e[4]) == 0 and int(e[5]) == 2 for e in drain_events(table))  # read in the background
    if RING:
        assert ordered_reads() - before == 1
        assert _native.fault_counters()["chunk_ops"] - chunk_ops >= 4 * RECORD // 4096
    expected_in_place = 4 if layout == "blocks" and RING and takes_direct_reads(pools) else 0
    assert _native.fault_counters()["direct_in_place"] - in_place == expected_in_place


def test_window_zero_reads_each_record_on_its_own_job(tmp_path: pathlib.Path) -> None:
    store, pools, table = direct_fault_table(tmp_path, "odd", block=8192, seed=6)
    _native.set_fault_read_window(0)
    before = ordered_reads()
    stream(table, [2, 7, 11])
    assert_rows_hold(store, pools, table, [2, 7, 11])
    assert ordered_reads() == before


def test_without_io_uring_each_record_keeps_its_own_job(tmp_path: pathlib.Path) -> None:
    """Without io_uring (off here; absent on macOS) one thread would read the records one request
    at a time: they keep a background job each, side by side, each read whole."""
    store, pools, table = direct_fault_table(tmp_path, "blocks", block=8192, seed=7)
    _native.set_fault_read_chunk(4096)
    _native.testing.set_fault_read_uring(False)
    before = _native.fault_counters()
    stream(table, [0, 5, 10, 15])
    assert_rows_hold(store, pools, table, [0, 5, 10, 15])
    after = _native.fault_counters()
    assert after["ordered_reads"] == before["ordered_reads"]
    assert after["chunk_fallbacks"] - before["chunk_fallbacks"] == 4


@pytest.mark.skipif(not RING, reason="ordered reads need io_uring")
@pytest.mark.parametrize("window", [0, 1])
def test_a_failure_stops_the_records_after_it(tmp_path: pathlib.Path, window: int) -> None:
    """The blob ends inside expert 14's record, the third of the begin. One piece in flight at a
    time, expert 2's record (whole in the file, but after 14 in the begin) is never read, and its
    log says so; side by side (window 0) it is read. Either way nothing failed is published and
    every row comes back."""
    store, pools, table = direct_fault_table(tmp_path, "blocks", block=8192, seed=8)
    _native.set_fault_read_chunk(4096)
    _native.set_fault_read_window(window)
    spec = store.layer(0)
    os.truncate(spec.path, spec.stride * 14 + 8192)
    stream(table, [12, 13, 14, 2])
    by_expert = {int(e[2]): int(e[4]) for e in drain_events(table)}
    assert by_expert == {12: 0, 13: 0, 14: errno.ENODATA, 2: errno.ECANCELED if window else 0}, by_expert
    now = np.array(table.table())
    assert now[14] == -1 and (now[2] == -1) == bool(window)
    assert_rows_hold(store, pools, table, [12, 13] + ([] if window else [2]))
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


@pytest.mark.skipif(not RING, reason="ordered reads need io_uring")
def test_a_table_dropped_while_its_ordered_read_runs_waits_for_it(tmp_path: pathlib.Path) -> None:
    """The begin's node is evaluated (its reads start) and everything is dropped before any finish:
    the table's end waits for the job's last touch of it (the job holds a count of its own)."""
    gc.collect()  # an earlier test's table, kept by its traceback, is not counted as this one
    created = _native.fault_counters()["tables_destroyed"]
    store, pools, table = direct_fault_table(tmp_path, "odd", block=8192, seed=9)
    _native.set_fault_read_chunk(4096)
    _native.set_fault_read_window(1)
    ids = mx.array([3, 4, 5, 6], dtype=mx.uint32)
    mx.eval(_native.begin_rows(ids, table, CPU))
    del table, ids
    gc.collect()
    mx.synchronize(CPU)
    assert _native.fault_counters()["tables_destroyed"] == created + 1
    del pools, store


def test_bad_windows_are_refused() -> None:
    before = _native.fault_read_window()
    with pytest.raises(ValueError, match="window: expected 0 .* or 1 to 32 pieces in flight, got 33"):
        _native.set_fault_read_window(33)
    with pytest.raises(TypeError):
        _native.set_fault_read_window(-1)
    assert _native.fault_read_window() == before


def _import_with(value: str) -> Any:
    return import_native_with("ASYNCSIDE_FAULT_READ_WINDOW", value, "_native.fault_read_window()")


def test_the_environment_sets_the_window_and_a_bad_value_is_named() -> None:
    assert _import_with("3").stdout.strip() == "3"
    assert _import_with("0").stdout.strip() == "0"
    bad = _import_with("64")
    assert bad.returncode != 0
    assert "ASYNCSIDE_FAULT_READ_WINDOW" in bad.stderr and "got '64'" in bad.stderr, bad.stderr


@pytest.mark.parametrize("quant", ["float", "q4"])
def test_a_direct_decode_is_exact_in_order_and_side_by_side(tmp_path: pathlib.Path, quant: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued decode past the page cache with streamed switches, every expert read on demand: tokens
    equal mlx-lm's with one piece in flight, eight, and side-by-side reads, and the
    ordered windows did read in order."""
    if mx.default_device() == mx.gpu:
        pytest.skip("the host pools' fault path (CPU stream)")
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe",
                                           {"group_size": 64, "bits": 4} if quant == "q4" else None)
    ref = reference_generate(model, prompt, max_tokens=6)
    _native.set_fault_read_chunk(4096)

    def decode(window: int) -> tuple[list[int], int]:
        _native.set_fault_read_window(window)
        before = ordered_reads()
        return direct_decode(store_dir, prompt, 6, streamed=True), ordered_reads() - before

    for window in (1, 8, 0):
        tokens, ordered = decode(window)
        assert tokens == ref, (window, tokens, ref)
        assert (ordered > 0) == (bool(window) and RING), (window, ordered)


def test_a_record_left_unread_is_named_so_in_the_step_error() -> None:
    """The FillError of a record a failure left unread says it was not read, not that its own read
    failed (its record may be whole in the file)."""
    from asyncside.runtime._queued import _fault_cause

    assert _fault_cause(errno.ECANCELED, 16) == "not read: an earlier record of the same streamed read failed first"


@pytest.mark.parametrize("layout", ["blocks", "odd"])
def test_a_damaged_record_fails_alone_and_the_others_verify(tmp_path: pathlib.Path, layout: str) -> None:
    """Checksums on, two tokens of three experts routing four distinct absent records (each read
    once), one of them damaged in the file: its check fails (-1), the reads after it go on (a
    mismatch is not a read error), and every other record lands verified."""
    store, pools, table = direct_fault_table(tmp_path, layout, block=8192, seed=10)
    spec = store.layer(0)
    table.set_checksums(spec.checksum, list(spec.checksums))
    _native.set_fault_read_chunk(4096)
    _native.set_fault_read_window(2)
    with open(spec.path, "r+b") as fh:  # one byte of expert 7's record, in its last piece
        fh.seek(spec.stride * 7 + spec.stride - 4096)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    stream(table, [5, 7, 9, 9, 11, 5])
    by_expert = {int(e[2]): int(e[4]) for e in drain_events(table)}
    assert by_expert == {5: 0, 7: -1, 9: 0, 11: 0}, by_expert
    assert_rows_hold(store, pools, table, [5, 9, 11])
    assert np.array(table.table())[7] == -1
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_rows_that_refuse_direct_reads_are_read_through_a_buffer(tmp_path: pathlib.Path) -> None:
    """Host pools of this build take O_DIRECT reads in place; where they may not (CUDA managed
    memory, or the test hook saying so) a whole-blocks record lands through the bounce buffers
    instead, with the same bytes, streamed and resolved alike."""
    store, pools, table = direct_fault_table(tmp_path, "blocks", block=8192, seed=11)
    # On MLX's CPU build the hook is what turns the buffer on; a CUDA build's rows already refuse.
    assert takes_direct_reads(pools) != mx.cuda.is_available()
    _native.set_fault_read_chunk(4096)
    _native.testing.set_direct_in_place(False)
    in_place = _native.fault_counters()["direct_in_place"]
    assert sorted(stream(table, [3, 12, 7])) == [0, 1, 2]
    assert_rows_hold(store, pools, table, [3, 12, 7])
    assert _native.fault_counters()["direct_in_place"] == in_place
    _native.testing.set_direct_in_place(True)
    table.reclaim()
    table.sync(np.full(store.layer(0).n_experts, -1, dtype=np.int32))
    table.lend([0, 1, 2])
    assert sorted(stream(table, [5, 2, 9])) == [0, 1, 2]
    assert_rows_hold(store, pools, table, [5, 2, 9])
    assert _native.fault_counters()["direct_in_place"] - in_place == (3 if RING and takes_direct_reads(pools) else 0)

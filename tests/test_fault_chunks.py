"""Chunked O_DIRECT fault reads: a record read past the page cache is split into requests of at most
``_native.fault_read_chunk()`` bytes, all in flight at once (native/chunked_read.h).

The rows hold the same bytes as whole-record reads, resolved or streamed, in place or through the
aligned buffer; a decode is token for token the same; a chunk that fails (the blob ends inside or
before the record) fails the fill with the usual error and publishes nothing; chunk 0 is the whole
record in one request; bad settings are refused naming what was expected.
"""

from __future__ import annotations

import errno
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

from asyncside import ExpertStore, _native
from asyncside.models import reference_generate
from asyncside.pools import PoolSet

CPU = mx.default_stream(mx.cpu)
NEW_TOKENS = 6
RING = _native.io_uring_available()[0]  # chunked reads submit on an io_uring ring, else fall back


@pytest.fixture(autouse=True)
def _restore_chunk() -> Iterator[None]:
    with native_read_settings_kept():
        yield


def counters() -> dict[str, int]:
    return {k: v for k, v in _native.fault_counters().items() if k.startswith("chunk") or k == "ordered_reads"}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in counters().items()}


def direct_table(tmp_path: pathlib.Path, layout: str) -> tuple[ExpertStore, PoolSet, Any]:
    """A one-layer O_DIRECT fault table over 16 experts of 24 KiB ("blocks": whole 4 KiB blocks end
    to end, read in place; "odd": segments off the block grid, read through the aligned buffer),
    4 host rows, every expert absent and every row lent (``direct_fault_table``)."""
    store, pools, table = direct_fault_table(tmp_path, layout, block=8192, seed=3)
    assert store.layer(0).stride % 4096 == 0
    return store, pools, table


def fault_four(table: Any) -> None:
    """Experts 3 and 11 resolved, 6 and 14 streamed."""
    mx.eval(_native.expert_rows(mx.array([3, 11], dtype=mx.uint32), table, CPU))
    ids = mx.array([6, 14], dtype=mx.uint32)
    rows = _native.begin_rows(ids, table, CPU)[:2]
    mx.eval(_native.finish_rows(ids, rows, table, CPU))


@pytest.mark.parametrize("layout", ["blocks", "odd"])
@pytest.mark.parametrize("chunk", [4096, 8192])
def test_chunked_direct_faults_land_the_records_bytes(tmp_path: pathlib.Path, layout: str, chunk: int) -> None:
    store, pools, table = direct_table(tmp_path, layout)
    _native.set_fault_read_chunk(chunk)
    assert _native.fault_read_chunk() == chunk
    before = counters()
    fault_four(table)
    assert_rows_hold(store, pools, table, [3, 11, 6, 14])
    d = delta(before)
    # A record's 24 KiB (in place) or its widened span (the same 24 KiB) in 24 KiB / chunk requests:
    # the resolved two each on its own, the streamed two in one ordered read (test_ordered_reads.py).
    per_record = 24576 // chunk
    if RING:
        assert d["chunked_reads"] == 2 and d["ordered_reads"] == 1 and d["chunk_fallbacks"] == 0, d
        assert d["chunk_ops"] >= 4 * per_record, d
    else:
        assert d == {"chunked_reads": 0, "chunk_ops": 0, "chunk_fallbacks": 4, "ordered_reads": 0}, d


def test_chunk_zero_reads_whole_records(tmp_path: pathlib.Path) -> None:
    store, pools, table = direct_table(tmp_path, "blocks")
    _native.set_fault_read_chunk(0)
    before = counters()
    fault_four(table)
    assert_rows_hold(store, pools, table, [3, 11, 6, 14])
    assert delta(before) == {"chunked_reads": 0, "chunk_ops": 0, "chunk_fallbacks": 0, "ordered_reads": 0}


def test_without_a_ring_chunked_reads_fall_back_to_one_request(tmp_path: pathlib.Path) -> None:
    store, pools, table = direct_table(tmp_path, "blocks")
    _native.set_fault_read_chunk(4096)
    _native.testing.set_fault_read_uring(False)
    before = counters()
    fault_four(table)
    assert_rows_hold(store, pools, table, [3, 11, 6, 14])
    assert delta(before) == {"chunked_reads": 0, "chunk_ops": 0, "chunk_fallbacks": 4, "ordered_reads": 0}


@pytest.mark.parametrize("cut", [(4096, 10000), (16384, 8192)], ids=["mid-block", "short-then-eof"])
@pytest.mark.parametrize("streamed", [False, True], ids=["resolve", "streamed"])
def test_a_failed_chunk_fails_the_fill_and_publishes_nothing(tmp_path: pathlib.Path, streamed: bool,
                                                             cut: tuple[int, int]) -> None:
    """The blob now ends inside expert 8's record (mid-block; or on a block boundary inside a chunk,
    so that chunk's read comes back short and its rest finds the end) and before experts 9.."""
    store, pools, table = direct_table(tmp_path, "blocks")
    chunk, keep = cut
    _native.set_fault_read_chunk(chunk)
    spec = store.layer(0)
    os.truncate(spec.path, spec.stride * 8 + keep)
    ids = mx.array([2, 8, 12], dtype=mx.uint32)
    if streamed:  # the failed reads' slots read the lent rows begin gave them (left unpublished)
        rows = _native.begin_rows(ids, table, CPU)[:3]
        assert all(0 <= r < 4 for r in eval_failed_step(_native.finish_rows(ids, rows, table, CPU)))
    else:  # the failed faults' ids read row 0
        assert eval_failed_step(_native.expert_rows(ids, table, CPU))[1:] == [0, 0]
    by_expert = {int(e[2]): int(e[4]) for e in drain_events(table)}
    # Streamed, 12 comes after 8 in one ordered read: read (past the end) if its pieces went out
    # before 8's failure came back, else never read (test_ordered_reads.py pins both down).
    twelve = {errno.ENODATA, errno.ECANCELED} if streamed and RING else {errno.ENODATA}
    assert by_expert[2] == 0 and by_expert[8] == errno.ENODATA and by_expert[12] in twelve, by_expert
    now = np.array(table.table())
    assert now[8] == -1 and now[12] == -1 and now[2] >= 0  # the failed rows published nothing
    assert_rows_hold(store, pools, table, [2])
    assert sorted(table.reclaim()) == [0, 1, 2, 3]  # every row comes back: none leaked


@pytest.mark.parametrize("bad", [-1, 1000, 4097, 2**31])
def test_bad_chunks_are_refused(bad: int) -> None:
    before = _native.fault_read_chunk()
    with pytest.raises((ValueError, TypeError), match="chunk|incompatible"):
        _native.set_fault_read_chunk(bad)
    assert _native.fault_read_chunk() == before


def _import_with(value: str) -> Any:
    return import_native_with("ASYNCSIDE_FAULT_READ_CHUNK", value, "_native.fault_read_chunk()")


def test_the_environment_sets_the_chunk_and_a_bad_value_is_named() -> None:
    good = _import_with("8192")
    assert good.returncode == 0 and good.stdout.strip() == "8192", good.stderr
    assert _import_with("0").stdout.strip() == "0"
    bad = _import_with("1M")
    assert bad.returncode != 0
    assert "ASYNCSIDE_FAULT_READ_CHUNK" in bad.stderr and "multiple of 4096" in bad.stderr, bad.stderr


@pytest.mark.parametrize("quant", ["float", "q4"])
def test_a_direct_decode_is_the_same_with_tiny_chunks(tmp_path: pathlib.Path, quant: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued decode past the page cache (O_DIRECT), resolved and streamed switches: tokens equal
    mlx-lm's with 4 KiB chunks and with whole records, and the chunked one did split its reads."""
    if mx.default_device() == mx.gpu:
        pytest.skip("the host pools' fault path (CPU stream)")
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe",
                                           {"group_size": 64, "bits": 4} if quant == "q4" else None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)

    def decode(chunk: int, streamed: bool) -> tuple[list[int], dict[str, int]]:
        _native.set_fault_read_chunk(chunk)
        before = counters()
        return direct_decode(store_dir, prompt, NEW_TOKENS, streamed=streamed), delta(before)

    for streamed in (False, True):
        whole, d0 = decode(0, streamed)
        chunked, d1 = decode(4096, streamed)
        assert whole == ref and chunked == ref, (streamed, whole, chunked, ref)
        assert d0["chunked_reads"] == 0 and d0["chunk_ops"] == 0 and d0["ordered_reads"] == 0
        split = d1["chunked_reads"] + d1["ordered_reads"]  # a streamed switch's reads are ordered
        assert (split if RING else d1["chunk_fallbacks"]) > 0, d1
        assert d1["chunk_ops"] >= 2 * split, d1

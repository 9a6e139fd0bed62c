"""Streamed resolves: a small switch's misses read in the background, its slots computed as they land.

The native pair (``begin_rows`` / ``finish_rows``, native/expert_faults.h) on a bare fault table, and
the queued step that uses it (``ForwardOptions.streamed_switch``, asyncside/models/queued.py): the
tokens equal mlx-lm's, every read is published and logged, a failed read fails the step without
leaking its rows, and a begin whose finish nodes never ran leaves nothing in flight.
"""

from __future__ import annotations

import errno
import os
import pathlib

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import (
    assert_rows_hold,
    direct_fault_table,
    drain_events,
    eval_failed_step,
    fault_table,
    model_store,
)

from asyncside import _native
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.runtime import Runtime

from _models_support import BASE

CPU = mx.default_stream(mx.cpu)
NEW_TOKENS = 8
STREAMED = ForwardOptions(mode="queued", streamed_switch=True)
UNSTREAMED = ForwardOptions(mode="queued", streamed_switch=False)


def test_begin_maps_every_expert_and_finish_publishes_each_slot(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([3, 1, 0, 2])
    ids = mx.array([[9, 4, 12]], dtype=mx.int32)
    both = _native.begin_rows(ids, table, CPU)
    assert both.shape == (1, 6)  # [rows | order] per token
    rows = both[:, :3]
    slots = [_native.finish_rows(ids[:, s:s + 1], rows[:, s:s + 1], table, CPU) for s in range(3)]
    got = np.array(mx.concatenate(slots, axis=-1)).tolist()
    assert got == [[3, 1, 0]]  # lent rows in lend order, one per miss
    assert np.array(both[:, 3:]).tolist() == [[0, 1, 2]]  # all missed: the order their reads were issued
    assert_rows_hold(store, pools, table, [9, 4, 12])
    ev = drain_events(table)
    assert sorted(ev[:, [0, 1, 2, 4]].tolist()) == sorted([[3, -1, 9, 0], [1, -1, 4, 0], [0, -1, 12, 0]])
    assert ev[:, 5].tolist() == [2, 2, 2]  # read in the background
    c = table.counters()
    assert c["streamed"] == 1 and c["faults"] == 3 and c["hits"] == 0
    # A second begin: two hits and a miss evicting the least recently used of the rest.
    ids = mx.array([[5, 12], [9, 6]], dtype=mx.uint32)  # two tokens of two slots
    both = _native.begin_rows(ids, table, CPU)
    rows = both[:, :2]
    out = np.array(mx.concatenate([_native.finish_rows(ids[:, s:s + 1], rows[:, s:s + 1], table, CPU)
                                   for s in range(2)], axis=-1)).tolist()
    assert out[0][1] == 0 and out[1][0] == 3 and {out[0][0], out[1][1]} == {1, 2}
    assert np.array(both[:, 2:]).tolist() == [[1, 0], [0, 1]]  # per token: the hit's slot first
    assert_rows_hold(store, pools, table, [12, 9, 5, 6])
    assert table.counters()["hits"] == 2


def test_a_begin_whose_finish_never_ran_is_settled_by_the_next_call(tmp_path: pathlib.Path) -> None:
    """A step that failed before its finish nodes: settle() (what the runtime's quiesce calls, off
    the loop) waits for the reads it began and logs them, and so does the next begin or reclaim, so
    no read is left writing into a row and the ledger hears of every row the begin took."""
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    mx.eval(_native.begin_rows(mx.array([7, 8, 9], dtype=mx.uint32), table, CPU))
    assert table.pending
    table.settle()
    assert not table.pending
    ev = drain_events(table)
    assert sorted(ev[:, 2].tolist()) == [7, 8, 9] and (ev[:, 4] == 0).all()
    assert_rows_hold(store, pools, table, [7, 8, 9])
    # The next begin settles too: its own misses' rows are the ones the first left.
    mx.eval(_native.begin_rows(mx.array([1, 2], dtype=mx.uint32), table, CPU))
    mx.eval(_native.begin_rows(mx.array([1], dtype=mx.uint32), table, CPU))
    assert sorted(drain_events(table)[:, 2].tolist()) == [1, 2]
    assert not table.pending  # a begin whose experts all hit leaves nothing pending
    assert sorted(table.reclaim()) == [0, 1, 2, 3]  # every row back, filled ones included


def test_a_failed_streamed_read_fails_at_its_finish_and_logs_every_read(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    spec = store.layer(0)
    os.truncate(spec.path, spec.stride * 8)  # experts 8.. now lie past the end of the blob
    ids = mx.array([3, 10, 5], dtype=mx.uint32)
    rows = _native.begin_rows(ids, table, CPU)[:3]
    first = _native.finish_rows(ids[0:1], rows[0:1], table, CPU)
    mx.eval(first)  # expert 3 is whole: its slot computes
    # The failed read's slot reads the row begin gave it (a lent row, left unpublished).
    assert eval_failed_step(_native.finish_rows(ids[1:2], rows[1:2], table, CPU))[0] in (0, 1, 2, 3)
    ev = drain_events(table)
    by_expert = {int(e[2]): int(e[4]) for e in ev}
    assert by_expert == {3: 0, 10: errno.ENODATA, 5: 0}  # the failure, and the read still in flight, logged
    now = np.array(table.table())
    assert now[10] == -1 and now[3] >= 0 and now[5] >= 0  # the failed row published nothing
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_streamed_pair_is_refused_where_it_cannot_run(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    with pytest.raises(ValueError, match="integer"):
        _native.begin_rows(mx.array([1.0]), table, CPU)
    if mx.default_device() == mx.gpu:
        with pytest.raises(ValueError, match="CPU stream"):
            _native.begin_rows(mx.array([1]), table, mx.default_stream(mx.gpu))


@pytest.mark.parametrize("quant", ["float", "q4"])
@pytest.mark.parametrize("model_type", sorted(BASE))
def test_streamed_switches_are_exact_with_misses_in_every_layer(tmp_path: pathlib.Path, model_type: str,
                                                                 quant: str) -> None:
    if mx.default_device() == mx.gpu:
        pytest.skip("streamed switches are the CPU stream's (host pools)")
    store_dir, model, prompt = model_store(tmp_path, model_type,
                                            {"group_size": 64, "bits": 4} if quant == "q4" else None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=STREAMED)
    k = int(sm.forward.walk.top_k)
    before = _native.fault_counters()["background_reads"]

    async def main() -> tuple[list[int], dict]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            return tokens, dict(rt.stats())

    tokens, stats = anyio.run(main)
    assert tokens == ref
    assert stats["streamed_faults"] > 0 and stats["background_read_s"] > 0
    assert stats["read_wait_s"] <= stats["background_read_s"] + 1.0  # waits are for those reads alone
    counters = sm.forward_with(STREAMED).counters
    assert counters["streamed_switches"] >= (NEW_TOKENS - 1) * len(sm.moe_layers)
    assert _native.fault_counters()["background_reads"] > before  # misses were read in the background
    assert stats["faults"] >= len(sm.moe_layers)


def test_the_plan_past_the_page_cache_streams_large_records_only(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """streamed_switch None (the default) streams where the memory plan reads past the page cache
    and the records are large enough to repay it; not in memory, and not for small records."""
    from asyncside.runtime import _queued

    if mx.default_device() == mx.gpu:
        pytest.skip("streamed switches are the CPU stream's (host pools)")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    auto = ForwardOptions(mode="queued")

    def run(direct: bool) -> int:
        monkeypatch.setenv("ASYNCSIDE_DIRECT", "1" if direct else "0")
        sm = load_streaming_model(store_dir, completed=completed, options=auto)
        k = int(sm.forward.walk.top_k)

        async def main() -> list[int]:
            async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
                assert rt.memory["direct"] is direct
                return [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]

        assert anyio.run(main) == ref
        return int(sm.forward_with(auto).counters["streamed_switches"])

    assert run(True) == 0  # the tiny model's records are far below the threshold
    monkeypatch.setattr(_queued, "STREAM_MIN_RECORD_BYTES", 0)
    assert run(True) > 0
    assert run(False) == 0


def test_a_failed_read_in_a_streamed_step_fails_the_step_and_frees_its_rows(tmp_path: pathlib.Path) -> None:
    if mx.default_device() == mx.gpu:
        pytest.skip("streamed switches are the CPU stream's (host pools)")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=STREAMED)
    k = int(sm.forward.walk.top_k)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)
            saved = {}
            for layer in sm.moe_layers:
                path = sm.store.layer(layer).path
                saved[path] = path.read_bytes()
                os.truncate(path, 0)
            try:
                with pytest.raises((FillError, ExceptionGroup)) as info:
                    for tok in range(sm.config["vocab_size"]):
                        await sm(mx.array([[tok]]), cache, source=rt)
                errors = info.value.exceptions if isinstance(info.value, ExceptionGroup) else [info.value]
                assert all(isinstance(e, FillError) and e.errno == errno.ENODATA for e in errors), errors
            finally:
                for path, data in saved.items():
                    with open(path, "r+b") as fh:  # noqa: ASYNC230 - the test damages its own store
                        fh.write(data)
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            for layer in sm.moe_layers:
                assert rt.ledger(layer).lent_rows() == []
            assert sm.forward_with(STREAMED).counters["streamed_switches"] > 0
            assert [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)] == ref

    anyio.run(main)


@pytest.mark.parametrize("layout", ["blocks", "odd"])
def test_direct_faults_read_whole_block_records_straight_into_the_rows(tmp_path: pathlib.Path, layout: str) -> None:
    """O_DIRECT faults of a record made of whole 4 KiB blocks end to end land in the pool rows with
    no copy pass (counted by ``direct_in_place``) where the rows may take them; any other record,
    or rows in CUDA managed memory, goes through the aligned buffer.
    Either way the rows hold the record's bytes, streamed or not."""
    store, pools, table = direct_fault_table(tmp_path, layout)
    spec = store.layer(0)
    before = _native.fault_counters()["direct_in_place"]
    mx.eval(_native.expert_rows(mx.array([3, 11], dtype=mx.uint32), table, CPU))
    ids = mx.array([6, 14], dtype=mx.uint32)
    rows = _native.begin_rows(ids, table, CPU)[:2]
    mx.eval(_native.finish_rows(ids, rows, table, CPU))
    assert_rows_hold(store, pools, table, [3, 11, 6, 14])
    in_place = _native.fault_counters()["direct_in_place"] - before
    assert spec.stride % 4096 == 0  # records are block aligned in the blob either way
    # An MLX CUDA build's host arrays are managed memory, which reads go around (a buffer).
    takes_them = all(_native.testing.direct_reads_land_in_pool(a) for a in pools.arrays.values())
    assert in_place == (4 if layout == "blocks" and takes_them else 0), in_place

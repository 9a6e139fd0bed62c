"""Prefetch inside queued steps: a streamed switch starts the next MoE layer's predicted experts.

Past the page cache a queued decode step streams each layer's misses (``_streamed_switch``); with
a predictor, the layer's last slot passes through a ``prefetch_rows`` node that starts reading the
next MoE layer's predicted experts into its lent rows (``FaultTable::prefetch``), and that layer's
own resolve settles them first, so the ones predicted right are hits. What is checked: tokens stay
those of the all-resident reference under the same routing; prefetched reads are counted apart from
misses and the hits they bring are counted (``prefetch_hits``); precision and recall of a queued
step's predictions are counted; a failed prefetch read fails nothing (the row is freed, the expert
read again if routed); a predictor whose precision is known to be poor stops prefetching; ledgers
audit clean throughout.
"""

from __future__ import annotations

import errno
import os
import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import assert_rows_hold, drain_events, eval_failed_step, fault_table, model_store

from asyncside import _native
from asyncside.bridge import completed
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.models import queued as queued_mod
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.models.forward import StepMode
from asyncside.models.predict import PredictionQuality
from asyncside.routing import RoutingTrace, preset
from asyncside.runtime import Runtime

TOKENS = 20
CPU = mx.default_stream(mx.cpu)
PREFETCH, STREAMED = 3, 2  # FaultEvent::source of a prefetch's read, of a streamed resolve's

pytestmark = pytest.mark.skipif(mx.default_device() == mx.gpu, reason="streamed switches: the host pools' path")


@pytest.fixture()
def built(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[pathlib.Path, Any, list[int], dict[str, int]]:
    """A tiny qwen3_moe store read past the page cache, its model, a prompt, and its shape."""
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed)
    moe = sm.moe_layers
    shape = {"moe_layers": len(moe), "n_experts": sm.store.layer(moe[0]).n_experts,
             "top_k": int(sm.config["num_experts_per_tok"]), "first": moe[0], "second": moe[1]}
    return store_dir, model, prompt, shape


def decode(store_dir: pathlib.Path, prompt: list[int], trace: pathlib.Path, predictor: str,
           k: int, streamed_switch: bool | None = True) -> tuple[list[int], Any, PredictionQuality]:
    """Greedy queued decode with streamed switches (``streamed_switch=None``: the default, none on
    records this small), nothing resident, the rows a layer k (the least), routing replayed from
    ``trace``: tokens, the runtime's stats, the predictions' quality."""
    sm = load_streaming_model(store_dir, completed=completed,
                              options=ForwardOptions(mode=StepMode.QUEUED, streamed_switch=streamed_switch))
    sm.set_routing(trace)

    async def main() -> tuple[list[int], Any]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            if not rt.memory["direct"]:
                pytest.skip("this file system refuses O_DIRECT")
            tokens = [t async for t in sm.generate(prompt, max_tokens=TOKENS, source=rt, predictor=predictor)]
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {i: r.problems for i, r in reports.items()}
            return tokens, rt.stats()

    tokens, stats = anyio.run(main)
    return tokens, stats, PredictionQuality.from_counters(sm.forward.counters)


def reference(store_dir: pathlib.Path, model: Any, prompt: list[int], trace: pathlib.Path) -> list[int]:
    """mlx-lm's greedy tokens with every expert in memory, routed by ``trace`` as the runtime is."""
    sm = load_streaming_model(store_dir, completed=completed)
    replay = sm.set_routing(trace)
    force_reference(model, sm.arch.block_attr, replay)
    try:
        return reference_generate(model, prompt, max_tokens=TOKENS)
    finally:
        rewind_reference(model)


def test_predicted_experts_are_prefetched_and_hit_and_the_tokens_stay_exact(tmp_path: pathlib.Path, built: Any) -> None:
    store_dir, model, prompt, shape = built
    trace = tmp_path / "low70.npz"
    preset("low", tokens=64, n_layers=shape["moe_layers"], n_experts=shape["n_experts"], top_k=shape["top_k"],
           prediction_precision=0.7).save(trace)
    ref = reference(store_dir, model, prompt, trace)
    with_trace, stats, quality = decode(store_dir, prompt, trace, "trace", shape["top_k"])
    without, base, none_quality = decode(store_dir, prompt, trace, "none", shape["top_k"])
    assert with_trace == ref and without == ref
    # The same routed experts both times; the predicted ones the prefetch brought in are hits.
    assert stats["hits"] + stats["misses"] == base["hits"] + base["misses"]
    assert base["prefetch_reads"] == 0 and base["prefetch_hits"] == 0
    assert stats["prefetch_reads"] > 0 and 0 < stats["prefetch_hits"] <= stats["prefetch_reads"]
    assert stats["hits"] > base["hits"] and stats["misses"] < base["misses"]
    # Every read is a miss's or a prefetch's: bytes are counted for both and for nothing else.
    stride = base["bytes_read"] // base["misses"]
    assert base["bytes_read"] == base["misses"] * stride
    assert stats["bytes_read"] == (stats["misses"] + stats["prefetch_reads"]) * stride
    assert stats["prefetch_failures"] == 0
    # Only the second MoE layer is predicted (from the first's streamed switch): precision and
    # recall are counted for it, once per token of every step (the prompt's chunk, then the decode
    # steps), near the trace's precision.
    assert quality.token_layers == len(prompt) - 1 + TOKENS and quality.precision is not None
    assert 0.4 <= quality.precision <= 1.0 and quality.recall == quality.precision
    assert none_quality.token_layers == 0


def test_a_layer_too_small_to_stream_prefetches_once_its_resolve_is_done(tmp_path: pathlib.Path,
                                                                         built: Any) -> None:
    """Records under the streamed switches' least size (the default: plain switches here): the
    first MoE layer's resolve passes through a prefetch node of the second's prediction. Before,
    a predictor read nothing ahead on such a store."""
    store_dir, model, prompt, shape = built
    trace = tmp_path / "low70.npz"
    preset("low", tokens=64, n_layers=shape["moe_layers"], n_experts=shape["n_experts"], top_k=shape["top_k"],
           prediction_precision=0.7).save(trace)
    ref = reference(store_dir, model, prompt, trace)
    with_trace, stats, quality = decode(store_dir, prompt, trace, "trace", shape["top_k"], streamed_switch=None)
    without, base, _ = decode(store_dir, prompt, trace, "none", shape["top_k"], streamed_switch=None)
    assert with_trace == ref and without == ref
    assert stats["hits"] + stats["misses"] == base["hits"] + base["misses"]
    assert base["prefetch_reads"] == 0
    assert stats["prefetch_reads"] > 0 and 0 < stats["prefetch_hits"] <= stats["prefetch_reads"]
    assert stats["hits"] > base["hits"] and stats["misses"] < base["misses"]
    stride = base["bytes_read"] // base["misses"]
    assert stats["bytes_read"] == (stats["misses"] + stats["prefetch_reads"]) * stride
    assert quality.token_layers == len(prompt) - 1 + TOKENS and quality.precision is not None


def predicting_one_expert(tmp_path: pathlib.Path, shape: dict[str, int]) -> tuple[pathlib.Path, int]:
    """A trace that never routes the layers' last expert and always predicts it (one id)."""
    never = shape["n_experts"] - 1
    t = preset("low", tokens=64, n_layers=shape["moe_layers"], n_experts=never, top_k=shape["top_k"])
    predicted = np.full(t.ids.shape[:2] + (1,), never, dtype=np.int32)
    path = tmp_path / "never.npz"
    RoutingTrace(t.ids, t.lengths, shape["n_experts"], dict(t.meta), predicted).save(path)
    return path, never


def test_a_failed_prefetch_read_fails_nothing(tmp_path: pathlib.Path, built: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The predicted expert's record is corrupt (its checksum fails) and nothing routes it: every
    prefetch of it fails, counted, its row freed each time; the decode goes on, exact."""
    store_dir, model, prompt, shape = built
    trace, never = predicting_one_expert(tmp_path, shape)
    ref = reference(store_dir, model, prompt, trace)
    sm = load_streaming_model(store_dir, completed=completed)
    spec = sm.store.layer(shape["second"])
    with open(spec.path, "r+b") as fh:
        fh.seek(never * spec.stride + 64)
        byte = fh.read(1)
        fh.seek(never * spec.stride + 64)
        fh.write(bytes([byte[0] ^ 0xFF]))
        os.fsync(fh.fileno())
    tokens, stats, _ = decode(store_dir, prompt, trace, "trace", shape["top_k"])
    assert tokens == ref
    assert stats["prefetch_failures"] > 0 and stats["prefetch_reads"] == 0 and stats["prefetch_hits"] == 0
    assert stats["failed_fills"] == 0  # no routed expert's read failed
    # Failed reads count against the prefetches' use: past the probation, no more of them.
    ungated = stats["prefetch_failures"]
    monkeypatch.setattr(queued_mod, "PREFETCH_PROBATION_READS", 4)
    tokens, stats, _ = decode(store_dir, prompt, trace, "trace", shape["top_k"])
    assert tokens == ref
    assert ungated >= TOKENS - 2 and 4 <= stats["prefetch_failures"] <= TOKENS // 2, (ungated, stats["prefetch_failures"])


def test_a_predictor_known_to_miss_stops_prefetching(tmp_path: pathlib.Path, built: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Precision 0 (the predicted expert is never routed): it is prefetched every step (the layer's
    misses evict it again) until the prefetches' use is trusted, after a few reads here, then only
    when its decayed counts fall below the probation again (a try now and then)."""
    store_dir, model, prompt, shape = built
    trace, _ = predicting_one_expert(tmp_path, shape)
    _, ungated, quality = decode(store_dir, prompt, trace, "trace", shape["top_k"])
    assert quality.precision == 0.0
    monkeypatch.setattr(queued_mod, "PREFETCH_PROBATION_READS", 4)
    tokens, gated, quality = decode(store_dir, prompt, trace, "trace", shape["top_k"])
    assert ungated["prefetch_reads"] >= TOKENS - 2  # about one a step
    # One step queued ahead of the one counted: at most a step or two past the probation.
    assert 4 <= gated["prefetch_reads"] <= TOKENS // 2, gated["prefetch_reads"]


def finish_all(table: Any, ids: mx.array, both: mx.array) -> list[int]:
    """Every slot of a begin_rows output through its finish_rows node: the rows, evaluated."""
    k = ids.shape[-1]
    rows = both[..., :k]
    slots = [_native.finish_rows(ids[..., s:s + 1], rows[..., s:s + 1], table, CPU) for s in range(k)]
    return [int(r) for r in np.array(mx.concatenate(slots, axis=-1)).reshape(-1)]


def test_a_begin_adopts_the_prefetch_it_routes_and_leaves_the_rest_pending(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    table.prefetch([7, 8, 8, 99, -1])  # a repeat and ids outside the layer name nothing more
    assert table.pending and table.counters()["prefetches"] == 1
    ids = mx.array([[8, 9, 10]], dtype=mx.uint32)
    both = _native.begin_rows(ids, table, CPU)
    rows = finish_all(table, ids, both)
    # 8 was predicted: a hit (its read adopted, computed first); 9 and 10 read as misses.
    assert np.array(both[:, 3:]).tolist() == [[0, 1, 2]]
    c = table.counters()
    assert (c["hits"], c["prefetch_hits"], c["faults"]) == (1, 1, 2)
    ev = drain_events(table)
    assert {int(e[2]): int(e[5]) for e in ev} == {8: PREFETCH, 9: STREAMED, 10: STREAMED}
    assert (ev[:, 4] == 0).all() and len(set(rows)) == 3
    assert_rows_hold(store, pools, table, [8, 9, 10])
    # 7, predicted and not routed, is still pending (its row out of the lent list) until settled.
    assert table.pending and np.array(table.table())[7] == -1
    table.settle()
    ev = drain_events(table)
    assert ev[:, [2, 4, 5]].tolist() == [[7, 0, PREFETCH]]
    assert_rows_hold(store, pools, table, [7, 8, 9, 10])
    c = table.counters()
    assert c["prefetch_reads"] == 2 and c["prefetch_hits"] == 1
    # A later routing of 7 is a hit the prefetch brought, counted once.
    finish_all(table, mx.array([[7]], dtype=mx.uint32), _native.begin_rows(mx.array([[7]], dtype=mx.uint32), table, CPU))
    c = table.counters()
    assert (c["hits"], c["prefetch_hits"]) == (2, 2)
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_misses_short_of_rows_publish_the_unrouted_prefetches_first(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2])
    table.prefetch([7, 8])  # two of the three rows, out of the lent list while read
    ids = mx.array([[9, 10]], dtype=mx.uint32)
    rows = finish_all(table, ids, _native.begin_rows(ids, table, CPU))
    ev = drain_events(table)
    assert (ev[:, 4] == 0).all(), ev  # no miss went without a row
    assert sorted(int(e[2]) for e in ev if e[5] == PREFETCH) == [7, 8]
    assert_rows_hold(store, pools, table, [9, 10])
    assert len(set(rows)) == 2 and not table.pending
    assert sorted(table.reclaim()) == [0, 1, 2]


def test_a_failed_prefetch_read_fails_the_step_only_where_its_expert_is_routed(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    spec = store.layer(0)
    os.truncate(spec.path, spec.stride * 8)  # experts 8.. now lie past the end of the blob
    # Not routed: logged as a prefetch's failed read, its row freed, nothing fails.
    table.prefetch([11])
    ids = mx.array([[3]], dtype=mx.uint32)
    finish_all(table, ids, _native.begin_rows(ids, table, CPU))
    table.settle()
    ev = drain_events(table)
    assert {int(e[2]): (int(e[4]), int(e[5])) for e in ev} == {11: (errno.ENODATA, PREFETCH), 3: (0, STREAMED)}
    c = table.counters()
    assert c["prefetch_errors"] == 1 and c["fault_errors"] == 0
    # Routed: the step fails at that expert's slot, as a miss's failed read does (source 2: the
    # runtime raises it), and the row is published for nothing.
    table.prefetch([12])
    ids = mx.array([[12]], dtype=mx.uint32)
    both = _native.begin_rows(ids, table, CPU)
    assert eval_failed_step(_native.finish_rows(ids, both[:, :1], table, CPU))[0][0] in (0, 1, 2, 3)
    ev = drain_events(table)
    assert ev[:, [2, 4, 5]].tolist() == [[12, errno.ENODATA, STREAMED]]
    assert np.array(table.table())[12] == -1 and table.counters()["fault_errors"] == 1
    # Not a hit: the routed expert was never in its row (the prefetches' use stays that of reads that landed).
    c = table.counters()
    assert (c["hits"], c["prefetch_hits"], c["prefetch_reads"]) == (0, 0, 0)
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_a_settle_mid_step_publishes_a_re_read_expert_once(tmp_path: pathlib.Path) -> None:
    """An unrouted prefetch keeps the begins' published fills in the pending list; an expert one of
    them published, evicted since and read again has two fills there. A settle before the later
    read's finish (a failed read of its step, the loop thread's settle) publishes the later fill,
    not the earlier one again: every row is lent once and each expert maps to its own bytes."""
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    table.prefetch([7, 8])  # 8 is never routed: it stays pending through the begins below
    for step in ([[7]], [[9, 10, 11]]):  # the second evicts 7
        ids = mx.array(step, dtype=mx.uint32)
        finish_all(table, ids, _native.begin_rows(ids, table, CPU))
    assert np.array(table.table())[7] == -1 and table.pending
    ids = mx.array([[7, 11]], dtype=mx.uint32)
    mx.eval(_native.begin_rows(ids, table, CPU))  # 7 read again (into 10's row); its finish never runs
    table.settle()
    ev = drain_events(table)
    assert (ev[:, 4] == 0).all(), ev
    assert sorted(int(e[2]) for e in ev) == [7, 7, 8, 9, 10, 11]
    assert [int(e[1]) for e in ev if e[2] == 7] == [-1, 10]  # the second read's row was 10's
    assert_rows_hold(store, pools, table, [7, 8, 9, 11])
    assert not table.pending
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_a_prefetch_s_eviction_is_logged_before_its_victim_is_read_again(tmp_path: pathlib.Path) -> None:
    """The prefetch takes a routed expert's row; the next begin routes that expert (a miss, read
    into another row) and not the predicted 7. The log says it left its row before it says it was
    read into another (the ledger applies them in order, and refuses an expert filled while live)."""
    store, pools, table = fault_table(tmp_path, tag=False)
    table.lend([0, 1, 2, 3])
    ids = mx.array([[5, 6, 9, 10]], dtype=mx.uint32)
    finish_all(table, ids, _native.begin_rows(ids, table, CPU))
    drain_events(table)
    table.prefetch([7])
    victim = [e for e in (5, 6, 9, 10) if np.array(table.table())[e] == -1]
    assert len(victim) == 1
    ids = mx.array([victim], dtype=mx.uint32)
    finish_all(table, ids, _native.begin_rows(ids, table, CPU))
    table.settle()
    ev = drain_events(table).tolist()
    assert [(e[1], e[2]) for e in ev][0] == (victim[0], 7), ev  # first the prefetch that evicted it
    assert [e[2] for e in ev] == [7, victim[0]], ev
    assert_rows_hold(store, pools, table, [7, victim[0]])
    assert sorted(table.reclaim()) == [0, 1, 2, 3]


def test_rows_to_spare_keep_mispredictions_pending_and_the_ledgers_clean(tmp_path: pathlib.Path, built: Any) -> None:
    """With rows to spare a misprediction stays pending past its layer's begin, which may route the
    expert the prefetch evicted: its ledger hears of that eviction first (else the decode raised
    LedgerError: the expert filled into another row while still live), and the tokens stay exact."""
    store_dir, model, prompt, shape = built
    trace = tmp_path / "low30.npz"
    preset("low", tokens=64, n_layers=shape["moe_layers"], n_experts=shape["n_experts"], top_k=shape["top_k"],
           prediction_precision=0.3).save(trace)
    tokens, stats, _ = decode(store_dir, prompt, trace, "trace", 2 * shape["top_k"])
    assert tokens == reference(store_dir, model, prompt, trace)
    assert stats["prefetch_reads"] > 0 and stats["prefetch_failures"] == 0


def test_an_unrouted_prefetch_left_pending_keeps_no_growing_list(tmp_path: pathlib.Path) -> None:
    """A prediction nothing routes stays pending while no prefetch or settle comes (the gate turned
    prefetching off): the begins after it drop the fills published since from the pending list
    instead of keeping every miss's, and the prediction is still published when settled."""
    store, pools, table = fault_table(tmp_path, rows=8, tag=False)
    table.lend(list(range(8)))
    table.prefetch([15])
    for step in range(200):
        ids = mx.array([[step % 14]], dtype=mx.uint32)
        finish_all(table, ids, _native.begin_rows(ids, table, CPU))
        assert table.pending
    # The prediction's read landed long before the last begins (each waited for a read of its own).
    assert table.counters()["pending_fills"] <= 3, table.counters()["pending_fills"]
    table.settle()
    assert_rows_hold(store, pools, table, [15, 13, 12])
    assert not table.pending and table.counters()["pending_fills"] == 0
    assert sorted(table.reclaim()) == list(range(8))

"""LRFU's recency guard on the default decode path: queued steps pick victims in their fault
tables, natively, in the order the policy names (``native_order``). The guard switches the
policy between decayed counts and last use as the requests go; the tables must follow it, and
rank by counts that are current when they switch back."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import drain_events, fault_table, model_store

from asyncside import _native
from asyncside.bridge import completed
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime

CPU = mx.default_stream(mx.cpu)


def test_decayed_counts_are_kept_while_the_table_ranks_by_recency(tmp_path: pathlib.Path) -> None:
    """Uses made while ranking by last use count once the order turns to decayed counts: expert 1
    used four times early, 2 once later, 0 last; a new expert 7 routed with 0 evicts 2 (fewest
    decayed uses). The counts were kept only in the decayed order, so after the switch every
    expert ranked 0 and the first lent row went (expert 1's, the most used)."""
    store, pools, table = fault_table(tmp_path, rows=3)
    table.set_order("recency", 8.0)
    table.lend([0, 1, 2])
    for ids in ([1], [1], [1], [1], [2], [0]):
        mx.eval(_native.expert_rows(mx.array(ids, dtype=mx.uint32), table, CPU) + 0)
    table.drain()
    table.set_order("decayed", 8.0)
    mx.eval(_native.expert_rows(mx.array([7, 0], dtype=mx.uint32), table, CPU) + 0)
    ev = drain_events(table)
    assert ev.shape[0] == 1 and ev[0, 2] == 7 and ev[0, 1] == 2, ev


def _victim_after_adopting_256(tmp_path: pathlib.Path, kept: list[float]) -> int:
    """Expert 1 used 80 times, then 2 used 40 times, then 0, ranked by decayed counts of half-life
    8 (``kept``: the table's other half-lives); then ranked by 256 and a new expert 7 routed with
    0: the expert it evicted."""
    store, pools, table = fault_table(tmp_path, rows=3)
    table.set_order("decayed", 8.0, kept)
    table.lend([0, 1, 2])
    for ids in [[1]] * 80 + [[2]] * 40 + [[0]]:
        mx.eval(_native.expert_rows(mx.array(ids, dtype=mx.uint32), table, CPU) + 0)
    table.drain()
    table.set_order("decayed", 256.0, kept)
    mx.eval(_native.expert_rows(mx.array([7, 0], dtype=mx.uint32), table, CPU) + 0)
    ev = drain_events(table)
    assert ev.shape[0] == 1 and ev[0, 2] == 7, ev
    return int(ev[0, 1])


def test_a_half_life_adopted_ranks_by_the_counts_it_would_have_had_all_along(tmp_path: pathlib.Path) -> None:
    """adaptive-lrfu judges each candidate half-life by a shadow whose counts were kept under that
    half-life all along; the table kept one count, under the half-life it ranked by, and on an
    adoption re-read it under the new one. Under a half-life of 8 both counts saturate near 12
    and the re-read makes 1 the victim (its last use older), while counted under 256 all along 1
    holds about 66 uses against 2's 37: 2 goes."""
    assert _victim_after_adopting_256(tmp_path, [8.0, 256.0]) == 2


def test_a_half_life_not_kept_starts_from_the_ranked_counts(tmp_path: pathlib.Path) -> None:
    """Told a half-life it kept no count under (no candidates given: lrfu, the old behaviour), the
    table re-reads the ranked counts under it: expert 1 goes (see above). A half-life kept must be
    positive."""
    assert _victim_after_adopting_256(tmp_path, []) == 1
    store, pools, table = fault_table(tmp_path / "other", rows=3)
    with pytest.raises(ValueError, match="kept half-lives"):
        table.set_order("decayed", 8.0, [0.0])


async def one_step(q: Any, layer: int, ids: list[int]) -> None:
    """One queued step of ``layer``'s experts ``ids``, awaited and finished."""
    step = q.begin()
    out = q.expert_rows(layer, mx.array(ids, dtype=mx.uint32)).astype(mx.int32).sum()
    q.end(out)
    mx.async_eval(out)
    await completed(out)
    q.after_step(step)


@pytest.fixture
def sm(tmp_path: pathlib.Path) -> Any:
    store_dir, _model, _prompt = model_store(tmp_path, "qwen3_moe", None)
    return load_streaming_model(store_dir, completed=completed)


def test_a_switch_of_the_policy_reaches_the_fault_tables_once_every_row_is_lent(sm: Any) -> None:
    """Once every side row is lent, a step's begin skips the layers (nothing to lend): a switch of
    the guard, learned from the fault logs, never reached the tables, which kept ranking by
    decayed counts. The tables now take the policy's order whenever the logs are applied."""
    layer = sm.moe_layers[0]

    async def main() -> tuple[str, str]:
        async with Runtime(sm.store, resident=0.0, policy="lrfu") as rt:
            q = rt.queued
            await one_step(q, layer, [0, 1])
            st = rt._s.layers[layer]
            assert st.native_order == "decayed"
            policy = st.ledger.policy
            policy.recency, policy.native_order = True, "recency"  # as the guard's switch leaves it
            await one_step(q, layer, [2])  # every row lent by now: begin's lending is skipped
            q.reconcile_all()
            seen = st.native_order
            await rt.quiesce()
            return seen, policy.native_order

    assert anyio.run(main) == ("recency", "recency")


def test_the_guards_switch_names_the_order_the_tables_take() -> None:
    """LRFU's native order is its ranking's: decayed counts, last use once the guard switches."""
    from asyncside.policies import LRFU

    p = LRFU(4.0, period=4)
    p.attach(object(), [])
    assert p.native_order == "decayed"
    p._wins = [0.0, 1000.0]  # the shadow (last use) hit far more over the window
    p._decide()
    assert p.recency and p.native_order == "recency"
    p._wins = [0.0, 1000.0]
    p._decide()
    assert not p.recency and p.native_order == "decayed"
    assert np.isfinite(p.half_life)


class _OrdersSeen:
    """A fault table's stand-in for the reconcile: records the orders it is told, passes the rest on."""

    def __init__(self, table: Any) -> None:
        self.table, self.told = table, []

    def set_order(self, order: str, half_life: float, kept: list[float] | None = None) -> None:
        self.told.append((order, half_life))
        self.kept = kept
        self.table.set_order(order, half_life, kept or [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def test_a_half_life_adaptive_lrfu_adopts_reaches_the_fault_tables(sm: Any) -> None:
    """adaptive-lrfu adopts another half-life as the requests go, its order staying "decayed": the
    tables were told only of a change of order, so queued decode kept ranking by the first half-life
    (the policy's adaptation never reached the default path's victims)."""
    layer = sm.moe_layers[0]

    async def main() -> tuple[list[tuple[str, float]], float]:
        async with Runtime(sm.store, resident=0.0, policy="adaptive-lrfu") as rt:
            q = rt.queued
            st = rt._s.layers[layer]
            policy = st.ledger.policy
            await one_step(q, layer, [0, 1])
            assert (st.native_order, st.native_half_life) == ("decayed", policy.half_life)
            other = next(h for h in policy.half_lives if h != policy.half_life)
            policy.half_life = other  # as an adoption leaves it: the order unchanged
            real, st.faults = st.faults, _OrdersSeen(st.faults)
            try:
                q.reconcile_all()
                told = list(st.faults.told)
                assert st.faults.kept == list(policy.half_lives)  # counts kept under every candidate
            finally:
                st.faults = real
            await rt.quiesce()
            return told, other

    told, other = anyio.run(main)
    assert told == [("decayed", other)]

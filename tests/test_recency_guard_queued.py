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
            step = q.begin()
            out = q.expert_rows(layer, mx.array([0, 1], dtype=mx.uint32)).astype(mx.int32).sum()
            q.end(out)
            mx.async_eval(out)
            await completed(out)
            q.after_step(step)
            st = rt._s.layers[layer]
            assert st.native_order == "decayed"
            policy = st.ledger.policy
            policy.recency, policy.native_order = True, "recency"  # as the guard's switch leaves it
            step = q.begin()  # every row lent by now: begin's lending is skipped
            out = q.expert_rows(layer, mx.array([2], dtype=mx.uint32)).astype(mx.int32).sum()
            q.end(out)
            mx.async_eval(out)
            await completed(out)
            q.after_step(step)
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

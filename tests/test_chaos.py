"""Chaos: random prefetch / ensure / drain / lease / release / cancel sequences, every loop x reader.

Each sequence opens a Runtime (random policy, side region, residency; sometimes a failing record),
runs a few concurrent tasks that draw random operations, and cancels awaits at random points
(after 0..k scheduling steps, so a cancellation lands inside every await sooner or later). After
every operation: the lookup table lists only resident or LIVE rows (never a FILLING one) and equals
the ledger's. After every sequence: every LIVE row holds exactly its record's bytes, the ledgers
audit clean (no lease or fill left after close), and no descriptor was leaked.

ASYNCSIDE_CHAOS_SEED picks other sequences; ASYNCSIDE_CHAOS_SCALE multiplies their number (CI
runs scale 1: about 4 x 10^4 operations in all, well under a minute on two idle cores).
"""

from __future__ import annotations

import errno
import os
import random
from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import LOOPS, describe_fds, open_fds, run_guarded

from asyncside import ExpertStore
from asyncside.bridge import completed
from asyncside.errors import CapacityError, FillError
from asyncside.runtime import Runtime
from asyncside.testing import FaultyReader, audit_problems, random_layers

from conftest import HAVE_URING

N_EXPERTS = 16
SEED = int(os.environ.get("ASYNCSIDE_CHAOS_SEED", "0"))
SCALE = float(os.environ.get("ASYNCSIDE_CHAOS_SCALE", "1"))
SEQUENCES = max(1, round(40 * SCALE))  # per loop x reader
OPS_PER_TASK = 40
TASKS = 3
POLICIES = ["lfu", "lru", "oneshot", "aging-lfu"]

READERS = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable here")),
    "threads",
    "aiofiles",
]


@pytest.fixture(scope="module")
def chaos_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[ExpertStore, dict]:
    store = ExpertStore.create(tmp_path_factory.mktemp("chaos") / "s", random_layers(2, N_EXPERTS, seed=7))
    truth = {(layer, e): _segments(store, layer, e) for layer in store.layers for e in range(N_EXPERTS)}
    return store, truth


def _segments(store: ExpertStore, layer: int, expert: int) -> dict[str, bytes]:
    record = store.read_record(layer, expert)
    return {s.key: bytes(record[s.offset : s.end]) for s in store.layer(layer).segments}


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


class Chaos:
    """One sequence: a Runtime and the random operations of TASKS concurrent tasks."""

    def __init__(self, store: ExpertStore, truth: dict, reader: str, rng: random.Random) -> None:
        self.store, self.truth, self.reader, self.rng = store, truth, reader, rng
        self.ops = 0
        self.seen = {"cancelled": 0, "fill_errors": 0, "fills": 0, "evictions": 0, "capacity": 0}

        self.bad: tuple[int, int] | None = None  # (layer, expert) whose reads fail

    def check_tables(self, rt: Runtime) -> None:
        """The lookup tables list resident or LIVE rows only, and lookup() is not stale."""
        for layer in self.store.layers:
            ledger = rt.ledger(layer)
            table = ledger.lookup()
            filling_rows = {f.row for f in ledger.pending()}
            listed = set(table[table >= 0].tolist())
            assert not (listed & filling_rows), (layer, "a FILLING row is in the lookup table")
            assert np.array_equal(np.array(rt.lookup(layer)), table), (layer, "lookup() is stale")
            if self.bad is not None and self.bad[0] == layer:
                assert table[self.bad[1]] < 0, "a record whose reads fail was published"

    def check_rows(self, rt: Runtime) -> None:
        for layer in self.store.layers:
            pools = rt._s.layer(layer).pools  # private on purpose: the bytes themselves are the point
            table = rt.ledger(layer).lookup()
            for e in np.flatnonzero(table >= 0).tolist():
                row = int(table[e])
                for key, want in self.truth[(layer, e)].items():
                    assert pools.row_bytes(key, row) == want, (layer, e, row, key)

    async def cancelled_after(self, steps: int | None, fn: Any, *args: Any) -> Any:
        """await fn(*args), cancelled after ``steps`` scheduling steps (None: never)."""
        with anyio.CancelScope() as scope:
            if steps is None:
                return await fn(*args)
            async with anyio.create_task_group() as tg:

                async def cancel() -> None:
                    for _ in range(steps):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                tg.start_soon(cancel)
                result = await fn(*args)
                tg.cancel_scope.cancel()
                return result
        if scope.cancelled_caught:
            self.seen["cancelled"] += 1
        return None

    def ids(self, k: int) -> list[int]:
        return self.rng.sample(range(N_EXPERTS), k)

    async def one_op(self, rt: Runtime, leases: list[tuple[int, int]]) -> None:
        """One random operation; ``leases``: the leases this task holds (a task never waits without
        bound while holding one: another task's demand may need those rows, as in a forward)."""
        rng = self.rng
        layer = rng.choice(list(self.store.layers))
        steps = None if rng.random() < 0.5 else rng.randrange(0, 12)
        if leases and steps is None:
            steps = rng.randrange(0, 60)
        op = rng.random()
        self.ops += 1
        try:
            if op < 0.35:
                ids: Any = self.ids(rng.randrange(0, 4))
                if rng.random() < 0.3:
                    ids = mx.array(ids, dtype=mx.int32) + 0  # lazy: awaited through the bridge
                await self.cancelled_after(steps, rt.ensure, layer, ids)
            elif op < 0.6:
                ids = self.ids(rng.randrange(0, 5))
                handle = rt.prefetch(layer, mx.array(ids, dtype=mx.int32) * 1 if rng.random() < 0.4 else ids)
                if rng.random() < 0.5:
                    await self.cancelled_after(steps, handle.wait)
            elif op < 0.7:
                await self.cancelled_after(steps, rt.drain, layer if rng.random() < 0.7 else None)
            elif op < 0.85:
                table = rt.ledger(layer).lookup()
                present = np.flatnonzero(table >= 0).tolist()
                if present:
                    picked = rng.sample(present, min(len(present), rng.randrange(1, 4)))
                    lease = rt.lease(layer, picked)
                    if rng.random() < 0.4:
                        rt.release_after(mx.ones((8, 8)).sum() + 1, [(layer, lease)])
                    else:
                        leases.append((layer, lease))
            elif leases:
                layer, lease = leases.pop(rng.randrange(len(leases)))
                rt.release(layer, lease)
        except* FillError as group:
            # Only the record made to fail may fail.
            for exc in _leaves(group):
                assert isinstance(exc, FillError) and self.bad is not None, exc
                assert (exc.layer, exc.expert) == self.bad and exc.errno == errno.EIO, exc
                self.seen["fill_errors"] += 1
        except* CapacityError:
            self.seen["capacity"] += 1  # leases pin rows the demand needs: a forward retries smaller
        self.check_tables(rt)

    async def task(self, rt: Runtime) -> None:
        leases: list[tuple[int, int]] = []
        try:
            for _ in range(OPS_PER_TASK):
                await self.one_op(rt, leases)
        finally:
            for layer, lease in leases:
                rt.release(layer, lease)

    async def run(self) -> None:
        rng = self.rng
        choice: Any = rng.choice([0.25, 0.5, {0: [], 1: []}])
        sizing: dict[str, Any] = {"pinned": choice} if isinstance(choice, dict) else {"resident": choice}
        side_rows = rng.choice([3, 4, 6])
        async with Runtime(self.store, **sizing, side_rows=side_rows, policy=rng.choice(POLICIES),
                           reader=self.reader, min_side_rows=3) as rt:
            if rng.random() < 0.3:
                layer = rng.choice(list(self.store.layers))
                absent = [e for e in range(N_EXPERTS) if rt.ledger(layer).lookup()[e] < 0]
                if absent:
                    self.bad = (layer, rng.choice(absent))
                    FaultyReader(rt).fail(*self.bad, errno=errno.EIO)
            async with anyio.create_task_group() as tg:
                for _ in range(TASKS):
                    tg.start_soon(self.task, rt)
            try:
                await rt.drain()
            except* FillError:
                pass
            self.check_tables(rt)
            self.check_rows(rt)
            self.seen["fills"] += int(rt.stats()["fills"])
            self.seen["evictions"] += int(rt.stats()["evictions"])
        assert not audit_problems(rt), audit_problems(rt)
        for layer in self.store.layers:
            assert not rt.ledger(layer).pending()


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_chaos(loop: tuple[str, dict], reader: str, chaos_store: tuple[ExpertStore, dict]) -> None:
    store, truth = chaos_store

    async def main() -> dict[str, int]:
        seen = {"ops": 0}
        # The loop's own descriptors first (on trio the bridge's queue lives as long as the run).
        await completed(mx.ones((2,)) + 1)
        await anyio.lowlevel.checkpoint()
        before = open_fds()
        for i in range(SEQUENCES):
            chaos = Chaos(store, truth, reader, random.Random(f"{SEED}-{loop[0]}-{loop[1]}-{reader}-{i}"))
            await chaos.run()
            seen["ops"] += chaos.ops
            for k, v in chaos.seen.items():
                seen[k] = seen.get(k, 0) + v
        # Completions abandoned by cancelled awaits are reaped when the stream gets to them: one
        # more completion behind them all, then a few loop iterations for the idle queue to close.
        await completed(mx.ones((2,)) + 2)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        leaked = open_fds() - before
        assert not leaked, describe_fds(leaked)
        return seen

    seen = run_guarded(main, loop=loop)
    print(f"chaos {loop[0]}{'+uvloop' if loop[1] else ''} {reader}: {seen}")
    assert seen["ops"] == SEQUENCES * TASKS * OPS_PER_TASK
    # The sequences did exercise the machinery (not vacuous): reads, evictions, cancellations.
    assert seen["fills"] > 0 and seen["evictions"] > 0 and seen["cancelled"] > 0, seen

"""A queued step's failed read is keyed to that step and raised where it is awaited.

The stream runs queued steps one after another while the host awaits them in turn; a read that
failed in a later step is in the fault logs by the time an earlier step is awaited. It carries the
step's id (``FillError.step``, the id ``begin`` returned) and is raised by that step's
``after_step``, not the earlier one's; never lost (``quiesce`` raises what no await did), never
raised twice. Counting by steps, off after a fault node failed as a whole, comes back once no step
is in flight (serving never quiesces).
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import mlx.core as mx
import pytest
from _fault_helpers import model_store

from asyncside import _native
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime


def _damage(spec: Any, expert: int) -> None:
    """Flip a byte of ``expert``'s record in its layer's blob: its checksum then fails."""
    damaged = bytearray(spec.path.read_bytes())
    damaged[spec.record_offset(expert) + 64] ^= 0xFF
    spec.path.write_bytes(damaged)


def _damaged(sm: Any) -> tuple[int, int]:
    """Damage the last expert of the first MoE layer: that layer and the expert."""
    layer = sm.moe_layers[0]
    spec = sm.store.layer(layer)
    _damage(spec, spec.n_experts - 1)
    return layer, spec.n_experts - 1


@pytest.fixture
def sm(tmp_path: pathlib.Path) -> Any:
    store_dir, _model, _prompt = model_store(tmp_path, "qwen3_moe", None)
    return load_streaming_model(store_dir, completed=completed)


async def _queue(rt: Runtime, layer: int, *resolves: list[int]) -> tuple[int, mx.array]:
    """Queue a step of ``layer``'s resolves (one per list of experts), scheduled; its id and output."""
    q = rt.queued
    step = q.begin()
    out = sum(q.expert_rows(layer, mx.array(ids, dtype=mx.uint32)).astype(mx.int32).sum() for ids in resolves)
    q.end(out)  # type: ignore[arg-type]
    mx.async_eval(out)
    return step, out  # type: ignore[return-value]


def test_a_failed_read_is_raised_where_its_own_step_is_awaited_not_an_earlier_one(sm: Any) -> None:
    layer, bad = _damaged(sm)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0) as rt:
            clean, _ = await _queue(rt, layer, [0, 1])
            failing, out = await _queue(rt, layer, [2, bad])
            await completed(out)  # both computed: the failure is in the log when the first is awaited
            assert _native.fault_errors_total() > 0
            rt.queued.after_step(clean)  # its own reads verified: nothing to raise
            with pytest.raises(FillError) as caught:
                rt.queued.after_step(failing)
            assert caught.value.step == failing and caught.value.expert == bad and caught.value.layer == layer
            rt.queued.after_step(failing)  # raised once
            await rt.quiesce()

    anyio.run(main)


def test_a_failed_read_of_a_step_never_awaited_is_raised_by_quiesce(sm: Any) -> None:
    layer, bad = _damaged(sm)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0) as rt:
            first, _ = await _queue(rt, layer, [0])
            failing, out = await _queue(rt, layer, [bad])
            await completed(out)
            rt.queued.after_step(first)
            with pytest.raises(FillError) as caught:
                await rt.quiesce()
            assert caught.value.step == failing

    anyio.run(main)


def test_a_later_step_s_await_raises_an_earlier_step_s_failure_that_nobody_awaited(sm: Any) -> None:
    """A step whose await never came (its task left): its failure is raised, with its step, at the
    await of a step after it, not held for ever."""
    layer, bad = _damaged(sm)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0) as rt:
            failing, _ = await _queue(rt, layer, [bad])
            later, out = await _queue(rt, layer, [0])
            await completed(out)
            with pytest.raises(FillError) as caught:
                rt.queued.after_step(later)
            assert caught.value.step == failing
            await rt.quiesce()

    anyio.run(main)


def test_counting_by_steps_comes_back_after_a_failed_node_once_no_step_is_in_flight(sm: Any) -> None:
    """A fault node that failed as a whole logs no uses, so counting by steps goes off (each
    resolve counted as a step); it came back only at a quiesce, which serving never does, so a
    split step's expert was counted a hit at each later part for as long as the server ran."""
    layer = sm.moe_layers[0]

    async def main() -> int:
        async with Runtime(sm.store, resident=0.0) as rt:
            faults = rt._s.layers[layer].faults
            # Experts no row holds after a first step (its begin lends and fills the side rows):
            # their steps run the host's node. On device pools a step whose experts all have rows
            # is answered on the device, and the node that would throw never runs.
            warm, out = await _queue(rt, layer, [0])
            await completed(out)
            rt.queued.after_step(warm)
            first, second = [e for e, row in enumerate(faults.table()) if row < 0][:2]
            _native.testing.fail_next_fault_node(faults, "no memory")
            step, out = await _queue(rt, layer, [first])
            await completed(out)
            with pytest.raises(FillError, match="a fault node failed: no memory"):
                rt.queued.after_step(step)
            # No step in flight now: the next one counts by steps again. Its two resolves route
            # the same absent expert: one use, a miss (counted per resolve: a miss, then a hit).
            hits = rt.stats()["hits"]
            step, out = await _queue(rt, layer, [second], [second])
            await completed(out)
            rt.queued.after_step(step)
            rt.queued.reconcile_all()
            healed = rt.stats()["hits"] - hits
            await rt.quiesce()
            return healed

    assert anyio.run(main) == 0


def test_the_faulty_reader_fails_a_queued_steps_read(sm: Any) -> None:
    """The test plugin's ``faulty_reader.fail(layer, expert)`` reached the reader's fills only: a
    queued step (the default decode) reads through its layer's fault table, natively, and a test
    that failed a record and generated saw no fault, ``faults_injected`` 0. The table's reads now
    fail too, as the disk would: the step's await raises the FillError naming the blob, the count
    says so, no row is left taken, and once cleared the record reads."""
    from asyncside.audit import audit_problems
    from asyncside.testing import FaultyReader

    layer = sm.moe_layers[0]
    spec = sm.store.layer(layer)
    bad = spec.n_experts - 1

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0) as rt:
            faulty = FaultyReader(rt)
            faulty.fail(layer, bad)  # EIO
            step, out = await _queue(rt, layer, [bad, 0])
            await completed(out)
            with pytest.raises(FillError, match="Input/output error") as info:
                rt.queued.after_step(step)
            assert info.value.expert == bad and str(spec.path) in str(info.value), info.value
            assert faulty.counters()["faults_injected"] == 1
            faulty.clear()
            step, out = await _queue(rt, layer, [bad])
            await completed(out)
            rt.queued.after_step(step)
            await rt.quiesce()
            assert faulty.counters()["faults_injected"] == 1
            assert audit_problems(rt) == []
            with pytest.raises(ValueError, match="an errno >= 0"):
                rt._s.layers[layer].faults.set_fault(0, 8, -5)

    anyio.run(main)

"""Under a memory budget, a generation's KV cache is planned too, not only the server's.

The plan's KV allowance (:attr:`MemoryPlan.kv_allowance_bytes`) is a share of the headroom, and in
a plan that reads past the page cache also a share of the page cache's room, which O_DIRECT reads
leave unused. :meth:`StreamingModel.generate` counts the prompt and ``max_tokens`` against it:
refused before the first step where the cache alone passes it (naming how many tokens fit), and
waiting while it does not fit beside generations already running.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import anyio
import numpy as np
import pytest
from _fault_helpers import model_store

from asyncside import ExpertStore, memory
from asyncside.errors import AsyncsideError
from asyncside.kv_layout import KVLayout, model_kv_layout
from asyncside.models import load_streaming_model
from asyncside.runtime import Runtime
from asyncside.runtime import _plan as plan_mod


def _store(tmp_path: pathlib.Path) -> ExpertStore:
    rng = np.random.default_rng(0)
    return ExpertStore.create(tmp_path / "s", {layer: {"w": rng.integers(0, 255, size=(16, 1 << 16), dtype=np.uint8)}
                                               for layer in range(2)})


def _plan(store: ExpertStore, memory_arg: Any, direct: bool | None) -> plan_mod.MemoryPlan:
    return plan_mod.plan_memory(store, list(store.layers), resident=0.25, pinned=None, side_rows=None,
                                min_side_rows=4, memory=memory_arg, direct=direct, host_tier="auto",
                                tier_possible=False)


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made as if the process held nothing and the machine had a TiB free."""
    monkeypatch.setattr(plan_mod, "_resident_now", lambda: 0)
    monkeypatch.setattr(memory, "available_memory", lambda: memory.MemoryBudget(1 << 40, "test"))


def test_a_plan_reading_past_the_page_cache_gives_its_room_to_the_kv_caches(tmp_path: pathlib.Path,
                                                                              no_process: None) -> None:
    store = _store(tmp_path)
    direct = _plan(store, "1G", direct=True)
    buffered = _plan(store, "1G", direct=False)
    own = int(direct.headroom_bytes * plan_mod.KV_SHARE)
    assert direct.direct and direct.page_cache_bytes > 0
    assert direct.kv_spare_bytes == int(direct.page_cache_bytes * plan_mod.KV_SHARE) > 0
    assert direct.kv_allowance_bytes == own + direct.kv_spare_bytes
    # the buffered plan's page cache holds every record of the store (the pools' too): only the room
    # beyond them is shared
    assert buffered.kv_spare_bytes == int((buffered.page_cache_bytes - buffered.store_bytes) * plan_mod.KV_SHARE) > 0
    assert buffered.kv_allowance_bytes == own + buffered.kv_spare_bytes
    # the forwards' share of the headroom is the same either way (the spare lies outside it)
    assert direct.forward_room_bytes == buffered.forward_room_bytes == direct.headroom_bytes - own
    assert direct.as_dict()["kv_spare_bytes"] == direct.kv_spare_bytes
    assert "of the page cache's room, unused by O_DIRECT reads" in direct.describe()
    assert "of the page cache's room, beyond the store's streamed records" in buffered.describe()
    free = _plan(store, None, direct=True)
    assert free.kv_allowance_bytes is None and free.kv_spare_bytes == 0 and free.kv_tokens(KVLayout((8,), (None,))) is None


@pytest.mark.parametrize("layout", [KVLayout((4096,) * 4, (None,) * 4), KVLayout((4096, 4096), (None, 128)),
                                    KVLayout((1,), (None,))])
def test_kv_tokens_is_the_longest_sequence_that_fits(tmp_path: pathlib.Path, no_process: None,
                                                     layout: KVLayout) -> None:
    plan = _plan(_store(tmp_path), "1G", direct=False)
    assert plan.kv_allowance_bytes is not None
    n = plan.kv_tokens(layout)
    assert n is not None and n > 0
    assert layout.bytes_for(n) <= plan.kv_allowance_bytes
    if n < 1 << 40:
        assert layout.bytes_for(n + 1) > plan.kv_allowance_bytes


def _roomy() -> int:
    """A memory budget a GiB above what this process holds (a budget counts the process's own memory)."""
    return memory.proc_self_bytes("status", "VmRSS") + (1 << 30)


@pytest.fixture
def tiny(tmp_path: pathlib.Path) -> tuple[Any, list[int]]:
    store_dir, _, prompt = model_store(tmp_path, "qwen3_moe", None)
    return load_streaming_model(store_dir), prompt


def _allow(rt: Runtime, sm: Any, positions: int, scale: float = 1.0) -> int:
    """Set the running plan's KV allowance to ``scale`` times one cache of ``positions``."""
    allowance = int(model_kv_layout(sm).bytes_for(positions, sm.prefill_step_size) * scale)
    rt._plan = dataclasses.replace(rt._plan, kv_allowance_bytes=allowance)
    return allowance


def test_a_generation_past_the_allowance_is_refused_before_its_first_step(tiny: tuple[Any, list[int]]) -> None:
    sm, prompt = tiny

    async def main() -> tuple[list[int], list[int]]:
        async with Runtime(sm.store, resident=0.25, reader="threads", memory=_roomy()) as rt:
            free = [t async for t in sm.generate(prompt, max_tokens=8, source=rt, stop_at_eos=False)]
            _allow(rt, sm, len(prompt) + 8)
            asked = (rt.stats()["ensure_calls"], rt.stats()["fills"])
            with pytest.raises(AsyncsideError, match=r"max_tokens=9 after a prompt of 12 tokens may need .* past the "
                                                     r"KV allowance .*: at most 8 new tokens fit after this prompt"):
                async for _ in sm.generate(prompt, max_tokens=9, source=rt, stop_at_eos=False):
                    raise AssertionError("a token came before the refusal")
            assert (rt.stats()["ensure_calls"], rt.stats()["fills"]) == asked  # refused before any step
            assert sm._kv.held == 0
            bounded = [t async for t in sm.generate(prompt, max_tokens=8, source=rt, stop_at_eos=False)]
            assert sm._kv.held == 0
            return free, bounded

    free, bounded = anyio.run(main)
    assert bounded == free and len(free) == 8  # the bound changes nothing that fits


def test_generations_that_do_not_fit_together_take_turns(tiny: tuple[Any, list[int]]) -> None:
    sm, prompt = tiny
    log: list[tuple[str, int]] = []

    async def run(name: str, rt: Runtime, started: anyio.Event | None) -> None:
        async for t in sm.generate(prompt, max_tokens=6, source=rt, stop_at_eos=False):
            log.append((name, t))
            if started is not None:
                started.set()

    async def main() -> None:
        async with Runtime(sm.store, resident=0.25, reader="threads", memory=_roomy()) as rt:
            _allow(rt, sm, len(prompt) + 6, scale=1.5)  # one fits, two do not
            started = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "a", rt, started)
                await started.wait()
                tg.start_soon(run, "b", rt, None)
            assert sm._kv.held == 0

    anyio.run(main)
    names = [n for n, _ in log]
    assert names == ["a"] * 6 + ["b"] * 6  # b began only once a had ended
    assert [t for n, t in log if n == "a"] == [t for n, t in log if n == "b"]


def test_generations_that_fit_together_interleave(tiny: tuple[Any, list[int]]) -> None:
    sm, prompt = tiny
    log: list[str] = []

    async def run(name: str, rt: Runtime) -> None:
        async for _ in sm.generate(prompt, max_tokens=6, source=rt, stop_at_eos=False):
            log.append(name)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.25, reader="threads", memory=_roomy()) as rt:
            _allow(rt, sm, len(prompt) + 6, scale=2.0)
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "a", rt)
                tg.start_soon(run, "b", rt)

    anyio.run(main)
    assert sorted(log) == ["a"] * 6 + ["b"] * 6
    assert log != ["a"] * 6 + ["b"] * 6  # they ran side by side (the step lock interleaves them)


def test_an_abandoned_or_cancelled_generation_gives_its_allowance_back(tiny: tuple[Any, list[int]]) -> None:
    sm, prompt = tiny

    async def main() -> None:
        async with Runtime(sm.store, resident=0.25, reader="threads", memory=_roomy()) as rt:
            _allow(rt, sm, len(prompt) + 6, scale=1.5)
            gen = sm.generate(prompt, max_tokens=6, source=rt, stop_at_eos=False)
            await gen.__anext__()
            assert sm._kv.held > 0
            await gen.aclose()  # the consumer left after one token
            assert sm._kv.held == 0
            with anyio.move_on_after(0):  # cancelled while generating
                async for _ in sm.generate(prompt, max_tokens=6, source=rt, stop_at_eos=False):
                    await anyio.sleep(1)
            assert sm._kv.held == 0
            # and the next one runs whole
            assert len([t async for t in sm.generate(prompt, max_tokens=6, source=rt, stop_at_eos=False)]) == 6

    anyio.run(main)

"""Under a memory budget, a long prompt's forwards keep their buffers within the plan's headroom.

The plan estimates a forward's transient bytes from the model's config.json
(:mod:`asyncside.runtime._forward_cost`) and bounds each prompt chunk to what fits the forward's
share of the headroom; generation takes its chunks from there. Checked on a real model with MLX's
own peak-memory counter, against the same prompt in one chunk (which passes the room: the check
can fail), with the tokens equal to mlx-lm's.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import model_store

from asyncside import memory
from asyncside.models import load_streaming_model, reference_generate
from asyncside.runtime import Runtime
from asyncside.runtime import _plan as plan_mod
from asyncside.runtime._forward_cost import ForwardCost, forward_cost

QWEN3 = {"hidden_size": 2048, "num_attention_heads": 32, "moe_intermediate_size": 768, "intermediate_size": 6144,
         "num_experts_per_tok": 8, "vocab_size": 151936, "num_hidden_layers": 48}


@pytest.mark.parametrize("cost", [ForwardCost(1000, 10, 0), ForwardCost(18432, 24, 4096), ForwardCost(5000, 0, 100)])
@pytest.mark.parametrize("room", [0, 50_000, 1 << 20, 1 << 30])
@pytest.mark.parametrize("cached", [0, 300, 100_000])
def test_chunk_is_the_longest_that_fits(cost: ForwardCost, room: int, cached: int) -> None:
    for want in (1, 2, 7, 512, 2048):
        n = cost.chunk(room, want, cached)
        assert 1 <= n <= want
        if n > 1:
            assert cost.bytes(n, cached) <= room
        if n < want:
            assert cost.bytes(n + 1, cached) > room  # the longest: one more token would not fit


def test_forward_cost_reads_the_widths_each_family_names() -> None:
    qwen = forward_cost(QWEN3)
    assert qwen is not None
    # experts' width, not the dense MLP's; the head on the last position only
    assert qwen.per_token == 4 * (24 * 2048 + 3 * 8 * 768) and qwen.per_pair == 4 * 3 * 32
    assert qwen.fixed == 2 * 4 * 151936
    mixtral = forward_cost({"hidden_size": 4096, "num_attention_heads": 32, "intermediate_size": 14336,
                            "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral is not None and mixtral.per_token == 4 * (24 * 4096 + 3 * 2 * 14336)
    nested = forward_cost({"model_type": "multimodal", "text_config": QWEN3})
    assert nested == qwen
    assert forward_cost({"hidden_size": 64}) is None  # too little said: no bound rather than a guess
    assert forward_cost(None) is None
    # a full Qwen3-30B-A3B-wide prompt of mlx-lm's prefill step costs far more than the headroom
    assert qwen.bytes(2048) > 4 * memory.MIN_HEADROOM


def _roomy() -> int:
    """A memory budget a GiB above what this process holds (a budget counts the process's own
    memory, and a test suite's process holds a lot by the time it gets here)."""
    return memory.proc_self_bytes("status", "VmRSS") + (1 << 30)


def _peak_above(store_dir: pathlib.Path, prompt: list[int], budget: int, *, bounded: bool,
                monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], int, Any]:
    """(tokens, MLX's peak bytes above what was active before generating, the plan)."""
    import asyncside.models.streaming as streaming

    with monkeypatch.context() as m:
        if not bounded:
            m.setattr(streaming, "prompt_chunk", lambda source, want, cached: want)
        sm = load_streaming_model(store_dir)

        async def main() -> tuple[list[int], int, Any]:
            async with Runtime(sm.store, resident=0.25, memory=budget, reader="threads") as rt:
                mx.synchronize()
                mx.clear_cache()
                base = mx.get_active_memory()
                mx.reset_peak_memory()
                toks = [t async for t in sm.generate(prompt, max_tokens=3, source=rt, stop_at_eos=False)]
                return toks, mx.get_peak_memory() - base, rt.plan

        return anyio.run(main)


@pytest.mark.skipif(mx.default_device() == mx.gpu,
                    reason="the forward room bounds MLX's buffers of one chunk as the CPU runs it; on MLX CUDA "
                           "a chunk's queued GPU work keeps several layers' buffers alive at once (device "
                           "memory), which the cost model does not estimate")
def test_a_long_prompt_stays_within_the_forward_room(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A headroom small enough that this tiny model's long prompt needs several chunks (the real
    # headroom would need a wider model than a test can afford to build).
    monkeypatch.setattr(plan_mod, "MIN_HEADROOM", 64 << 20)
    store_dir, model, _ = model_store(tmp_path, "qwen3_moe", None)
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 128, 1500)]
    budget = _roomy()

    toks, peak, plan = _peak_above(store_dir, prompt, budget, bounded=True, monkeypatch=monkeypatch)
    room = plan.forward_room_bytes
    assert room is not None and plan.forward is not None
    chunk = plan.prompt_chunk(len(prompt) - 1)
    assert 1 < chunk < len(prompt) - 1  # the bound binds here
    assert f"at most {chunk} tokens" in plan.describe()
    assert peak <= room, (peak, room)  # the estimate holds on the real forward
    assert toks == reference_generate(model, prompt, max_tokens=3)  # and the chunks cost no exactness

    whole, whole_peak, _ = _peak_above(store_dir, prompt, budget, bounded=False, monkeypatch=monkeypatch)
    assert whole == toks
    assert whole_peak > room, (whole_peak, room)  # one chunk passes the room: what the bound prevents


def test_no_budget_no_bound(tmp_path: pathlib.Path) -> None:
    store_dir, _, _ = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.25, reader="threads") as rt:
            assert rt.plan is not None and rt.plan.forward_room_bytes is None
            assert rt.plan.prompt_chunk(4096) == 4096
            assert rt.memory["prompt_chunk_at_start"] is None

    anyio.run(main)


def test_prompt_ids_outside_the_vocabulary_are_refused(tmp_path: pathlib.Path) -> None:
    """An id past the embedding table would read whatever lies beyond it (garbage tokens, no error)."""
    store_dir, _, _ = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir)

    async def main(prompt: list[int]) -> None:
        # refused before the source is asked for anything
        async for _ in sm.generate(prompt, max_tokens=1, source=object()):  # type: ignore[arg-type]
            pass

    for prompt in ([1, 2, 128], [-1, 3]):
        with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 128\)"):
            anyio.run(main, prompt)

    async def fine() -> list[int]:
        async with Runtime(sm.store, resident=0.25, reader="threads") as rt:
            return [t async for t in sm.generate([1, 2, 127], max_tokens=1, source=rt, stop_at_eos=False)]

    assert len(anyio.run(fine)) == 1


def test_the_server_takes_its_prefill_chunk_from_the_plan(tmp_path: pathlib.Path) -> None:
    from asyncside.serving.step_shapes import bounded_prefill_chunk

    store_dir, _, _ = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.25, reader="threads", memory=_roomy()) as rt:
            assert rt.plan is not None
            # a room for a few tokens of this model: the asked chunk shrinks to what fits it
            # (the allowance all the headroom's but what no forward may use: none of it from the page
            # cache's room)
            parts = rt.plan.headroom_parts
            kept = parts.not_forward if parts is not None else 0
            tight = dataclasses.replace(rt.plan, kv_allowance_bytes=rt.plan.headroom_bytes - kept - (64 << 10),
                                        kv_spare_bytes=0)

            class Source:
                plan = tight

            assert 1 < bounded_prefill_chunk(512, Source()) == tight.prompt_chunk(512) < 512
            assert bounded_prefill_chunk(512, rt) == 512  # the real room holds this small model's chunk
            assert bounded_prefill_chunk(512, object()) == 512  # a source without a plan: as asked

    anyio.run(main)

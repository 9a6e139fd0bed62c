"""Queued steps: one step queued per token, expert misses served inside the stream.

Over a real Runtime on converted stores of every architecture, with pools far smaller than the
experts (so every MoE layer faults): tokens equal mlx-lm's, decode logits bitwise equal, every
MoE layer faulted, no step fell back, and the ledgers audit clean with the native tables. Then the
failure paths: a read that fails inside the stream fails the step with FillError and frees its
row; the native table refuses bad input with clear errors.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from _fault_helpers import drain_events, eval_failed_step, fault_table, model_store
from mlx_lm.models.cache import make_prompt_cache

from asyncside import ExpertStore, _native
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import ForwardOptions, load_streaming_model, reference_generate
from asyncside.pools import PoolSet
from asyncside.runtime import Runtime
from asyncside.store import LayerSpec

from _models_support import BASE

QUEUED = ForwardOptions(mode="queued")
CPU = mx.default_stream(mx.cpu)  # the native table tests run on host pools, on the CPU stream
NEW_TOKENS = 8


@pytest.fixture(params=[0, 3], ids=["reads-on-the-stream", "reads-on-3-workers"])
def read_threads(request: pytest.FixtureRequest) -> object:
    """Fault resolves read their absent records on the stream's thread alone, or side by side on
    worker threads (the default on a machine of 4 cores or more; none on this 2-core VM)."""
    before = _native.fault_read_threads()
    counters = _native.fault_counters()
    _native.set_fault_read_threads(request.param)
    yield request.param
    _native.set_fault_read_threads(before)
    now = _native.fault_counters()
    if request.param and now["nodes_created"] > counters["nodes_created"]:  # the test ran steps (no skip)
        # some resolve had several records to read (a streamed one reads on its own threads)
        assert (now["shared_reads"] > counters["shared_reads"]
                or now["background_reads"] > counters["background_reads"])


def _top_k(sm: Any) -> int:
    """The most experts a MoE block of the model routes a token to (ernie4_5_moe's config calls it moe_k)."""
    return int(sm.forward.walk.top_k)


@pytest.mark.parametrize("host_tier", ["auto", 0])
@pytest.mark.parametrize("slices", ["staged", "experts", "pairs"])
@pytest.mark.parametrize("quant", ["float", "q4"])
@pytest.mark.parametrize("model_type", sorted(BASE))
def test_queued_steps_exact_and_fault_in_every_layer(tmp_path: pathlib.Path, model_type: str, quant: str,
                                                    slices: str, host_tier: int | str, read_threads: int) -> None:
    on_device = _native.device_faults_available() and mx.default_device() == mx.gpu
    if host_tier == 0 and not on_device:
        pytest.skip("host_tier applies to device pools (MLX CUDA) only")
    if slices == "pairs" and model_type != "qwen3_moe":
        pytest.skip("slices of pairs (ForwardOptions(expert_slices=False)): one architecture is enough")
    if slices == "staged" and not (on_device and host_tier == "auto"):
        pytest.skip("staged switches need device pools with a host tier (MLX CUDA)")
    if quant == "q4" and model_type == "gpt_oss":
        pytest.skip("tiny gpt_oss shapes do not quantize with group size 64")
    if quant == "q4" and mx.default_device() == mx.gpu:
        # MLX CUDA's own quantized prefill is wrong at these tiny widths (tests/test_models.py).
        pytest.skip("MLX CUDA: quantized prefill is wrong at one quantization group per row (tests/test_models.py)")
    store_dir, model, prompt = model_store(tmp_path, model_type, {"group_size": 64, "bits": 4} if quant == "q4" else None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    # A prompt long enough for mlx-lm's sorted switch (>= 64 pairs): its prefill and its step
    # resolve their experts in parts of pairs sorted by expert.
    long_prompt = [int(t) for t in np.random.default_rng(6).integers(0, model.args.vocab_size, 40)]
    ref_long = reference_generate(model, long_prompt, max_tokens=NEW_TOKENS)
    steps = [prompt, [5], [17], [99], [3], long_prompt, [7]]
    ref_cache = make_prompt_cache(model)
    ref_logits = [model(mx.array(s)[None], cache=ref_cache) for s in steps]
    mx.eval(ref_logits)
    options = (QUEUED if slices == "staged" else
               dataclasses.replace(QUEUED, staged_switches=False, expert_slices=slices == "experts"))
    sm = load_streaming_model(store_dir, completed=completed, options=options)
    k = _top_k(sm)

    async def main() -> tuple[list[int], list[mx.array], dict, dict]:
        # Rows for k experts per layer only: every step that routes elsewhere faults.
        async with Runtime(sm.store, resident=0.0, min_side_rows=k, host_tier=host_tier) as rt:
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            tokens_long = [t async for t in sm.generate(long_prompt, max_tokens=NEW_TOKENS, source=rt)]
            cache = sm.make_cache()
            logits = [await sm(mx.array(s)[None], cache, source=rt) for s in steps]
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            faulted = {layer: rt.ledger(layer).stats["faulted"] for layer in sm.moe_layers}
            return tokens, tokens_long, logits, faulted, rt.stats()

    tokens, tokens_long, logits, faulted, stats = anyio.run(main)
    assert tokens == ref and tokens_long == ref_long
    for i, (a, b) in enumerate(zip(ref_logits, logits)):
        assert a.shape == b.shape
        assert mx.array_equal(a, b).item(), f"step {i}: logits differ (max {mx.abs(a - b).max().item()})"
    counters = sm.forward_with(options).counters
    # The 12-token prompt step routes more experts than a layer has rows: it ran queued too, its
    # switches resolving one token's experts at a time (and its logits are still exact); the
    # 40-token step and the prefills of both generations too, the long ones sorted by expert and
    # resolved in slices of at most a layer's rows of distinct experts (or of pairs), or, staged,
    # copied into the layer's staging arrays in one resolve (the 12-token ones too).
    assert counters["queued"] == 2 * NEW_TOKENS + len(steps) and counters["fallbacks"] == 0
    assert counters["queued_prefill"] == 2 and counters["per_layer"] == 0
    if slices == "staged":
        assert counters["staged_switches"] > 0
        assert counters["expert_slices"] == 0 and counters["sorted_parts"] == 0
        assert stats["staged_copies"] > 0 and stats["staging_bytes"] > 0, stats
    else:
        assert counters["token_parts"] > 0 and counters["staged_switches"] == 0
    if slices == "experts":
        assert counters["expert_slices"] > 0 and counters["sorted_parts"] == 0
    elif slices == "pairs":
        assert counters["sorted_parts"] > 0 and counters["expert_slices"] == 0
    assert all(n > 0 for n in faulted.values()), faulted  # misses served in every MoE layer
    assert stats["faults"] == sum(faulted.values()) and stats["failed_fills"] == 0
    # On a GPU with the host tier, an expert faulted in again comes from pinned host memory, not
    # from the store: only the other faults read.
    if on_device and host_tier == "auto":
        assert stats["tier_faults"] > 0 and stats["host_tier_bytes"] > 0, stats
    else:
        assert stats["tier_faults"] == 0 and stats["host_tier_bytes"] == 0, stats
    stride = ExpertStore.open(store_dir).layer(sm.moe_layers[0]).stride
    assert stats["bytes_read"] >= (stats["faults"] - stats["tier_faults"]) * stride
    assert stats["misses"] == stats["faults"] + stats["staged_copies"], stats


@pytest.mark.parametrize("mode", ["queued", "per-layer"])
def test_a_steps_head_is_scheduled_with_it_and_is_the_draw_of_its_logits(tmp_path: pathlib.Path, mode: str) -> None:
    """``step(..., head=draw)``: a queued step builds the draw into its graph and schedules it with
    the step (so the stream computes it right after the logits, not behind what is queued next);
    on every path the result is ``draw(logits)``, bit for bit."""
    from asyncside.models.streaming import greedy

    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    ref_cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=ref_cache))
    ref_logits = [model(mx.array([[t]]), cache=ref_cache) for t in (5, 17)]
    mx.eval(ref_logits)
    options = QUEUED if mode == "queued" else ForwardOptions(mode="per-layer")
    sm = load_streaming_model(store_dir, completed=completed, options=options)
    fwd = sm.forward

    async def main() -> list[tuple[str, mx.array, mx.array]]:
        out = []
        async with Runtime(sm.store, resident=0.5) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)
            for t in (5, 17):
                ctx = fwd.context(cache, rt)
                drawn: list[mx.array] = []

                def draw(logits: mx.array, drawn: list[mx.array] = drawn) -> mx.array:
                    drawn.append(logits)
                    return greedy(logits)

                y = await fwd.step(ctx, mx.array([[t]]), head=draw)
                status = _native.array_status(y)
                await fwd.finish(ctx, y)
                out.append((status, y, drawn[0]))
        return out

    before = fwd.counters["queued"]
    results = anyio.run(main)
    queued = fwd.counters["queued"] - before  # the prompt's step, then the two decode steps
    assert queued == 3 if mode == "queued" else queued == 0
    for (status, y, logits), ref in zip(results, ref_logits):
        if mode == "queued":
            assert status != "unscheduled"  # handed to MLX with the step, not left to the await
        assert mx.array_equal(logits, ref).item()
        assert y.tolist() == greedy(ref).tolist()


def test_a_queued_steps_completion_is_armed_as_it_is_scheduled(tmp_path: pathlib.Path) -> None:
    """A queued step's completion signal is issued as the step is scheduled (``finish`` awaits
    that one), so a next step queued before the await does not delay it; the tokens are exact."""
    from asyncside import bridge
    from asyncside.models.streaming import greedy

    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed)
    fwd = sm.forward

    async def main() -> tuple[list[int], list[bool], int]:
        tokens, armed = [], []
        async with Runtime(sm.store, resident=0.5) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)
            ctx = fwd.context(cache, rt)
            y = await fwd.step(ctx, mx.array([[5]]), head=greedy)
            c = bridge.counters()
            before = c["issued"] + c["fast_path"]
            for _ in range(3):
                armed.append(ctx.armed is not None and ctx.armed[0] is y)
                nctx = fwd.context(cache, rt)
                ny = await fwd.step(nctx, y[None], head=greedy)  # queued before y is awaited
                await fwd.finish(ctx, y)
                assert ctx.armed is None  # consumed by finish
                tokens.append(int(y.item()))
                ctx, y = nctx, ny
            await fwd.finish(ctx, y)
            c = bridge.counters()
            issued = c["issued"] + c["fast_path"] - before
        return tokens, armed, issued

    tokens, armed, issued = anyio.run(main)
    ref = reference_generate(model, prompt + [5], max_tokens=4)
    assert tokens == ref[:3]
    assert armed == [True] * 3
    # one completion per step, its armed one (a ticket, or none if the step was computed by then):
    # nothing of the step itself was awaited while it was handed to MLX
    assert issued == 3


def test_a_step_that_fails_while_queued_lets_its_queued_part_run_out_first() -> None:
    """When MLX raises a stream failure in the middle of handing a step over, the part already
    queued still runs (and its fault nodes may fail too): ``_run_out`` returns only once the
    stream has run everything queued on it, failures included, and the stream goes on."""
    import asyncside._native.testing as native_testing
    from asyncside.models.queued import _run_out

    cpu = mx.default_stream(mx.cpu)

    async def main() -> None:
        gate = native_testing.StreamGate(timeout_s=20.0)
        with mx.stream(cpu):
            held = gate.hold(mx.zeros((4,)))
            failing = native_testing.fail_on_stream(held + 1, "a fault behind the gate")
            after = failing * 2 + 1  # queued behind the failure: it still runs
        mx.async_eval(after)
        done = anyio.Event()

        async def run_out() -> None:
            await _run_out(cpu)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_out)
            for _ in range(20):
                await anyio.sleep(0.001)
            assert not done.is_set()  # the gate holds the queued work: not run out yet
            gate.open()
        assert done.is_set()
        with mx.stream(cpu):
            y = mx.ones((4,)) + 1
            await completed(y)  # the stream goes on
        assert y.tolist() == [2.0] * 4

    anyio.run(main)


def test_a_failed_fault_fails_the_step_and_frees_its_row(tmp_path: pathlib.Path, read_threads: int) -> None:
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)  # prefill, per layer (too many experts)
            # Every record now lies past the end of the blobs (same files, so the runtime's open
            # descriptors see it): the next fault fails on the stream.
            saved = {}
            for layer in sm.moe_layers:
                path = sm.store.layer(layer).path
                saved[path] = path.read_bytes()
                os.truncate(path, 0)
            try:
                with pytest.raises((FillError, ExceptionGroup)) as info:
                    for tok in range(sm.config["vocab_size"]):  # until a step routes to an absent expert
                        await sm(mx.array([[tok]]), cache, source=rt)
                errors = info.value.exceptions if isinstance(info.value, ExceptionGroup) else [info.value]
                assert all(isinstance(e, FillError) for e in errors), errors
                assert all("fault in a queued step" in str(e) for e in errors), errors
                assert all(e.errno == errno.ENODATA for e in errors), [e.errno for e in errors]
            finally:
                for path, data in saved.items():
                    with open(path, "r+b") as fh:  # noqa: ASYNC230 - the test damages its own store
                        fh.write(data)
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
            assert rt.stats()["failed_fills"] > 0
            failed = sum(rt.ledger(layer).stats["fault_failures"] for layer in sm.moe_layers)
            assert failed == rt.stats()["failed_fills"]
            for layer in sm.moe_layers:  # nothing stays lent, failed rows are FREE again
                assert rt.ledger(layer).lent_rows() == []
            # The runtime carries on: the blobs are whole again, the next generation is exact.
            assert [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)] == ref

    anyio.run(main)


def test_failed_faults_leave_mlx_count_of_tasks_as_it_was(tmp_path: pathlib.Path) -> None:
    """A fault that fails is reported through the fault log, never thrown on MLX's stream thread.
    MLX stores a failure thrown there and raises it at the next call that queues work on the
    stream; when that call is one of the dispatches that count a task, the count goes up and the
    task that would bring it down is never queued. Each such leak moves MLX's throttle (and ours,
    which reads the count) one step closer to waiting forever. Many failed steps, one process: the
    count comes back to where it was."""
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)
    cpu = mx.default_stream(mx.cpu)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)
            mx.synchronize(cpu)
            base = _native.mlx_active_tasks()
            saved = {sm.store.layer(layer).path: sm.store.layer(layer).path.read_bytes() for layer in sm.moe_layers}
            failures = 0
            for round_ in range(12):
                for path in saved:
                    os.truncate(path, 0)
                try:
                    with pytest.raises((FillError, ExceptionGroup)):
                        for tok in range(sm.config["vocab_size"]):
                            await sm(mx.array([[(tok + round_) % sm.config["vocab_size"]]]), cache, source=rt)
                    failures += 1
                    mx.synchronize(cpu)  # MLX keeps no failure of ours for a later call to raise
                finally:
                    for path, data in saved.items():
                        with open(path, "r+b") as fh:  # noqa: ASYNC230 - the test damages its own store
                            fh.write(data)
                await rt.quiesce()
                # Work the main thread queues right after a failure: a few MLX ops of any size.
                for j in range(round_ % 11 + 1):
                    mx.eval(mx.ones((4,)) + j)
            mx.synchronize(cpu)
            assert failures == 12
            assert _native.mlx_active_tasks() == base
            # A node that fails as a whole reaches the awaiter the same way, with its message.
            layer = sm.moe_layers[0]
            faults = rt._s.layers[layer].faults
            _native.testing.fail_next_fault_node(faults, "no memory")
            mx.eval(_native.expert_rows(mx.array([0], dtype=mx.uint32), faults, cpu))
            with pytest.raises(FillError, match=f"layer {layer}: a fault node failed: no memory"):
                rt.after_step()
            assert rt.audit()[layer].ok

    anyio.run(main)


def test_an_ensure_while_a_step_is_being_scheduled_waits_for_that_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scheduling a step awaits between pieces of its graph. Another task's ensure() there (a
    serving engine's per-layer path, a close) takes the lent rows back only after that step: before
    the fix it reclaimed them under the step, whose faults then found no lent row."""
    from asyncside.models import queued as queued_mod

    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    real_schedule = queued_mod.QueuedSteps._schedule
    scheduling = anyio.Event()

    async def slow_schedule(self: object, out: mx.array, *layers: Any) -> None:
        scheduling.set()
        await anyio.sleep(0.05)  # the other task runs here, while nothing of this step is queued
        await real_schedule(self, out, *layers)

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0, min_side_rows=2 * k) as rt:
            tokens: list[int] = []

            async def generate() -> None:
                async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                    tokens.append(t)
                    if len(tokens) == 2:  # decoding queued steps now: slow the next one down
                        monkeypatch.setattr(queued_mod.QueuedSteps, "_schedule", slow_schedule)

            async def intrude() -> None:
                await scheduling.wait()
                layer = sm.moe_layers[0]
                await rt.ensure(layer, [0, 1])  # quiesces: must wait for the step being scheduled

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                tg.start_soon(intrude)
            assert tokens == ref
            assert rt.stats()["failed_fills"] == 0
            await rt.quiesce()
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}

    anyio.run(main)


def test_a_step_mlx_refuses_to_schedule_fails_its_awaiter_and_the_runtime_still_closes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLX's encoder may raise while a queued step is handed to it (on a GPU inside async_eval: a
    kernel node it cannot add). The step's awaiter must get that error, and quiesce() (the runtime
    closing) must not wait for a step that was never scheduled: it looped forever, and on the H200
    the whole test hung. Simulated here: the step's hand-off raises, and so does the runtime's own
    completion of it, as MLX's encoder would a second time."""
    from asyncside.models import queued as queued_mod

    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    real_schedule = queued_mod.QueuedSteps._schedule
    refused: list[mx.array] = []

    async def refusing_schedule(self: object, out: mx.array, *layers: Any) -> None:
        refused.append(out)
        await anyio.lowlevel.checkpoint()
        raise RuntimeError("cudaGraphAddKernelNode: invalid device function (simulated)")

    async def runtime_completed(x: mx.array) -> None:
        if any(x is r for r in refused):
            await anyio.lowlevel.checkpoint()
            raise RuntimeError("cudaGraphAddKernelNode: invalid device function (simulated)")
        await completed(x)

    async def main() -> None:
        with anyio.fail_after(30):
            async with Runtime(sm.store, resident=0.0, min_side_rows=2 * k, completed=runtime_completed) as rt:
                tokens: list[int] = []
                with pytest.raises(RuntimeError, match="invalid device function"):
                    async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt):
                        tokens.append(t)
                        if len(tokens) == 2:  # decoding queued steps: MLX refuses the next one
                            monkeypatch.setattr(queued_mod.QueuedSteps, "_schedule", refusing_schedule)
                assert refused and tokens == ref[:2]
                await rt.quiesce()  # returns: the refused step is not waited for
                assert not rt.queued_active
                reports = rt.audit()
                assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}
                # The runtime still serves: the next generation is exact.
                monkeypatch.setattr(queued_mod.QueuedSteps, "_schedule", real_schedule)
                again = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
                assert again == ref

    anyio.run(main)


def test_an_ensure_while_a_long_step_is_being_built_waits_for_that_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's queued step is built layer by layer with a checkpoint between layers (it
    is thousands of graph nodes). Another task's ensure() there must not take the lent rows back
    before the step is built and has run: the step's later layers would fault into rows no longer
    lent. Then a build that fails gives its hold up (abandon_step): a quiesce after it returns."""
    from asyncside.models import queued as queued_mod

    store_dir, model, _prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, model.args.vocab_size, 40)]
    ref_cache = make_prompt_cache(model)
    ref = model(mx.array(prompt)[None], cache=ref_cache)
    mx.eval(ref)
    real = queued_mod.between_layers
    building = anyio.Event()
    intruded: list[str] = []

    async def slow_between_layers() -> None:
        building.set()
        await anyio.sleep(0.02)  # the other task's ensure runs here, mid-build
        await real()

    async def main() -> None:
        async with Runtime(sm.store, resident=0.0, min_side_rows=2 * k) as rt:
            logits: list[mx.array] = []

            async def step() -> None:
                logits.append(await sm(mx.array(prompt)[None], sm.make_cache(), source=rt))

            async def intrude() -> None:
                await building.wait()
                await rt.ensure(sm.moe_layers[-1], [0, 1])  # quiesces: waits until the step is built and done
                intruded.append("ensured")

            monkeypatch.setattr(queued_mod, "between_layers", slow_between_layers)
            async with anyio.create_task_group() as tg:
                tg.start_soon(step)
                tg.start_soon(intrude)
            assert intruded == ["ensured"]
            assert mx.array_equal(logits[0], ref).item()
            assert rt.stats()["failed_fills"] == 0
            c = sm.forward_with(QUEUED).counters
            assert c["expert_slices"] + c["sorted_parts"] + c["staged_switches"] > 0  # a long queued step, in slices or staged

            async def broken_between_layers() -> None:
                raise RuntimeError("build failed")

            monkeypatch.setattr(queued_mod, "between_layers", broken_between_layers)
            with pytest.raises(RuntimeError, match="build failed"):
                await sm(mx.array(prompt)[None], sm.make_cache(), source=rt)
            with anyio.fail_after(5):
                await rt.quiesce()  # the failed build let go of its hold
            reports = rt.audit()
            assert all(r.ok for r in reports.values()), {l: r.problems for l, r in reports.items()}

    anyio.run(main)


def test_fault_table_reads_records_into_lent_rows(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path)
    table.lend([3, 1, 0, 2])
    # Strided ids of several dtypes (an argpartition's first k is a strided view).
    ids = mx.array([[9, 4, 9, 12]], dtype=mx.int32)[:, ::2]
    rows = _native.expert_rows(ids, table, CPU) + 0
    assert np.array(rows).tolist() == [[3, 3]]  # one fault, into the first free lent row
    rows = _native.expert_rows(mx.array([4, 12, 9], dtype=mx.uint64), table, CPU) + 0
    assert np.array(rows).tolist() == [1, 0, 3]
    for e in (4, 9, 12):
        r = int(np.array(table.table())[e])
        for key, want in store.read_expert(0, e).items():
            assert bytes(pools.row_view(key, r)) == bytes(memoryview(want).cast("B")), (e, key)
    ev = drain_events(table)
    assert ev[:, [0, 1, 2, 4]].tolist() == [[3, -1, 9, 0], [1, -1, 4, 0], [0, -1, 12, 0]]
    assert ev[:, 5].tolist() == [0, 0, 0]  # every one read from the store (host pools have no tier)
    assert table.lent() == [2, 3, 1, 0]  # filled rows stay lent, at the back
    # More distinct experts in one step than rows: the last one has nowhere to go (every row holds
    # an expert this very step routes), so the step fails: logged as no lent row left (-2).
    bad = _native.expert_rows(mx.array([5, 6, 7, 8, 10], dtype=mx.uint32), table, CPU)
    assert eval_failed_step(bad)[4] == 0
    ev = drain_events(table)
    assert sorted(ev[:, 4].tolist()) == [-2, 0, 0, 0, 0]
    assert ev[ev[:, 4] == -2][:, [0, 2]].tolist() == [[-1, 10]]
    counters = table.counters()
    assert counters["faults"] == 7 and counters["fault_errors"] == 1 and counters["tier_faults"] == 0


def test_no_expert_ids_map_to_row_zero_without_a_fault_or_a_use(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path)
    table.lend([3, 1])
    before = table.counters()
    from asyncside.models.queued import NO_EXPERT

    ids = mx.array([NO_EXPERT, 7, NO_EXPERT, 7], dtype=mx.uint32)
    rows = _native.expert_rows(ids, table, CPU) + 0
    assert np.array(rows).tolist() == [0, 3, 0, 3]
    counters = table.counters()
    assert counters["faults"] - before["faults"] == 1  # expert 7 only
    assert counters["pairs"] - before["pairs"] == 2
    drained = table.drain()
    assert np.frombuffer(drained[1], dtype=np.int32).tolist() == [7]  # the uses: expert 7, once
    # Only 2**32 - 1 means "no expert": any other id past the table still fails the step (logged
    # as an id outside the layer's experts, -3), and reads row 0.
    bad = _native.expert_rows(mx.array([NO_EXPERT - 1, 7], dtype=mx.uint32), table, CPU)
    assert eval_failed_step(bad) == [0, 3]
    assert drain_events(table)[:, [0, 2, 4]].tolist() == [[-1, NO_EXPERT - 1, -3]]
    assert table.counters()["fault_errors"] - before["fault_errors"] == 1


def test_a_fault_node_that_throws_fails_the_step_through_the_log(tmp_path: pathlib.Path) -> None:
    """Whatever a fault node's task throws (here a hook's; in life an allocation) is caught on the
    stream thread: the node's rows read row 0, the log says -4, the table keeps the message."""
    store, pools, table = fault_table(tmp_path)
    before = table.counters()
    table.lend([0, 1])
    _native.testing.fail_next_fault_node(table, "allocation failed (a test)")
    assert eval_failed_step(_native.expert_rows(mx.array([1, 2, 3], dtype=mx.uint32), table, CPU)) == [0, 0, 0]
    assert drain_events(table)[:, [0, 2, 4]].tolist() == [[-1, -1, -4]]
    assert table.failure.endswith("a fault node failed: allocation failed (a test)"), table.failure
    assert table.counters()["fault_errors"] - before["fault_errors"] == 1


def test_fault_table_refuses_bad_input(tmp_path: pathlib.Path) -> None:
    store, pools, table = fault_table(tmp_path)
    with pytest.raises(ValueError, match="outside"):
        table.lend([4])
    table.lend([0])
    with pytest.raises(ValueError, match="already lent"):
        table.lend([0])
    with pytest.raises(ValueError, match="rows still lent"):
        table.sync(np.full(16, -1, dtype=np.int32))
    assert table.reclaim() == [0]
    with pytest.raises(ValueError, match="expected 16 entries"):
        table.sync(np.full(3, -1, dtype=np.int32))
    twice = np.full(16, -1, dtype=np.int32)
    twice[[2, 5]] = 1
    with pytest.raises(ValueError, match="holds experts 2 and 5"):
        table.sync(twice)
    with pytest.raises(ValueError, match="integer"):
        _native.expert_rows(mx.array([1.0]), table, CPU)
    out_of_range = _native.expert_rows(mx.array([16], dtype=mx.uint32), table, CPU)
    assert eval_failed_step(out_of_range) == [0]
    assert drain_events(table)[:, [0, 2, 4]].tolist() == [[-1, 16, -3]]
    with pytest.raises(ValueError, match="expected 'lend', 'recency' or 'decayed'"):
        table.set_order("bogus")


def test_fault_victims_follow_the_policy_order(tmp_path: pathlib.Path) -> None:
    """Lent rows holding experts: the stream evicts by recency, by decayed frequency, or in lend
    order, and never an expert the same step routes."""
    # Expert 1 is used four times early, expert 2 once later, expert 0 last; the next step routes
    # a new expert 7 together with 0. LRU evicts 1 (used longest ago); decayed frequency with a
    # long half-life evicts 2 (its one use outweighed by 1's four); lend order takes the first
    # lent row not routed now (filled rows went to the back in fill order: 1's, 2's, 0's).
    for order, victim in (("recency", 1), ("decayed", 2), ("lend", 1)):
        store, pools, table = fault_table(tmp_path / order, rows=3)
        table.set_order(order, 8.0)
        table.lend([0, 1, 2])
        for ids in ([1], [1], [1], [1], [2], [0]):
            mx.eval(_native.expert_rows(mx.array(ids, dtype=mx.uint32), table, CPU) + 0)
        assert np.array(table.table())[[1, 2, 0]].tolist() == [0, 1, 2]
        table.drain()
        mx.eval(_native.expert_rows(mx.array([7, 0], dtype=mx.uint32), table, CPU) + 0)
        ev = drain_events(table)
        assert ev.shape[0] == 1 and ev[0, 2] == 7 and ev[0, 1] == victim, (order, ev)


def _chain(n: int, start: mx.array | None = None) -> tuple[mx.array, np.ndarray]:
    """A lazy graph of ``2 n`` small nodes (as a decode step has many) and what it computes
    (``start``: an array equal to ``arange(16)`` to begin with)."""
    y = mx.array(np.arange(16, dtype=np.float32)) if start is None else start
    want = np.arange(16, dtype=np.float64)
    for i in range(n):
        y = y * 1.0001 + (i % 3)
        want = want * np.float32(1.0001) + (i % 3)
    return y, want


def test_step_plan_schedules_a_graph_in_chunks_without_blocking() -> None:
    """A plan hands a long graph to MLX in chunks (each under its eval throttle): every node ends
    up scheduled, the result is what one eval computes, and nothing is scheduled twice."""
    y, want = _chain(600)
    plan = _native.StepPlan([y])
    assert plan.size >= 1200
    waits = 0
    while True:
        done, wait_on = plan.advance()
        if done:
            break
        waits += 1
        mx.eval(wait_on)  # what the forward awaits through the bridge
    assert plan.chunks >= 1 and waits == plan.chunks - 1
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4)
    assert _native.StepPlan([y]).size == 0  # already scheduled: nothing left to plan


def test_step_plan_with_a_time_slice_hands_the_graph_over_in_small_groups() -> None:
    """With ``slice_ns`` a call returns once its slice is spent, after a small group of nodes: the
    loop thread is never away for a whole chunk's encoding. While the throttle has room it
    returns nothing to wait for ((False, None): let the loop run, call again); the result is
    what one eval computes."""
    with mx.stream(mx.cpu):  # the slice applies to CPU chunks (a GPU step goes in one eval)
        y, want = _chain(300)
    plan = _native.StepPlan([y])
    assert plan.size >= 600
    yields = waits = 0
    while True:
        before = plan.scheduled
        done, wait_on = plan.advance(slice_ns=1)  # spent after the first group of every call
        if done:
            break
        assert 2 <= plan.scheduled - before <= 10, (before, plan.scheduled)
        if wait_on is None:
            yields += 1  # the caller lets other work run
        else:
            waits += 1
            mx.eval(wait_on)
    assert yields > 0 and plan.chunks >= plan.size // 10
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4)


@pytest.mark.parametrize("slice_ns", [0, 1], ids=["whole", "sliced"])
def test_a_lent_step_plan_goes_past_mlx_throttle_without_waiting(slice_ns: int) -> None:
    """``lend=True``: the whole graph goes to MLX while the stream is held behind a gate (far more
    than MLX's throttle lets a caller queue: MLX would block this thread until the gate opened),
    never naming a node to wait for; MLX's count of task groups in flight is exact afterwards."""
    import asyncside._native.testing as native_testing

    mx.synchronize(mx.default_stream(mx.cpu))
    base = _native.mlx_active_tasks()  # (process-wide: another stream may hold some)
    gate = native_testing.StreamGate(timeout_s=20.0)  # (a regression fails here, not hangs)
    with mx.stream(mx.cpu):
        y, want = _chain(600, start=gate.hold(mx.array(np.arange(16, dtype=np.float32))))
        # (the stream stops at the gate, before any of the chain runs)
    plan = _native.StepPlan([y])
    calls = 0
    while True:
        done, wait_on = plan.advance(slice_ns=slice_ns, lend=True)
        calls += 1
        assert wait_on is None
        if done:
            break
    assert plan.scheduled == plan.size >= 1200
    assert (calls == 1) if slice_ns == 0 else (calls > 1)
    assert not gate.is_open  # nothing here waited for the stream
    assert _native.mlx_active_tasks() > base + 10  # past MLX's throttle
    gate.open()
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4)
    mx.synchronize(mx.default_stream(mx.cpu))
    assert _native.mlx_active_tasks() == base  # what was hidden from the count was given back


def test_a_finished_step_plan_lets_go_of_its_graph_off_the_callers_thread() -> None:
    """Once every node is scheduled the plan hands its references to the release thread (dropping
    a decode step's ~1,400 nodes took 1.3-2.7 ms of the loop thread): the intermediate buffers are
    freed while the plan object is still alive, and only the output stays."""
    mx.synchronize()
    _native.wait_for_graph_releases()
    base = mx.get_active_memory()
    with mx.stream(mx.cpu):  # a GPU step's plan drops its nodes on the caller
        y = mx.ones((256, 1024), dtype=mx.float32)  # 1 MiB per node
        for i in range(40):
            y = y * 1.5 + float(i)
    plan = _native.StepPlan([y])
    n = plan.size
    assert n >= 80
    while True:
        done, wait_on = plan.advance()
        if done:
            break
        mx.eval(wait_on)
    mx.eval(y)
    _native.wait_for_graph_releases()
    assert _native.pending_graph_releases() == 0
    held = mx.get_active_memory() - base
    assert held <= 4 * y.nbytes, (held, y.nbytes)  # not ~n MiB: the plan (alive) holds nothing now
    assert plan.size == n and plan.scheduled == n
    assert plan.advance() == (True, None)  # done stays done
    want = np.float32(1.0)
    for i in range(40):
        want = want * np.float32(1.5) + np.float32(i)
    assert float(y[0, 0].item()) == pytest.approx(float(want), rel=1e-5)


def test_a_process_exits_cleanly_with_step_graphs_still_to_release(tmp_path: pathlib.Path) -> None:
    """At exit (atexit) releases stop going to the release thread and one in progress finishes
    first: a process that finishes plans up to its last line exits with status 0."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import mlx.core as mx\n"
        "from asyncside import _native\n"
        "mx.set_default_device(mx.cpu)\n"
        "for k in range(20):\n"
        "    y = mx.ones((64, 1024))\n"
        "    for i in range(200):\n"
        "        y = y * 1.01 + i\n"
        "    plan = _native.StepPlan([y])\n"
        "    while True:\n"
        "        done, w = plan.advance()\n"
        "        if done:\n"
        "            break\n"
        "        mx.eval(w)\n"
        "print('ok', _native.pending_graph_releases() >= 0, flush=True)\n"
    )
    root = str(pathlib.Path(__file__).resolve().parents[1])  # the package, where it is not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok True"


def _device_layer(tmp_path: pathlib.Path, seed: int) -> tuple[ExpertStore, LayerSpec, PoolSet]:
    """A one-layer store of 16 random experts (two segments) and device pools of 4 rows for it."""
    rng = np.random.default_rng(seed)
    store = ExpertStore.create(tmp_path / "s", {0: {
        "w.weight": rng.integers(0, 2**32, size=(16, 64, 8), dtype=np.uint32),
        "w.scales": rng.standard_normal((16, 24)).astype(np.float16),
    }})
    spec = store.layer(0)
    return store, spec, PoolSet(spec, 4, device=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.device_faults_available() or mx.default_device() != mx.gpu,
                    reason="needs MLX CUDA and the CUDA fault path")
def test_device_fault_table_copies_records_to_device_rows(tmp_path: pathlib.Path) -> None:
    """CUDA: kernel, host node, kernel. Faulted records land in the device pools (read back
    through the host), hits keep their rows, and the routed ids may be strided and of any dtype."""
    store, spec, pools = _device_layer(tmp_path, seed=0)
    table = _native.FaultTable.for_device(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                                          pools.mirror, [s.offset for s in spec.segments],
                                          [s.nbytes for s in spec.segments], os.open(spec.path, os.O_RDONLY),
                                          str(spec.path), spec.stride)
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    table.lend([0, 1, 2, 3])
    ids = mx.array([[9, 4, 9, 12, 3, 1]], dtype=mx.int32)[:, ::2]  # 9, 9, 3
    rows = np.array(_native.expert_rows(ids, table) + 0).tolist()
    assert rows[0][0] == rows[0][1]
    rows2 = np.array(_native.expert_rows(mx.array([3, 12]), table) + 0).tolist()
    assert rows2[0] == rows[0][2]
    tab = np.array(table.table())
    for e in (9, 3, 12):
        for key, want in store.read_expert(0, e).items():
            assert pools.row_bytes(key, int(tab[e])) == bytes(memoryview(want).cast("B")), (e, key)
    assert table.counters()["faults"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not _native.device_faults_available() or mx.default_device() != mx.gpu,
                    reason="needs MLX CUDA and the CUDA fault path")
def test_device_fault_table_with_a_host_tier_reads_each_record_once(tmp_path: pathlib.Path) -> None:
    """CUDA, a host tier (one pinned row per expert): a record is read and verified once; a later
    fault of it is the device copy alone (event source 1, nothing read), with the same bytes in the
    pool row. A record whose checksum fails is not kept: its next fault reads it again."""
    store, spec, pools = _device_layer(tmp_path, seed=1)
    nbytes = [s.nbytes for s in spec.segments]
    tier = _native.HostMirror(spec.n_experts, nbytes)
    assert tier.pinned
    table = _native.FaultTable.for_device(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                                          pools.mirror, [s.offset for s in spec.segments], nbytes,
                                          os.open(spec.path, os.O_RDONLY), str(spec.path), spec.stride, tier=tier)
    table.set_checksums(spec.checksum, list(spec.checksums))
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    table.lend([0, 1, 2, 3])

    def run(ids: list[int]) -> np.ndarray:
        mx.eval(_native.expert_rows(mx.array(ids, dtype=mx.int32), table) + 0)
        return drain_events(table)

    def check_rows(experts: list[int]) -> None:
        tab = np.array(table.table())
        for e in experts:
            for key, want in store.read_expert(0, e).items():
                assert pools.row_bytes(key, int(tab[e])) == bytes(memoryview(want).cast("B")), (e, key)

    first = run([9, 4, 3, 12])
    assert first[:, 5].tolist() == [0, 0, 0, 0]  # read from the store into the tier
    check_rows([9, 4, 3, 12])
    second = run([5, 6, 7, 8])  # evicts all four (this step routes none of them)
    assert second[:, 5].tolist() == [0, 0, 0, 0] and sorted(second[:, 1].tolist()) == [3, 4, 9, 12]
    again = run([9, 4, 3, 12])  # evicted, faulted in again: from the tier, nothing read
    assert again[:, 5].tolist() == [1, 1, 1, 1] and again[:, 4].tolist() == [0, 0, 0, 0]
    check_rows([9, 4, 3, 12])
    c = table.counters()
    assert c["faults"] == 12 and c["tier_faults"] == 4 and c["bytes_read"] == 8 * spec.stride, c
    # A damaged record is not kept: every fault of it reads (and fails) until the file is whole.
    data = bytearray(spec.path.read_bytes())
    saved = bytes(data)
    data[spec.record_offset(13) + spec.segments[0].offset] ^= 0x40
    spec.path.write_bytes(data)
    for _ in range(2):
        # A host node cannot fail its graph: the failure is in the log (the Runtime raises it as
        # a FillError when it learns of the step).
        ev = run([13])
        assert ev[:, [2, 4, 5]].tolist() == [[13, -1, 0]]
    spec.path.write_bytes(saved)
    ok = run([13])
    assert ok[:, [2, 4, 5]].tolist() == [[13, 0, 0]]
    check_rows([13])
    c = table.counters()
    assert c["tier_faults"] == 4 and c["fault_errors"] == 2, c


@pytest.mark.gpu
@pytest.mark.skipif(not _native.device_faults_available() or mx.default_device() != mx.gpu,
                    reason="needs MLX CUDA and the CUDA fault path")
def test_device_fault_table_stages_routed_experts_without_touching_a_row(tmp_path: pathlib.Path) -> None:
    """CUDA, a host tier and staging arrays: a staged resolve copies every routed expert into its
    own row of the staging arrays (a hit from its pool row, a miss from the tier, read and verified
    into it first when absent), returns the ids as rows, and changes no pool row, lent row or
    table entry. A damaged record fails its staged resolve (an event of row -1) and is not kept."""
    store, spec, pools = _device_layer(tmp_path, seed=2)
    nbytes = [s.nbytes for s in spec.segments]
    tier = _native.HostMirror(spec.n_experts, nbytes)
    table = _native.FaultTable.for_device(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                                          pools.mirror, [s.offset for s in spec.segments], nbytes,
                                          os.open(spec.path, os.O_RDONLY), str(spec.path), spec.stride, tier=tier)
    table.set_checksums(spec.checksum, list(spec.checksums))
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    assert not table.can_stage
    with pytest.raises(ValueError, match="cannot stage"):
        _native.expert_rows(mx.array([1, 2]), table, staged=True)
    staging = [mx.zeros((spec.n_experts, *pools.arrays[s.key].shape[1:]), dtype=pools.arrays[s.key].dtype)
               for s in spec.segments]
    mx.eval(*staging)
    with pytest.raises(ValueError, match="staging"):
        table.set_staging(staging[:1])
    table.set_staging(staging)
    assert table.can_stage
    table.lend([0, 1, 2, 3])
    mx.eval(_native.expert_rows(mx.array([9, 4], dtype=mx.int32), table) + 0)  # two hits to come
    drain_events(table)
    before = (np.array(table.table()).tolist(), sorted(table.lent()))
    pool_bytes = {(k, r): pools.row_bytes(k, r) for k in pools.arrays for r in range(4)}

    def staged_bytes(e: int) -> dict[str, bytes]:
        return {s.key: np.array(a[e]).tobytes() for s, a in zip(spec.segments, staging)}

    def check(experts: list[int]) -> None:
        for e in experts:
            got = staged_bytes(e)
            for key, want in store.read_expert(0, e).items():
                assert got[key] == bytes(memoryview(want).cast("B")), (e, key)

    ids = mx.array([[9, 12, 4, 12], [5, 9, 0xFFFFFFFF, 15]], dtype=mx.uint32)
    rows = np.array(_native.expert_rows(ids, table, staged=True) + 0)
    assert rows.tolist() == [[9, 12, 4, 12], [5, 9, 0, 15]]
    ev = drain_events(table)
    # Misses only (12, 5, 15: read into the tier), no row; the hits 9 and 4 copied from their rows.
    assert sorted(ev[:, 2].tolist()) == [5, 12, 15] and set(ev[:, 0].tolist()) == {-1}
    assert ev[:, 4].tolist() == [0, 0, 0] and ev[:, 5].tolist() == [0, 0, 0]
    check([9, 12, 4, 5, 15])
    assert (np.array(table.table()).tolist(), sorted(table.lent())) == before
    assert {(k, r): pools.row_bytes(k, r) for k in pools.arrays for r in range(4)} == pool_bytes
    # Staged again: the misses come from the tier now (source 1), nothing read.
    c0 = table.counters()
    again = _events_after(table, lambda: mx.eval(_native.expert_rows(mx.array([12, 15]), table, staged=True) + 0))
    assert again[:, 5].tolist() == [1, 1] and again[:, 4].tolist() == [0, 0]
    c = table.counters()
    assert c["staged"] == c0["staged"] + 1 and c["staged_copies"] == 5 and c["bytes_read"] - c0["bytes_read"] == 0
    check([12, 15])
    # A damaged record: the staged resolve fails (logged, row -1) and the record is not kept.
    data = bytearray(spec.path.read_bytes())
    saved = bytes(data)
    data[spec.record_offset(7) + spec.segments[0].offset] ^= 0x40
    spec.path.write_bytes(data)
    bad = _events_after(table, lambda: mx.eval(_native.expert_rows(mx.array([7]), table, staged=True) + 0))
    assert bad[:, [0, 2, 4]].tolist() == [[-1, 7, -1]]
    spec.path.write_bytes(saved)
    ok = _events_after(table, lambda: mx.eval(_native.expert_rows(mx.array([7]), table, staged=True) + 0))
    assert ok[:, [0, 2, 4, 5]].tolist() == [[-1, 7, 0, 0]]
    check([7])


@pytest.mark.gpu
@pytest.mark.skipif(not _native.device_faults_available() or mx.default_device() != mx.gpu
                    or _native.device_fault_node_form() != "device",
                    reason="needs MLX CUDA, the CUDA fault path and its device lookup")
def test_device_lookup_resolves_hits_without_the_host(tmp_path: pathlib.Path) -> None:
    """CUDA, the default node form: a node whose experts all have rows resolves on the device (no
    request to the fault server), its uses reach the table's policy and log later in the order the
    device ran them (here: they decide the LRU victim of the next miss), and a full use ring sends
    one node to the server, which takes the ring and resolves it. Rows are right throughout."""
    store, spec, pools = _device_layer(tmp_path, seed=3)
    table = _native.FaultTable.for_device(0, spec.n_experts, [pools.arrays[s.key] for s in spec.segments],
                                          pools.mirror, [s.offset for s in spec.segments],
                                          [s.nbytes for s in spec.segments], os.open(spec.path, os.O_RDONLY),
                                          str(spec.path), spec.stride)
    table.set_order("recency")
    table.sync(np.full(spec.n_experts, -1, dtype=np.int32))
    table.lend([0, 1, 2, 3])

    def rows(ids: list[int]) -> list[int]:
        return np.array(_native.expert_rows(mx.array(ids, dtype=mx.int32), table) + 0).tolist()

    def check(ids: list[int], got: list[int]) -> None:
        tab = np.array(table.table())
        assert got == [int(tab[e]) for e in ids], (ids, got, tab)
        for e in set(ids):
            for key, want in store.read_expert(0, e).items():
                assert pools.row_bytes(key, int(tab[e])) == bytes(memoryview(want).cast("B")), (e, key)

    served = _native.fault_server_counters()["served"]
    check([1, 2, 3, 4], rows([1, 2, 3, 4]))  # four misses: one request
    assert _native.fault_server_counters()["served"] == served + 1
    drain_events(table)
    got = rows([3, 1, 2, 3])  # all hit: resolved on the device
    assert _native.fault_server_counters()["served"] == served + 1
    check([3, 1, 2, 3], got)
    c = table.counters()
    assert (c["resolves"], c["device_resolves"], c["faults"], c["hits"], c["pairs"]) == (2, 1, 4, 3, 8), c
    raw = table.drain()
    assert np.frombuffer(raw[1], dtype=np.int32).tolist() == [1, 2, 3]  # a device resolve: ascending ids
    assert np.frombuffer(raw[2], dtype=np.int32).tolist() == [3]
    # Expert 4 was used longest ago (the device's hits on 1, 2, 3 came after): 5 evicts it.
    got = rows([5, 2])
    ev = drain_events(table)
    assert ev[:, [1, 2]].tolist() == [[4, 5]], ev
    check([5, 2], got)
    # More hit-only nodes than the ring holds (256), with no drain between: the 257th goes to the
    # server, which takes the ring; every node still gets its rows.
    served = _native.fault_server_counters()["served"]
    tab = np.array(table.table())  # reading the table takes the ring, so once, before
    for k in range(300):
        ids = [1, 2, 3, 5][k % 4: k % 4 + 2]
        assert rows(ids) == [int(tab[e]) for e in ids], k
    assert _native.fault_server_counters()["served"] == served + 1
    c = table.counters()
    assert (c["resolves"], c["device_resolves"], c["faults"]) == (303, 300, 5), c
    check([1, 2, 3, 5], rows([1, 2, 3, 5]))
    # Each node leaves the server once its command buffer has completed (MLX's completion thread).
    deadline = time.monotonic() + 5
    while _native.fault_server_counters()["registered"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _native.fault_server_counters()["registered"] == 0


def _events_after(table: object, run: Callable[[], object]) -> np.ndarray:
    run()
    return drain_events(table)


def test_host_fault_tables_do_not_stage(tmp_path: pathlib.Path) -> None:
    """Staging is for device pools with a host tier: a host table says it cannot, a staged node on
    it is refused with the reason, and a Runtime on host pools has no staging arrays."""
    store, pools, table = fault_table(tmp_path)
    assert not table.can_stage
    with pytest.raises(ValueError, match="cannot stage"):
        _native.expert_rows(mx.array([1]), table, CPU, staged=True)
    with pytest.raises(ValueError, match="device pools|CUDA"):
        table.set_staging([pools.arrays[k] for k in pools.arrays])


def test_a_faulted_record_with_a_flipped_byte_is_never_used(tmp_path: pathlib.Path, read_threads: int) -> None:
    """Faults verify the record's checksum before the step reads the row: a flipped byte fails the
    step with FillError (never a wrong token), and with verify=False the damage is served. (No host
    tier: a record kept there before the flip was verified and is served as it was read, which
    tests/test_queued.py::test_device_fault_table_with_a_host_tier_reads_each_record_once checks.)"""
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)

    async def main(verify: bool) -> list[BaseException]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k, verify=verify, host_tier=0) as rt:
            cache = sm.make_cache()
            await sm(mx.array(prompt)[None], cache, source=rt)
            saved = {}
            for layer in sm.moe_layers:  # one flipped byte in the first segment of every record
                spec = sm.store.layer(layer)
                data = bytearray(spec.path.read_bytes())
                saved[spec.path] = bytes(data)
                for e in range(spec.n_experts):
                    data[spec.record_offset(e) + spec.segments[0].offset] ^= 0x40
                with open(spec.path, "r+b") as fh:  # noqa: ASYNC230 - the test damages its own store
                    fh.write(data)
            errors: list[BaseException] = []
            try:
                for tok in range(sm.config["vocab_size"]):
                    await sm(mx.array([[tok]]), cache, source=rt)
            except (FillError, ExceptionGroup) as exc:
                errors = list(exc.exceptions) if isinstance(exc, ExceptionGroup) else [exc]
            finally:
                for path, data in saved.items():
                    with open(path, "r+b") as fh:  # noqa: ASYNC230 - the test damages its own store
                        fh.write(data)
            await rt.quiesce()
            assert all(r.ok for r in rt.audit().values())
            return errors

    errors = anyio.run(main, True)
    assert errors and all(isinstance(e, FillError) and "checksum" in str(e) for e in errors), errors
    assert anyio.run(main, False) == []  # unverified: the step runs on the damaged bytes


@pytest.mark.parametrize("quant", ["float", "q4"])
def test_queued_faults_past_the_page_cache_are_exact(tmp_path: pathlib.Path, quant: str, read_threads: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that reads past the page cache (a budget the store does not fit): faults read whole
    aligned records with O_DIRECT and copy the segments out (quantized records have gaps between
    segments), and a prompt chunk too large for the lent rows goes layer by layer; the tokens
    equal mlx-lm's with faults in every layer."""
    if quant == "q4" and mx.default_device() == mx.gpu:
        # The prompt's chunk goes layer by layer here, one evaluation per group of experts, and MLX
        # CUDA's own quantized prefill is wrong at these tiny widths (tests/test_models.py).
        pytest.skip("MLX CUDA: quantized prefill is wrong at one quantization group per row (tests/test_models.py)")
    monkeypatch.setenv("ASYNCSIDE_DIRECT", "1")  # what a budget smaller than the store decides
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", {"group_size": 64, "bits": 4} if quant == "q4" else None)
    ref = reference_generate(model, prompt, max_tokens=NEW_TOKENS)
    sm = load_streaming_model(store_dir, completed=completed, options=QUEUED)
    k = _top_k(sm)

    async def main() -> tuple[list[int], dict]:
        async with Runtime(sm.store, resident=0.0, min_side_rows=k) as rt:
            assert rt.memory["direct"] is True and rt.stats()["direct"] is True
            tokens = [t async for t in sm.generate(prompt, max_tokens=NEW_TOKENS, source=rt)]
            await rt.quiesce()
            assert all(r.ok for r in rt.audit().values())
            return tokens, dict(rt.stats())

    tokens, stats = anyio.run(main)
    assert tokens == ref
    assert stats["faults"] >= len(sm.store.layers)  # decode steps queued, every layer faulted
    # The prompt's chunk needs more rows than are lent: under such a plan it goes layer by layer
    # (its transient buffers are one layer's), not in queued slices. How many ensures that takes
    # depends on the rows a layer can lend, which differ between host and GPU pools (the chunk
    # stops before the last layer's block, so one layer may be all it serves).
    counters = sm.forward_with(QUEUED).counters
    assert counters["prefill"] >= 1 and counters["queued_prefill"] == 0 and stats["ensure_calls"] >= 1

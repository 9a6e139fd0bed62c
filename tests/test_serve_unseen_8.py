"""Serving on unseen inputs and faults (the serving round of the unseen-inputs reviews).

A failed read is raised by the runtime at the next queued forward the engine awaits, which need
not be the forward that read it: a prefill chunk queued behind a decode step may have its failed
read raised at the decode step's await. The request whose chunk computed on the failed record must
fail, never finish with tokens computed from it.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import numpy as np
import pytest
from _fault_helpers import model_store

from asyncside import _native
from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.models import load_streaming_model, reference_generate
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.routing import RoutingTrace
from asyncside.runtime import Runtime
from asyncside.serving import Batcher, GenerationFailed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOKENS = 64


def _trace(path: pathlib.Path, moe: int, n_experts: int, top_k: int, bad: int, bad_tokens: int) -> None:
    """Two sequences: the first never routes ``bad``, the second routes it (slot 0, every layer) at
    its first ``bad_tokens`` positions only."""
    rng = np.random.default_rng(3)

    def ids() -> np.ndarray:
        return np.stack([np.stack([rng.choice(n_experts - 1, top_k, replace=False) for _ in range(moe)])
                         for _ in range(TOKENS)]).astype(np.int32)

    second = ids()
    second[:bad_tokens, :, 0] = bad
    RoutingTrace(np.concatenate([ids(), second]), np.array([TOKENS, TOKENS]), n_experts, {}).save(path)


def _damage(spec: Any, expert: int) -> bytes:
    """Flip a byte of ``expert``'s record in its layer's blob (its checksum then fails); returns
    the blob as it was, to repair it with."""
    whole = spec.path.read_bytes()
    damaged = bytearray(whole)
    damaged[spec.record_offset(expert) + 64] ^= 0xFF
    spec.path.write_bytes(damaged)
    return whole


def _finish_after_a_failed_read(sm: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make the forward's next finish, once ``hold["armed"]`` is set, wait until a fault has
    failed (the interleaving the tests need, made certain); returns ``hold``."""
    fwd = sm.forward
    real_finish = fwd.finish
    hold: dict[str, Any] = {"armed": False, "base": _native.fault_errors_total()}

    async def finish(ctx: Any, y: Any) -> Any:
        if hold["armed"]:
            hold["armed"] = False
            with anyio.fail_after(300):  # a hang guard, never a timing assertion
                while _native.fault_errors_total() == hold["base"]:
                    await anyio.sleep(0.005)
        return await real_finish(ctx, y)

    monkeypatch.setattr(fwd, "finish", finish)
    return hold


def _arm_after_first_chunk(b: Any, hold: dict[str, Any], prompt: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Arm ``hold`` (:func:`_finish_after_a_failed_read`) once ``prompt``'s first chunk of 4 is queued."""
    real_prefill = b._prefill

    async def prefill(slot: Any, n: int) -> Any:
        chunk = await real_prefill(slot, n)
        hold["armed"] = hold["armed"] or (slot.prompt == prompt and len(slot.fed) == 4)
        return chunk

    monkeypatch.setattr(b, "_prefill", prefill)


def _chunk_fails(tmp_path: pathlib.Path) -> tuple[Any, Any, list[int], int, pathlib.Path, list[int], list[int]]:
    """The tiny model streamed, and a trace (at ``tmp_path/trace.npz``) whose prefilling request
    routes the bad expert (the first MoE layer's last) in its first chunk of 4 only: the streaming
    model, the reference model, the MoE layers, the bad expert, the trace's path, a decoding and a
    prefilling prompt."""
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed)
    moe = sm.moe_layers
    n_experts = sm.store.layer(moe[0]).n_experts
    path = tmp_path / "trace.npz"
    _trace(path, len(moe), n_experts, int(sm.config["num_experts_per_tok"]), n_experts - 1, bad_tokens=4)
    return sm, model, moe, n_experts - 1, path, prompt[:3], prompt[:12]


def test_a_chunk_whose_read_failed_fails_its_request_wherever_the_failure_is_raised(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Request A prefills in chunks of 4 and routes the bad expert in its first chunk only.
    sm, model, moe, bad, path, decoding, prefilling = _chunk_fails(tmp_path)
    replay = sm.set_routing(path, sequence=0)  # the third request submitted replays it (2 mod 2)
    sm.set_routing(None)
    force_reference(model, sm.arch.block_attr, replay)
    try:
        want = reference_generate(model, prefilling, max_tokens=4)
    finally:
        rewind_reference(model)
    replay = sm.set_routing(path)
    sm.set_routing(None)

    spec = sm.store.layer(moe[0])
    whole = _damage(spec, bad)

    # The interleaving the test needs, made certain: the decode step in flight is awaited only once
    # the chunk queued behind it has failed its read, so the failure is raised at the decode step.
    hold = _finish_after_a_failed_read(sm, monkeypatch)

    async def main() -> tuple[dict[str, list[Any]], list[int], list[str]]:
        async with Runtime(sm.store, resident=0.0) as rt:
            b = Batcher(sm, rt, prompt_cache_size=0, prefill_chunk=4, predictor="none", routing=replay)
            _arm_after_first_chunk(b, hold, prefilling, monkeypatch)
            got: dict[str, list[Any]] = {"decoding": [], "prefilling": []}

            async def read(name: str, gen: Any) -> None:
                try:
                    async for ev in gen:
                        got[name].append(ev.token)
                except GenerationFailed as exc:
                    got[name].append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)
                async with anyio.create_task_group() as readers:
                    readers.start_soon(read, "decoding", b.submit(decoding, 12))
                    with anyio.fail_after(300):
                        while len(got["decoding"]) < 2:
                            await anyio.sleep(0.001)
                    readers.start_soon(read, "prefilling", b.submit(prefilling, 4))
                spec.path.write_bytes(whole)  # repaired: the next request is served exactly
                await rt.quiesce()
                again = [ev.token async for ev in b.submit(prefilling, 4)]
                tg.cancel_scope.cancel()
            await rt.quiesce()
        return got, again, audit_problems(rt)

    got, again, problems = anyio.run(main)
    assert problems == []
    failed = got["prefilling"][-1]
    assert isinstance(failed, GenerationFailed), got["prefilling"]
    assert f"layer {moe[0]} expert {bad}: checksum mismatch" in str(failed)
    assert again == want


def test_a_chunk_s_failed_read_raised_at_a_cancelled_request_s_step_fails_the_chunk_s_request(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but every request of the decode step in flight was cancelled (left before the
    step was awaited): the chunk's failure raised at that step's await fails no request there, and
    must still count as a failed read raised while the chunk was queued, failing its request."""
    sm, model, moe, bad, path, decoding, prefilling = _chunk_fails(tmp_path)
    replay = sm.set_routing(path)
    sm.set_routing(None)
    spec = sm.store.layer(moe[0])
    _damage(spec, bad)

    hold = _finish_after_a_failed_read(sm, monkeypatch)

    async def main() -> list[Any]:
        async with Runtime(sm.store, resident=0.0) as rt:
            b = Batcher(sm, rt, prompt_cache_size=0, prefill_chunk=4, predictor="none", routing=replay)
            real_prefill, real_raise = b._prefill, rt.queued._raise_errors

            def raise_errors() -> None:
                # Not while the chunk is queued (on the CPU its scheduling may wait for the stream
                # and raise its own failure there): held for the decode step's await, certainly.
                if not hold.get("quiet"):
                    real_raise()

            monkeypatch.setattr(rt.queued, "_raise_errors", raise_errors)

            async def prefill(slot: Any, n: int) -> Any:
                hold["quiet"] = slot.prompt == prefilling and not slot.fed
                try:
                    chunk = await real_prefill(slot, n)
                finally:
                    hold["quiet"] = False
                hold["armed"] = hold["armed"] or (slot.prompt == prefilling and len(slot.fed) == 4)
                return chunk

            monkeypatch.setattr(b, "_prefill", prefill)
            got: list[Any] = []
            seen: list[int] = []

            async def read(gen: Any, into: list[Any]) -> None:
                try:
                    async for ev in gen:
                        into.append(ev.token)
                except (GenerationFailed, anyio.ClosedResourceError) as exc:  # closed: the cancelled one
                    into.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)
                first = b.submit(decoding, 40)
                async with anyio.create_task_group() as readers:
                    readers.start_soon(read, first, seen)
                    with anyio.fail_after(300):
                        while len(seen) < 2:
                            await anyio.sleep(0.001)
                    async with b.paused():  # between two steps: the first request's step is in flight
                        assert b._inflight is not None and b._inflight.batch[0].prompt == decoding
                        first.cancel()
                        readers.start_soon(read, b.submit(prefilling, 4), got)
                tg.cancel_scope.cancel()
            await rt.quiesce()
        return got

    got = anyio.run(main)
    assert got and isinstance(got[-1], GenerationFailed), got
    assert f"layer {moe[0]} expert {bad}: checksum mismatch" in str(got[-1])

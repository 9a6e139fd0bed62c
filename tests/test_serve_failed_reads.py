"""Serving: a failed read fails only the requests whose forward read it.

A queued forward's failed read carries its step (``FillError.step``) and the engine places it
(``asyncside.serving.read_failures``): a decoding request whose own step was clean keeps its tokens
when a prefill chunk queued in the same engine step read a damaged record, and a prefilling request
whose chunk was clean keeps going when the decode step in flight read one. The request that read
it still fails with it, and a second failed read of a step abandoned behind a failed one reaches
the health registry instead of being swallowed.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import numpy as np
import pytest
from _fault_helpers import model_store
from test_serve_unseen_8 import TOKENS, _arm_after_first_chunk, _damage, _finish_after_a_failed_read, _trace

from asyncside.audit import audit_problems
from asyncside.bridge import completed
from asyncside.errors import FillError
from asyncside.models import load_streaming_model, reference_generate
from asyncside.models.forcing import force_reference, rewind_reference
from asyncside.routing import RoutingTrace
from asyncside.runtime import Runtime
from asyncside.serving import Batcher, GenerationFailed
from asyncside.serving.health import fill_errors

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _setup(tmp_path: pathlib.Path) -> tuple[Any, Any, list[int], int, int]:
    store_dir, model, prompt = model_store(tmp_path, "qwen3_moe", None)
    sm = load_streaming_model(store_dir, completed=completed)
    moe = sm.moe_layers
    return sm, model, prompt, moe[0], sm.store.layer(moe[0]).n_experts - 1


def _reference(sm: Any, model: Any, path: pathlib.Path, sequence: int, prompt: list[int], n: int) -> list[int]:
    """The tokens ``prompt`` generates alone replaying ``sequence`` of the trace at ``path``."""
    replay = sm.set_routing(path, sequence=sequence)
    sm.set_routing(None)
    force_reference(model, sm.arch.block_attr, replay)
    try:
        return list(reference_generate(model, prompt, max_tokens=n))
    finally:
        rewind_reference(model)


async def _read(gen: Any, into: list[Any]) -> None:
    try:
        async for ev in gen:
            into.append(ev.token)
    except GenerationFailed as exc:
        into.append(exc)


def test_a_clean_decoding_request_keeps_its_tokens_when_a_chunk_beside_it_read_a_damaged_record(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk's failed read is in the log when the decode step in flight is awaited (made
    certain): that step read nothing damaged, so its request goes on; the chunk's request fails."""
    sm, model, prompt, layer, bad = _setup(tmp_path)
    path = tmp_path / "trace.npz"
    _trace(path, len(sm.moe_layers), sm.store.layer(layer).n_experts, int(sm.config["num_experts_per_tok"]), bad,
           bad_tokens=4)
    decoding, prefilling = prompt[:3], prompt[:12]
    want = _reference(sm, model, path, 0, decoding, 12)  # the first request replays sequence 0
    replay = sm.set_routing(path)
    sm.set_routing(None)
    spec = sm.store.layer(layer)
    _damage(spec, bad)
    hold = _finish_after_a_failed_read(sm, monkeypatch)

    async def main() -> tuple[dict[str, list[Any]], list[str]]:
        async with Runtime(sm.store, resident=0.0) as rt:
            b = Batcher(sm, rt, prompt_cache_size=0, prefill_chunk=4, predictor="none", routing=replay)
            _arm_after_first_chunk(b, hold, prefilling, monkeypatch)
            got: dict[str, list[Any]] = {"decoding": [], "prefilling": []}
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)
                async with anyio.create_task_group() as readers:
                    readers.start_soon(_read, b.submit(decoding, 12), got["decoding"])
                    with anyio.fail_after(300):  # a hang guard, never a timing assertion
                        while len(got["decoding"]) < 2:
                            await anyio.sleep(0.001)
                    readers.start_soon(_read, b.submit(prefilling, 4), got["prefilling"])  # replays sequence 1
                async with b.paused():  # the engine step that failed it is over (its abandoned step awaited)
                    tg.cancel_scope.cancel()
            await rt.quiesce()
        return got, audit_problems(rt)

    got, problems = anyio.run(main)
    assert problems == []
    assert not hold["armed"], "the chunk was never queued behind a decode step"
    assert got["decoding"] == want
    failed = got["prefilling"][-1]
    assert isinstance(failed, GenerationFailed), got["prefilling"]
    assert f"layer {layer} expert {bad}: checksum mismatch" in str(failed)


def _decode_fails_trace(path: pathlib.Path, sm: Any, layer_count: int, bad: int, decode_from: int,
                        decode_to: int = TOKENS) -> None:
    """Two sequences: the first routes ``bad`` (slot 0, every layer) at positions ``decode_from``
    up to ``decode_to`` (its decode steps), the second never."""
    rng = np.random.default_rng(4)
    k, n_experts = int(sm.config["num_experts_per_tok"]), sm.store.layer(sm.moe_layers[0]).n_experts

    def ids() -> np.ndarray:
        return np.stack([np.stack([rng.choice(n_experts - 1, k, replace=False) for _ in range(layer_count)])
                         for _ in range(TOKENS)]).astype(np.int32)

    first = ids()
    first[decode_from:decode_to, :, 0] = bad
    RoutingTrace(np.concatenate([first, ids()]), np.array([TOKENS, TOKENS]), n_experts, {}).save(path)


async def _serve_pair(sm: Any, rt: Runtime, replay: Any, requests: dict[str, tuple[list[int], int]]) -> tuple[
        dict[str, list[Any]], Batcher]:
    """Serve two requests admitted by one engine step (``name: (prompt, max_tokens)``; the first
    replays sequence 0 of ``replay``, the second sequence 1) until both ended; what each received."""
    b = Batcher(sm, rt, prompt_cache_size=0, prefill_chunk=4, predictor="none", routing=replay)
    got: dict[str, list[Any]] = {name: [] for name in requests}
    async with anyio.create_task_group() as tg:
        async with b.paused():  # both admitted by the same engine step
            tg.start_soon(b.run)
            gens = [b.submit(prompt, n) for prompt, n in requests.values()]
        async with anyio.create_task_group() as readers:
            for gen, name in zip(gens, requests):
                readers.start_soon(_read, gen, got[name])
        async with b.paused():  # the engine step that failed it is over (its abandoned step awaited)
            tg.cancel_scope.cancel()
    return got, b


def test_a_clean_chunk_goes_on_when_the_decode_step_in_flight_read_a_damaged_record(tmp_path: pathlib.Path) -> None:
    """Both requests come at once: the first engine step prefills the short prompt and launches
    its first decode step, which reads the damaged record; the next queues the long prompt's
    first chunk behind it. The decode step's failure is its own: the chunk's request is served
    exactly."""
    sm, model, prompt, layer, bad = _setup(tmp_path)
    path = tmp_path / "trace.npz"
    decoding, prefilling = prompt[:3], prompt[:12]
    _decode_fails_trace(path, sm, len(sm.moe_layers), bad, decode_from=len(decoding) - 1)
    want = _reference(sm, model, path, 1, prefilling, 4)  # the second request replays sequence 1
    replay = sm.set_routing(path)
    sm.set_routing(None)
    _damage(sm.store.layer(layer), bad)

    async def main() -> tuple[dict[str, list[Any]], list[str]]:
        async with Runtime(sm.store, resident=0.0) as rt:
            got, _b = await _serve_pair(sm, rt, replay, {"decoding": (decoding, 8), "prefilling": (prefilling, 4)})
            await rt.quiesce()
        return got, audit_problems(rt)

    got, problems = anyio.run(main)
    assert problems == []
    assert got["decoding"] and isinstance(got["decoding"][-1], GenerationFailed), got["decoding"]
    assert f"layer {layer} expert {bad}: checksum mismatch" in str(got["decoding"][-1])
    assert got["prefilling"] == want


def test_a_second_failed_read_of_a_step_abandoned_behind_a_failed_one_reaches_the_health_registry(
        tmp_path: pathlib.Path) -> None:
    """The decode step launched ahead on a failed step's tokens reads the damaged record again
    (the first failure freed its row): its own failure used to be swallowed where the engine waits
    for it; the request fails with the first, and the registry hears of both."""
    sm, _model, prompt, layer, bad = _setup(tmp_path)
    path = tmp_path / "trace.npz"
    decoding = prompt[:3]
    _decode_fails_trace(path, sm, len(sm.moe_layers), bad, decode_from=len(decoding) - 1)
    replay = sm.set_routing(path)
    sm.set_routing(None)
    _damage(sm.store.layer(layer), bad)

    async def main() -> tuple[list[Any], list[BaseException], int]:
        async with Runtime(sm.store, resident=0.0) as rt:
            b = Batcher(sm, rt, prompt_cache_size=0, prefill_chunk=4, predictor="none", routing=replay)
            recorded: list[BaseException] = []
            b.on_failure = recorded.append
            got: list[Any] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)
                await _read(b.submit(decoding, 8), got)
                async with b.paused():  # the engine step that failed it is over (its abandoned step awaited)
                    tg.cancel_scope.cancel()
            await rt.quiesce()
            return got, recorded, b.steps_ahead

    got, recorded, ahead = anyio.run(main)
    assert ahead >= 1, "no decode step was launched ahead of the failed one"
    assert got and isinstance(got[-1], GenerationFailed), got
    reads: list[FillError] = [e for exc in recorded for e in fill_errors(exc)]
    assert len(reads) == 2 and {e.expert for e in reads} == {bad}, recorded
    assert reads[0].step is not None and reads[1].step is not None and reads[0].step < reads[1].step


def test_a_prompt_completed_beside_a_failing_decode_step_keeps_the_token_of_the_step_it_joined(
        tmp_path: pathlib.Path) -> None:
    """The second request's only chunk is queued behind the first request's failing decode step;
    the decode step launched ahead on that step's tokens holds both. It is abandoned with the
    failed one, but read nothing damaged itself: the request that joined it with its own token
    keeps that token and its cache, and is served exactly."""
    sm, model, prompt, layer, bad = _setup(tmp_path)
    path = tmp_path / "trace.npz"
    decoding, joining = prompt[:3], prompt[:5]
    first_decode = len(decoding) - 1
    _decode_fails_trace(path, sm, len(sm.moe_layers), bad, decode_from=first_decode, decode_to=first_decode + 1)
    want = _reference(sm, model, path, 1, joining, 6)  # the second request replays sequence 1
    replay = sm.set_routing(path)
    sm.set_routing(None)
    _damage(sm.store.layer(layer), bad)

    async def main() -> tuple[dict[str, list[Any]], list[str], int]:
        async with Runtime(sm.store, resident=0.0) as rt:
            got, b = await _serve_pair(sm, rt, replay, {"decoding": (decoding, 8), "joining": (joining, 6)})
            await rt.quiesce()
        return got, audit_problems(rt), b.steps_ahead

    got, problems, ahead = anyio.run(main)
    assert problems == []
    assert ahead >= 1
    assert got["decoding"] and isinstance(got["decoding"][-1], GenerationFailed), got["decoding"]
    assert got["joining"] == want

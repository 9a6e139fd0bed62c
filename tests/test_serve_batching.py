"""The engine on the real embedded model and Runtime: exact against mlx-lm, seeded sampling
reproducible inside a batch, prefix-cache reuse.

No HTTP here: requests go straight to a :class:`~asyncside.serving.Batcher` over a Runtime that keeps
half of each layer's experts (the rest are streamed while the batch decodes).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import mlx.core as mx
import pytest

from asyncside.audit import audit_problems
from asyncside.models import ForwardOptions, load_reference_model, load_streaming_model, reference_generate
from asyncside.runtime import Runtime
from asyncside.serving import Batcher, embedded_store_dir
from asyncside.serving.protocol import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 32
LONG = ("Mixture-of-Experts models route every token to a few experts out of many; "
        "the rest of the weights wait on the disk until a token asks for them. ")


@pytest.fixture(scope="module")
def store_dir() -> str:
    return embedded_store_dir()


@pytest.fixture(scope="module")
def sm(store_dir: str) -> Any:
    return load_streaming_model(store_dir)


@pytest.fixture(scope="module")
def ref(store_dir: str) -> Any:
    return load_reference_model(store_dir)[0]


@contextlib.asynccontextmanager
async def half_resident(sm: Any) -> AsyncIterator[Runtime]:
    """A Runtime keeping half of each layer's experts; its ledgers must audit clean after."""
    async with Runtime(sm.store, resident=0.5) as rt:
        yield rt
    assert audit_problems(rt) == []


async def run_all(b: Batcher, requests: list[tuple[list[int], int, SamplingParams | None]]
                  ) -> tuple[list[list[int]], list[Any]]:
    """Submit every request at once, collect each one's tokens (EOS excluded)."""
    out: list[list[int]] = [[] for _ in requests]
    gens = [b.submit(p, n, s) for p, n, s in requests]

    async def read(i: int) -> None:
        async for ev in gens[i]:
            if not ev.eos:
                out[i].append(ev.token)

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        async with anyio.create_task_group() as readers:
            for i in range(len(gens)):
                readers.start_soon(read, i)
        tg.cancel_scope.cancel()
    return out, gens


@pytest.fixture(scope="module")
def sm_per_layer_prefill(store_dir: str) -> Any:
    """Every step per layer through the host, prefill chunks included (a source without queued steps)."""
    return load_streaming_model(store_dir, options=ForwardOptions(mode="per-layer"))


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill", ["default", "per-layer"])
async def test_batched_greedy_equals_mlx_lm_all_resident(request: pytest.FixtureRequest, prefill: str,
                                                          ref: Any) -> None:
    sm = request.getfixturevalue("sm" if prefill == "default" else "sm_per_layer_prefill")
    before = dict(sm.forward.counters)
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        prompts = [tok.encode(p) for p in ("The quick brown fox", "0 1 2 3 4", "MoE", LONG)]
        assert len(prompts[-1]) > 4 * CHUNK  # prefilled in several chunks, interleaved with the others' decode
        n = 6
        expected = [reference_generate(ref, p, max_tokens=n, eos_token_ids=tok.eos_token_ids, prefill_step_size=CHUNK)
                    for p in prompts]
        b = Batcher(sm, runtime, prefill_chunk=CHUNK, prompt_cache_size=0)
        got, gens = await run_all(b, [(p, n, None) for p in prompts])
        assert got == expected
        assert b.peak_batch == len(prompts)  # they really decoded together
        assert all(g.finish_reason in ("length", "stop") for g in gens)
    counters = sm.forward.counters
    if prefill == "default":  # every chunk of every prompt was a queued step, the long ones in sorted slices
        assert counters["queued_prefill"] - before["queued_prefill"] == counters["prefill"] - before["prefill"] > 4
        # Slices of pairs on the CPU, of experts on a GPU (or staged there, with a host tier: one
        # resolve into whole-layer staging arrays).
        sliced = ("sorted_parts", "expert_slices", "staged_switches")
        assert sum(counters[k] for k in sliced) > sum(before[k] for k in sliced)
        if mx.default_device() == mx.cpu:
            assert counters["expert_slices"] == before["expert_slices"]
    else:
        assert counters["queued_prefill"] == before["queued_prefill"]
        assert counters["prefill"] - before["prefill"] > 4


@pytest.mark.asyncio
async def test_a_batch_routing_more_experts_than_the_rows_still_decodes_queued_and_exact(sm: Any, ref: Any) -> None:
    # 16 requests route up to 64 (token, expert) pairs per layer: more than the 32 rows a layer has
    # at half residency, so each decode step's switches resolve their pairs in slices sorted by
    # expert (64 pairs is mlx-lm's sorting threshold). No step may fall back to the per-layer
    # path, and every token must equal mlx-lm's all-resident one.
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        prompts = [tok.encode(f"#{i}: {'abcdefgh'[i % 8] * (1 + i % 3)}") for i in range(16)]
        n = 8
        expected = [reference_generate(ref, p, max_tokens=n, eos_token_ids=tok.eos_token_ids) for p in prompts]
        counters = sm.forward.counters
        before = dict(counters)
        # Prompts of 5-8 tokens, 64 per step: every request is prefilled within 2 steps.
        b = Batcher(sm, runtime, prefill_chunk=64, prompt_cache_size=0)
        got, _ = await run_all(b, [(p, n, None) for p in prompts])
        assert got == expected
        assert b.peak_batch == len(prompts)
        assert counters["per_layer"] == before["per_layer"]  # every decode step was queued
        assert counters["queued"] - before["queued"] >= n


@pytest.mark.asyncio
async def test_a_batch_of_one_equals_the_single_stream(sm: Any) -> None:
    async with half_resident(sm) as runtime:
        prompt = sm.tokenizer.encode("Streaming experts from the SSD")
        single = [t async for t in sm.generate(prompt, max_tokens=10, source=runtime)]
        b = Batcher(sm, runtime, prompt_cache_size=0)
        (got,), _ = await run_all(b, [(prompt, 10, None)])
        assert got == single and b.peak_batch == 1


@pytest.mark.asyncio
async def test_seeded_sampling_is_the_same_alone_and_in_a_batch(sm: Any) -> None:
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        mine = (tok.encode("Once upon a time"), 12, SamplingParams(temperature=1.0, top_p=0.95, seed=1234))
        b = Batcher(sm, runtime, prompt_cache_size=0)
        (alone,), _ = await run_all(b, [mine])
        others = [(tok.encode(p), 12, SamplingParams(temperature=1.2, seed=s))
                  for s, p in enumerate(["Hello", "abc def", "1969"])]
        b2 = Batcher(sm, runtime, prompt_cache_size=0)
        together, _ = await run_all(b2, [others[0], mine, *others[1:]])
        assert together[1] == alone and b2.peak_batch == 4
        b3 = Batcher(sm, runtime, prompt_cache_size=0)
        (other_seed,), _ = await run_all(b3, [(mine[0], 12, SamplingParams(temperature=1.0, top_p=0.95, seed=1235))])
        assert other_seed != alone  # the seed decides the draw


@pytest.mark.asyncio
async def test_prefix_cache_reuses_a_shared_prefix(sm: Any, ref: Any) -> None:
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        system = "<|system|>\nYou are a terse assistant that answers in one line.\n"
        first = tok.encode(system + "<|user|>\nhi\n<|assistant|>\n")
        second = tok.encode(system + "<|user|>\nwhat is an expert?\n<|assistant|>\n")
        b = Batcher(sm, runtime, prefill_chunk=CHUNK, prompt_cache_size=4, prompt_cache_min_tokens=16)
        (a,), (ga,) = await run_all(b, [(first, 6, None)])
        (c,), (gc,) = await run_all(b, [(second, 6, None)])
        shared = len(tok.encode(system + "<|user|>\n"))
        assert ga.cached_tokens == 0 and gc.cached_tokens == shared
        assert b.prefill_tokens == (len(first) - 1) + (len(second) - 1 - shared)
        expected = reference_generate(ref, second, max_tokens=6, eos_token_ids=tok.eos_token_ids,
                                      prefill_step_size=CHUNK)
        assert c == expected


def _held_tokens(cache: list[Any]) -> int:
    """How many tokens a request's own KV cache holds (every layer agrees)."""
    sizes = {c.offset for c in cache}
    assert len(sizes) == 1
    return sizes.pop()


@pytest.mark.asyncio
async def test_steps_run_ahead_and_requests_leaving_on_eos_or_length_keep_exact_caches(sm: Any, ref: Any) -> None:
    # Decode steps are queued on the previous step's lazy tokens. Requests here leave at
    # different steps, by length and on an EOS the test declares (the step behind that token was
    # queued already and fed it), others join while steps are in flight; every token must equal
    # mlx-lm's, and every cache the prefix cache keeps must hold exactly the tokens it is filed
    # under (a cache one token longer than its key would give a later prompt wrong logits).
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        prompts = [tok.encode(p) for p in ("The quick brown fox", "0 1 2 3 4", "MoE routing", "Streaming")]
        lengths = [3, 9, 6, 9]
        expected = [reference_generate(ref, p, max_tokens=n, eos_token_ids=tok.eos_token_ids)
                    for p, n in zip(prompts, lengths)]
        # The third request "stops" at its 4th token: that token is declared an EOS of this engine.
        stop_token = expected[2][3]
        assert stop_token not in expected[2][:3]
        b = Batcher(sm, runtime, prefill_chunk=CHUNK, prompt_cache_size=8, prompt_cache_min_tokens=1)
        b.eos = set(b.eos) | {stop_token}
        out: list[list[int]] = [[] for _ in prompts]

        async def read(i: int, delay_steps: int) -> None:
            while b.steps < delay_steps:  # join while earlier requests decode
                await anyio.sleep(0.001)
            async for ev in b.submit(prompts[i], lengths[i]):
                out[i].append(ev.token)

        async with anyio.create_task_group() as tg:
            tg.start_soon(b.run)
            async with anyio.create_task_group() as readers:
                for i, delay in enumerate((0, 0, 1, 3)):
                    readers.start_soon(read, i, delay)
            tg.cancel_scope.cancel()
        for want, got in zip(expected, out):  # each request ends at its first stop token, if any
            cut = want.index(stop_token) + 1 if stop_token in want else len(want)
            assert got == want[:cut]
        assert len(out[2]) == 4  # the EOS token is handed out, then the request ends
        assert b.steps_ahead > 0 and b.peak_batch >= 2
        entries = list(b.prefix_cache._entries.values())
        assert len(entries) == len(prompts)
        for tokens, cache in entries:
            assert _held_tokens(cache) == len(tokens)
        # A follow-up whose prompt extends the EOS-ended request reuses its cache and stays exact.
        follow = prompts[2] + out[2] + tok.encode(" and more")
        want = reference_generate(ref, follow, max_tokens=4, eos_token_ids=tok.eos_token_ids)
        b2 = Batcher(sm, runtime, prefill_chunk=CHUNK, prompt_cache_size=8, prompt_cache_min_tokens=1)
        b2.prefix_cache = b.prefix_cache
        (got,), (gen,) = await run_all(b2, [(follow, 4, None)])
        assert gen.cached_tokens == len(prompts[2]) + len(out[2])
        assert got == want


@pytest.mark.asyncio
async def test_run_ahead_off_gives_the_same_tokens(sm: Any) -> None:
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        requests = [(tok.encode(p), 7, None) for p in ("Hello there", "abc", "MoE")]
        ahead = Batcher(sm, runtime, prompt_cache_size=0)
        a, _ = await run_all(ahead, requests)
        plain = Batcher(sm, runtime, prompt_cache_size=0, run_ahead=False)
        p, _ = await run_all(plain, requests)
        assert a == p
        assert ahead.steps_ahead > 0 and plain.steps_ahead == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill", ["default", "per-layer"])
async def test_joint_prefill_gives_each_request_its_own_caches_bit_for_bit(request: pytest.FixtureRequest,
                                                                           prefill: str, ref: Any) -> None:
    """With joint prefill, fresh prompts arriving together share one prefill forward
    (right-padded, as mlx-lm's batched prompt processing pads them): each request's caches equal,
    bit for bit on the CPU, those of its prompt prefilled alone, so greedy and seeded sampled
    tokens are the same either way, and greedy ones are mlx-lm's. A prompt too long to share the
    step's budget prefills on its own."""
    sm = request.getfixturevalue("sm" if prefill == "default" else "sm_per_layer_prefill")
    chunk = 96  # the first four prompts' chunks (2, 14, 18, 29 tokens) fit one step; three share a forward
    async with half_resident(sm) as runtime:
        tok = sm.tokenizer
        texts = ("The quick brown fox", "0 1 2 3 4 5 6 7", "MoE", "Streaming experts from the SSD", LONG)
        prompts = [tok.encode(t) for t in texts]
        greedy = [(p, 6, None) for p in prompts]
        sampled = [(p, 6, SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i)) for i, p in enumerate(prompts)]
        runs = {}
        for joint in (True, False):
            b = Batcher(sm, runtime, prefill_chunk=chunk, prompt_cache_size=16, prompt_cache_min_tokens=1,
                        joint_prefill=joint)
            got, _ = await run_all(b, greedy)
            b_sampled = Batcher(sm, runtime, prefill_chunk=chunk, prompt_cache_size=0, joint_prefill=joint)
            seeded, _ = await run_all(b_sampled, sampled)
            runs[joint] = (got, seeded, b, b_sampled)
        (got, seeded, joint_b, joint_s), (got_off, seeded_off, solo_b, solo_s) = runs[True], runs[False]
        for j, o in ((joint_b, solo_b), (joint_s, solo_s)):
            assert j.prefill_joined >= 3 and o.prefill_joined == 0
            assert j.prefill_chunks < o.prefill_chunks  # fewer forwards for the same prompts
        expected = [reference_generate(ref, p, max_tokens=6, eos_token_ids=tok.eos_token_ids, prefill_step_size=chunk)
                    for p in prompts]
        assert got == got_off == expected
        assert seeded == seeded_off
        if mx.default_device() != mx.cpu:
            # On the H200 the B-row products of a joint forward round differently in the last
            # bits (why joint prefill is off by default): tokens above, not bytes.
            return
        # The caches each request left in the prefix cache: the same bytes either way.
        mine = dict(joint_b.prefix_cache._entries.values())
        theirs = dict(solo_b.prefix_cache._entries.values())
        assert mine.keys() == theirs.keys() and len(mine) == len(prompts)
        for tokens, cache in mine.items():
            for a, b2 in zip(cache, theirs[tokens]):
                n = a.offset
                assert n == b2.offset == len(tokens)
                assert mx.array_equal(a.keys[..., :n, :], b2.keys[..., :n, :]).item()
                assert mx.array_equal(a.values[..., :n, :], b2.values[..., :n, :]).item()


@pytest.mark.asyncio
async def test_queued_prefill_chunks_overlap_the_decode_step_and_a_failed_one_fails_its_request(
        store_dir: str, ref: Any, tmp_path: Any) -> None:
    """Queued prefill chunks are awaited after the decode step behind them was queued (the host
    builds that step while the stream computes the chunk). A chunk whose fault fails (a record
    damaged on disk) fails its own request with the FillError, the ledgers stay clean, and the
    engine serves the next request exactly."""
    import os
    import pathlib
    import shutil

    from asyncside.errors import FillError
    from asyncside.serving.engine import GenerationFailed

    src = pathlib.Path(store_dir)
    copy = tmp_path / "store"
    copy.mkdir()
    for f in src.iterdir():  # noqa: ASYNC240 - test setup; the blobs hard-linked (never written), the one to damage copied
        try:
            if not f.name.startswith("layer-") or f.name == "layer-00003.bin":
                raise OSError
            os.link(f, copy / f.name)
        except OSError:  # that one, small files, or another filesystem
            shutil.copy(f, copy / f.name)
    sm = load_streaming_model(str(copy))
    tok = sm.tokenizer
    spec = sm.store.layer(3)
    whole = spec.path.read_bytes()
    async with half_resident(sm) as runtime:
        prompts = [tok.encode(p) for p in ("The quick brown fox", LONG)]
        expected = [reference_generate(ref, p, max_tokens=5, eos_token_ids=tok.eos_token_ids, prefill_step_size=CHUNK)
                    for p in prompts]
        b = Batcher(sm, runtime, prefill_chunk=CHUNK, prompt_cache_size=0)
        got, _ = await run_all(b, [(p, 5, None) for p in prompts])
        assert got == expected
        assert b.chunks_overlapped > 0  # a decode step was queued behind a chunk before it was awaited
        damaged = bytearray(whole)
        for e in range(spec.n_experts):  # every record of layer 3 (the resident ones are in the pools)
            damaged[spec.record_offset(e) + spec.segments[0].offset] ^= 0x40
        spec.path.write_bytes(damaged)
        try:
            gen = b.submit(tok.encode(LONG + " Again."), 5)
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.run)
                with pytest.raises(GenerationFailed, match="layer 3 expert .*checksum mismatch") as info:
                    async for _ in gen:
                        pass
                tg.cancel_scope.cancel()
            cause = info.value.__cause__
            errors = list(cause.exceptions) if isinstance(cause, ExceptionGroup) else [cause]
            assert errors and all(isinstance(e, FillError) and "checksum" in str(e) for e in errors), errors
            # Two fresh prompts prefilled in one joint forward: its failure fails both requests.
            joint = Batcher(sm, runtime, prefill_chunk=64, prompt_cache_size=0, joint_prefill=True)
            gens = [joint.submit(tok.encode(t), 5) for t in ("Fresh prompt one", "And a second one")]
            failures: list[BaseException] = []

            async def drain(g: Any) -> None:
                try:
                    async for _ in g:
                        pass
                except GenerationFailed as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(joint.run)
                async with anyio.create_task_group() as readers:
                    for g in gens:
                        readers.start_soon(drain, g)
                tg.cancel_scope.cancel()
            assert joint.prefill_joined == 2 and len(failures) == 2, (joint.prefill_joined, failures)
            assert all("layer 3 expert" in str(f) and "checksum mismatch" in str(f) for f in failures)
        finally:
            spec.path.write_bytes(whole)
        await runtime.quiesce()
        assert audit_problems(runtime) == []
        (again,), _ = await run_all(b, [(prompts[0], 5, None)])
        assert again == expected[0]

"""The serving engine over every architecture asyncside streams (the five first ones and the ten of
session 16): concurrent greedy requests give each request's tokens alone in mlx-lm.

Per architecture (its tiny config, tests/test_archs_16.py's ``_store``), a :class:`Batcher` over a
Runtime keeping half of each layer's experts serves requests of different prompt lengths at once
(prefill chunks of 8 interleaved with the others' decode, with and without joint prefill), then
requests sharing a prefix with an earlier one (the prompt cache trims a copy of its cache back to
the prefix). Each request's tokens must equal ``reference_generate`` of that request alone with
the same prefill step. Every architecture's decode steps are batched (/health's batched_decode):
llama4's chunked-attention caches, which have no batched form in mlx-lm, merge into asyncside's
(:class:`~asyncside.models.chunked_batch.BatchChunkedKVCache`), its rows crossing chunk boundaries
inside batched steps; a cache whose front was dropped is never trimmed back behind it (that gave
other tokens). `asyncside serve` itself runs over a llama4 and a qwen3_moe store; llama4's
vocabulary and context are read in its text_config.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from _archs_support import prompt_of
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from test_archs_16 import LLAMA4, _config, _store
from test_serve_batching import run_all

from asyncside.models import load_streaming_model, reference_generate
from asyncside.models.arch import ARCHS
from asyncside.models.chunked_batch import BatchChunkedKVCache
from asyncside.models.tokenizer import load_tokenizer, save_byte_level_tokenizer
from asyncside.routing import RoutingTrace as TraceFile
from asyncside.routing import synthetic
from asyncside.runtime import Runtime
from asyncside.serving import Batcher, engine
from asyncside.serving.prompt_cache import PrefixCache, trims_back_to

from _models_support import SLIDING_WINDOWED

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 8
TOKENS = 8
LLAMA4_EXPERTS = int(LLAMA4["text_config"]["num_local_experts"])  # type: ignore[index]  # a dict of objects


async def _serve(b: Batcher, requests: list[tuple[list[int], int]]) -> list[tuple[list[int], Any]]:
    """Submit every request at once; each one's tokens (EOS excluded) and its Generation."""
    out, gens = await run_all(b, [(p, n, None) for p, n in requests])
    return list(zip(out, gens))


def _alone(model: Any, prompt: list[int], n: int = TOKENS) -> list[int]:
    return reference_generate(model, prompt, max_tokens=n, prefill_step_size=CHUNK)


@pytest.mark.parametrize("joint", [False, True], ids=["chunks", "joint"])
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_concurrent_requests_decode_as_each_alone(tmp_path: pathlib.Path, model_type: str, joint: bool,
                                                 caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store, model, config = _store(tmp_path, model_type)
    # llama4's prompts span several attention chunks (of 8), so its caches drop their front, and its
    # requests decode long enough to cross a chunk boundary inside batched steps.
    lengths = [27, 5, 14, 2] if model_type == "llama4" else [21, 5, 12, 2]
    n_tokens = 2 * TOKENS if model_type == "llama4" else TOKENS
    prompts = [prompt_of(config, n, seed=i) for i, n in enumerate(lengths)]
    expected = [_alone(model, p, n_tokens) for p in prompts]
    sm = load_streaming_model(store)

    batched_positions = _batched_only(monkeypatch)

    async def main() -> tuple[list[tuple[list[int], Any]], Batcher]:
        async with Runtime(sm.store, resident=0.5) as rt:
            b = Batcher(sm, rt, prefill_chunk=CHUNK, prompt_cache_size=0, joint_prefill=joint)
            return await _serve(b, [(p, n_tokens) for p in prompts]), b

    with caplog.at_level(logging.INFO, logger="asyncside.serving"):
        got, b = anyio.run(main)
    assert [tokens for tokens, _ in got] == expected
    assert [g.finish_reason for _, g in got] == ["length"] * len(prompts)
    assert b.peak_batch == len(prompts)  # they decoded together
    assert b.batched_decode
    assert [r.getMessage() for r in caplog.records if "no batched form" in r.getMessage()] == []
    if model_type == "llama4":
        assert _crossed_a_chunk_in_a_batch(batched_positions, len(prompts))
    else:
        assert batched_positions == []


def _batched_only(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Make a decode step whose rows run one after the other fail; returns, as they come, the
    positions fed of the rows of each batched chunk mask (llama4's batch caches build them)."""
    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("rows decoded one after the other: the batched path was not taken")

    monkeypatch.setattr(engine, "rows_step", one_at_a_time)
    positions: list[list[int]] = []
    chunk_mask = BatchChunkedKVCache.make_mask

    def recording_mask(self: BatchChunkedKVCache, n: int) -> Any:
        positions.append(list(self.offsets))
        return chunk_mask(self, n)

    monkeypatch.setattr(BatchChunkedKVCache, "make_mask", recording_mask)
    return positions


def _crossed_a_chunk_in_a_batch(positions: list[list[int]], rows: int) -> bool:
    """Whether every row decoded in one batch once, and a row entered a new chunk (its query at a
    chunk's first position) in a step of several rows."""
    return (max(map(len, positions)) == rows
            and any(len(feds) > 1 and any(p > 0 and p % CHUNK == 0 for p in feds) for feds in positions))


def _rss() -> int:
    """Bytes this process holds now (VmRSS)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("variant", ["replay", "memory"])
def test_llama4_batches_replayed_or_under_a_memory_budget_as_each_alone(tmp_path: pathlib.Path, variant: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """llama4's merged chunked caches under routing replay (each row forced to its own request's
    trace ids, tokens equal to each request's alone under the same replay) and under a memory
    budget (a plan sizing the pools and the KV allowance): one batch, each request's tokens alone."""
    store, model, config = _store(tmp_path, "llama4")
    prompts = [prompt_of(config, n, seed=i) for i, n in enumerate([27, 5, 14, 2])]
    n_tokens = 2 * TOKENS
    sm = load_streaming_model(store)
    replay, path = None, tmp_path / "trace.npz"
    if variant == "replay":
        trace = synthetic(tokens=50 + 30 + 45, n_layers=len(sm.moe_layers), n_experts=LLAMA4_EXPERTS,
                          top_k=sm.forward.walk.top_k, skew=0.3, overlap=0.2, layer_corr=0.1, seed=7)
        TraceFile(trace.ids, np.array([50, 30, 45]), trace.n_experts, dict(trace.meta)).save(path)
        replay = sm.set_routing(path)
        sm.set_routing(None)
    positions = _batched_only(monkeypatch)

    async def main() -> tuple[list[list[int]], list[tuple[list[int], Any]], Batcher]:
        # A budget a gigabyte above what the process holds (on a GPU, CUDA's libraries alone
        # hold a few gigabytes before anything is planned).
        opened = (Runtime(sm.store, resident=0.5) if variant == "replay"
                  else Runtime(sm.store, resident=0.5, memory=_rss() + (1 << 30), direct=False))
        async with opened as rt:
            alone = []
            for n, prompt in enumerate(prompts):
                if replay is None:
                    alone.append(_alone(model, prompt, n_tokens))
                    continue
                sm.set_routing(path, sequence=n % 3)
                try:
                    alone.append([t async for t in sm.generate(prompt, max_tokens=n_tokens, source=rt,
                                                               predictor="none")])
                finally:
                    sm.set_routing(None)
            assert rt.plan is not None and rt.plan.source.startswith("memory=") is (variant == "memory")
            b = Batcher(sm, rt, prefill_chunk=CHUNK, prompt_cache_size=0, predictor="none", routing=replay)
            assert (b.kv_admission is not None) is (variant == "memory")  # admitted under the KV allowance
            return alone, await _serve(b, [(p, n_tokens) for p in prompts]), b

    alone, got, b = anyio.run(main)
    assert [tokens for tokens, _ in got] == alone
    assert b.peak_batch == len(prompts) and b.batched_decode and bool(b.replays) is (variant == "replay")
    assert _crossed_a_chunk_in_a_batch(positions, len(prompts))


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_a_prefix_from_the_prompt_cache_decodes_as_alone(tmp_path: pathlib.Path, model_type: str) -> None:
    """A request decoded beside another leaves its cache to the prompt cache; requests sharing a
    prefix of its tokens (trimmed back to the middle, near the start, near the end, or all of it)
    then decode together as each alone. Every architecture reuses the whole entry; each
    reuses the trimmed ones where its cache can give them back exactly."""
    store, model, config = _store(tmp_path, model_type)
    first, beside = prompt_of(config, 20, seed=1), prompt_of(config, 9, seed=11)
    held = first + _alone(model, first)  # what the cache holds after: the last token was never fed
    fed = len(held) - 1
    follow = [held[:fed // 2] + prompt_of(config, 5, seed=2), held[:3] + prompt_of(config, 9, seed=3),
              held[:fed - 1] + [5, 6], held + prompt_of(config, 4, seed=4)]
    expected = [_alone(model, p) for p in follow]
    sm = load_streaming_model(store)

    async def main() -> list[tuple[list[int], Any]]:
        async with Runtime(sm.store, resident=0.5) as rt:
            b = Batcher(sm, rt, prefill_chunk=CHUNK, prompt_cache_size=4, prompt_cache_min_tokens=1)
            before = await _serve(b, [(first, TOKENS), (beside, TOKENS)])
            assert [tokens for tokens, _ in before] == [_alone(model, first), _alone(model, beside)]
            for key, (tokens, _cache) in list(b.prefix_cache._entries.items()):
                if tokens[:len(first)] != tuple(first):
                    b.prefix_cache._drop(key)  # the other request's entry: not what this test reuses
            assert len(b.prefix_cache) == 1
            return await _serve(b, [(p, TOKENS) for p in follow])

    got = anyio.run(main)
    assert [tokens for tokens, _ in got] == expected
    cached = [g.cached_tokens for _, g in got]
    assert cached[3] == fed  # the whole entry, untrimmed
    if model_type == "llama4":
        # Its chunked layers dropped every key before the last chunk's: a prefix reaching behind
        # that is prefilled again; one within the last chunk is reused.
        assert cached[:3] == [0, 0, fed - 1]
    elif model_type in SLIDING_WINDOWED:
        assert cached[:3] == [0, 0, 0]  # its full sliding windows are not trimmable (mlx-lm's rule)
    else:
        assert cached[:3] == [fed // 2, 3, fed - 1]


def _chunked(positions: int, chunk: int = 8) -> ChunkedKVCache:
    """A chunked-attention cache fed ``positions`` one at a time, its front dropped as llama4 drops it."""
    import mlx.core as mx

    c = ChunkedKVCache(chunk)
    for _ in range(positions):
        c.maybe_trim_front()
        c.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    return c


def test_a_chunked_cache_trims_back_only_within_what_it_kept() -> None:
    """Fed 20 positions one at a time in chunks of 8, it kept positions 11 on (of chunk 8..15,
    keys 11..15 only): back to 16 or past is exact, back to 13 would attend without keys 8..10,
    and back to 9 would stop short at 11 with nothing said."""
    c = _chunked(20)
    assert (c.start_position, c.offset) == (11, 20)
    assert trims_back_to([c, KVCache()], 16) and trims_back_to([c], 19)
    assert not trims_back_to([c], 13) and not trims_back_to([c], 9)
    assert trims_back_to([_chunked(7)], 3)  # nothing dropped yet

    tokens = list(range(100, 120))
    cache = PrefixCache(4, min_tokens=1)
    cache.insert(tokens, [c])
    assert cache.fetch(tokens[:13] + [1, 2]) == (None, 0)
    mine, reused = cache.fetch(tokens[:17] + [1, 2])
    assert reused == 17 and mine is not None and mine[0].offset == 17 and mine[0].start_position == 11
    assert c.offset == 20  # the entry itself untouched
    # A longer conversation of the same tokens keeps the shorter entry where it cannot give it back
    # (it kept positions 17 on: chunk 16..23 lacks key 16).
    cache.insert(tokens + [1, 2, 3, 4, 5, 6], [_chunked(26)])
    assert len(cache) == 2
    assert cache.fetch(tokens + [9])[1] == 20


def test_llama4_vocabulary_and_context_are_read_in_its_text_config(tmp_path: pathlib.Path) -> None:
    """A llama4 config as Hugging Face writes it names the vocabulary and the context only in its
    ``text_config``: the engine still validates token ids against that vocabulary and bounds
    prompts by that context (it read neither: no context limit, ids unchecked)."""
    store, _model, config = _store(tmp_path, "llama4")
    sm = load_streaming_model(store)
    sm.config = {k: v for k, v in sm.config.items() if k not in ("vocab_size", "hidden_size")}
    b = Batcher(sm, None)
    text = config["text_config"]
    assert (b.vocab_size, b.context_length) == (text["vocab_size"], text["max_position_embeddings"])


def _served_store(tmp: pathlib.Path, model_type: str) -> tuple[pathlib.Path, Any]:
    """A tiny model's store with the byte-level tokenizer (a vocabulary of 512 ids), as `asyncside
    serve --model` takes it; and the plain model."""
    fields: dict[str, Any] = {"vocab_size": 512}
    if model_type == "llama4":
        fields["text_config"] = {**LLAMA4["text_config"], "vocab_size": 512}
    with _config(model_type, **fields):
        store, model, _config_dict = _store(tmp, model_type)
    save_byte_level_tokenizer(store)
    return store, model


@contextlib.contextmanager
def _serve_command(args: list[str]) -> Iterator[tuple[str, list[str]]]:
    """`asyncside serve ARGS` in a process: its URL once ready and its output lines so far (a list
    that grows); SIGINT at the end, which must exit 0."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from asyncside.cli import main; sys.exit(main())",
                             "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.startswith("asyncside serve: http"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(120) and proc.poll() is None, "\n".join(output)
        url = next((m for m in map(re.compile(r"^asyncside serve: (http://127\.0\.0\.1:\d+) ").search, output)
                    if m), None)
        assert url is not None, output
        yield url.group(1), output
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "\n".join(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("model_type", ["llama4", "qwen3_moe"])
def test_asyncside_serve_says_how_it_decodes_and_answers_as_alone(tmp_path: pathlib.Path, model_type: str) -> None:
    """`asyncside serve` over a tiny store: concurrent greedy completions answer each prompt's
    mlx-lm text alone; /health tells that decode steps are batched (llama4's chunked caches
    too), and no line says otherwise."""
    store, model = _served_store(tmp_path, model_type)
    tok = load_tokenizer(store, {})
    prompts = [prompt_of({"vocab_size": 256}, n, seed=i) for i, n in enumerate([19, 4, 11])]
    expected = [tok.decode(reference_generate(model, p, max_tokens=6, prefill_step_size=CHUNK,
                                              eos_token_ids=set(tok.eos_token_ids))) for p in prompts]
    args = ["--model", str(store), "--port", "0", "--resident", "0.5", "--prefill-chunk", str(CHUNK),
            "--prompt-cache-size", "0"]
    with _serve_command(args) as (url, output):
        model_id = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]

        def complete(prompt: list[int]) -> str:
            r = httpx.post(url + "/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        health = httpx.get(url + "/health", timeout=60).json()
    assert got == expected
    assert health["batched_decode"] is True
    assert [line for line in output if "no batched form" in line] == []

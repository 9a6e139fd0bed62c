"""Memory over long generations, round 15: what the process holds beyond its plan while it
generates token after token, which is the margin a model larger than memory streams in.

- MLX's cache of freed buffers grows no faster per generated token under our queued steps than
  under mlx-lm's ``generate_step`` (it grew several times as fast on this small model, over ten
  times on the embedded default one, until the next clear).
- A queued prefill chunk holds about one layer's buffers at a time, as mlx-lm's prefill does, not
  every layer's at once (the plan's estimate of a forward, which bounds prompt chunks under a
  budget, counts one layer's).
- mlx-lm's own ``generate`` over ``asyncside.load(..., memory=)``: the KV cache is held to the plan's
  KV allowance, as :meth:`StreamingModel.generate` and the server hold it.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator
from typing import Any

import anyio
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from asyncside import ExpertStore, Runtime
from asyncside.errors import AsyncsideError
from asyncside.facade import load
from asyncside.kv_layout import model_kv_layout
from asyncside.models import load_streaming_model
from asyncside.models.embedded import ensure_embedded_default

from _facade_support import PROMPT, dirs, reference  # noqa: F401  (the fixtures)
from _models_support import embedded_spec


@pytest.fixture
def roomy_mlx_cache() -> Iterator[None]:
    """MLX's cache of freed buffers without its CPU limit (a few tens of MB), as it is on a GPU,
    where the limit is the device's memory: what the cache keeps is then what a step left there."""
    mx.clear_cache()
    old = mx.set_cache_limit(1 << 34)
    yield
    mx.set_cache_limit(old)
    mx.clear_cache()


#: decode tokens whose cache growth is compared, after the first few
TOKENS, WARM = 200, 32


@pytest.mark.skipif(mx.default_device() == mx.cpu,
                    reason="on the CPU the bound's floor, read while a queued step computes, varies with "
                           "the machine's load, and the comparison with it (QueuedSteps.bound_cache); off "
                           "the CPU, where MLX's cache has no limit short of the device's memory, it runs")
def test_mlx_cache_grows_no_faster_per_token_than_under_mlx_lm(
        dirs: tuple[pathlib.Path, pathlib.Path], reference: tuple[Any, Any],  # noqa: F811
        roomy_mlx_cache: None) -> None:
    """A queued step goes to MLX whole, so every buffer of the step was allocated before any was
    freed: the buffers sized by the context (each layer's attention scores and weights, a
    position larger every step) were neither reused by the next layer nor fit any later step,
    and MLX's cache kept them all until the next clear, every 256 tokens. mlx-lm's cache keeps
    about one a token. Our generation's cache now grows no faster than mlx-lm's, tokens unchanged."""
    ref_model, ref_tok = reference
    prompt = ref_tok.encode(PROMPT)

    def growth(held: list[int]) -> int:
        return max(held[WARM:]) - held[WARM]

    theirs: list[int] = []
    want: list[int] = []
    for tok, _ in generate_step(mx.array(prompt), ref_model, max_tokens=TOKENS):
        want.append(int(tok))
        theirs.append(mx.get_cache_memory())

    sm = load_streaming_model(dirs[1])
    ours: list[int] = []
    got: list[int] = []

    async def main() -> None:
        async with Runtime(ExpertStore.open(dirs[1]), resident=0.25) as rt:
            async for tok in sm.generate(prompt, max_tokens=TOKENS, source=rt, stop_at_eos=False):
                got.append(tok)
                ours.append(mx.get_cache_memory())

    anyio.run(main)
    assert got == want
    assert growth(theirs) > 0  # the comparison means something: mlx-lm's cache does grow
    # before, ours grew several times as fast
    assert growth(ours) <= growth(theirs), (growth(ours), growth(theirs))


#: a narrow model of many layers: a prefill chunk's buffers are mostly its layers' attention scores
TALL = embedded_spec(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def test_a_queued_prefill_chunk_holds_one_layers_buffers_at_a_time(tmp_path: pathlib.Path) -> None:
    """A queued step goes to MLX whole past its throttle, and MLX allocates a node's output as the
    node is handed over: a prefill chunk had every layer's attention scores allocated side by
    side (on the embedded model a chunk of a few hundred tokens took over ten times mlx-lm's
    memory), where the plan's estimate that bounds prompt chunks under a budget counts one layer's.
    A long step's layers now go to MLX one at a time: its peak is within a small multiple of
    mlx-lm's prefill of the same prompt (before: several times more), and its token is mlx-lm's."""
    model_dir, store_dir = ensure_embedded_default(tmp_path, spec=TALL, progress=False)
    prompt = [(i * 7) % 90 + 32 for i in range(300)]  # one chunk, queued (at most MAX_QUEUED_TOKENS)
    ref_model, _ = mlx_lm.load(str(model_dir))
    mx.eval(ref_model.parameters())
    cache = make_prompt_cache(ref_model)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    ref_model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    theirs = mx.get_peak_memory() - base
    want = next(generate_step(mx.array(prompt), ref_model, max_tokens=1))[0]
    del ref_model, cache

    sm = load_streaming_model(store_dir)
    got: list[int] = []
    ours = 0

    async def main() -> None:
        nonlocal ours
        async with Runtime(ExpertStore.open(store_dir), resident=1.0) as rt:
            mx.clear_cache()
            start = mx.get_active_memory()
            mx.reset_peak_memory()
            got.extend([t async for t in sm.generate(prompt, max_tokens=1, source=rt, stop_at_eos=False)])
            ours = mx.get_peak_memory() - start

    anyio.run(main)
    assert sm.forward.counters["queued_prefill"] == 1  # the chunk was one queued step
    assert got == [int(want)]
    assert ours <= 3 * theirs, (ours, theirs)


@pytest.fixture(scope="module")
def budgeted(dirs: tuple[pathlib.Path, pathlib.Path]) -> Iterator[tuple[Any, Any]]:  # noqa: F811
    model, tokenizer = load(dirs[1], memory=4 * 2**30)
    yield model, tokenizer
    model.close()


def _allow_positions(model: Any, positions: int) -> int:
    """Set the loaded model's KV allowance to one cache of ``positions`` (the count the allowance
    makes of a generation's cache); returns the allowance."""
    rt = model.runtime
    allowance = model_kv_layout(model.streaming).bytes_for(positions)
    rt._plan = dataclasses.replace(rt._plan, kv_allowance_bytes=allowance)
    return allowance


def test_mlx_lm_generate_over_a_loaded_model_keeps_the_kv_cache_to_the_allowance(
        budgeted: tuple[Any, Any], reference: tuple[Any, Any]) -> None:  # noqa: F811
    """``generate(model, tok, prompt, max_tokens=...)`` under ``load(memory=)``: mlx-lm's loop feeds
    the model a token at a time, and the cache grew past the plan's KV allowance without a word,
    however long the generation (our generate and the server refuse before the first step). The
    step that would take the cache past the allowance is now refused, with the cache untouched."""
    model, tok = budgeted
    ref_model, ref_tok = reference
    prompt = tok.encode(PROMPT)
    old = model.runtime._plan
    try:
        fits = len(prompt) + 40
        _allow_positions(model, fits)
        # what fits runs as before (mlx-lm feeds the prompt and max_tokens positions, the last
        # step's token unread, as our generate counts them)
        want = generate(ref_model, ref_tok, prompt, max_tokens=40)
        assert generate(model, tok, prompt, max_tokens=40) == want
        got: list[int] = []
        with pytest.raises(AsyncsideError, match=rf"take the KV cache to {fits + 1} positions, .* past the KV "
                                                 rf"allowance .* one sequence's cache may reach {fits} positions"):
            for r in stream_generate(model, tok, prompt, max_tokens=200):
                got.append(r.token)
        ref = [r.token for r in stream_generate(ref_model, ref_tok, prompt, max_tokens=200)]
        assert got == ref[:len(got)] and len(got) == 40  # every token up to the refused step
        # a refused step leaves the cache as it was
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        with pytest.raises(AsyncsideError, match="past the KV allowance"):
            model(mx.array([[1] * 41]), cache=cache)
        assert cache[0].offset == len(prompt)
        # a batch counts each of its sequences
        with pytest.raises(AsyncsideError, match=r"for each of 2 sequences"):
            model(mx.array([prompt, prompt]), cache=make_prompt_cache(model))
    finally:
        model.runtime._plan = old


def test_loop_lag_keeps_a_bounded_window_and_counts_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's loop-lag ticker ran for the whole generation and kept a float per tick: a run of
    hours grew without end. It keeps the latest samples; ticks, the maximum and ticks over 10 ms
    count them all."""
    from asyncside import looplag

    monkeypatch.setattr(looplag, "SAMPLES_KEPT", 8)
    lag = looplag.LoopLag(interval=0.005)
    lates = [0.001] * 40 + [0.050] + [0.002] * 40 + [0.011]
    for x in lates:
        lag.add(x)
    s = lag.summary()
    assert len(lag.samples) == 8
    assert s["ticks"] == len(lates) and s["over_10ms"] == 2
    assert s["max_ms"] == pytest.approx(50.0)

"""Every sampling and answer-shaping parameter through the ``openai`` client, on the real embedded
model served with half its experts streamed.

Greedy answers (with penalties and logit bias too) are compared token for token with mlx-lm's own
``generate_step`` on the all-resident model with mlx-lm's own logits processors; seeded sampling
is compared with itself (same seed, alone and beside other requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from asyncside.models import load_reference_model
from asyncside.serving import (
    BackgroundServer,
    ServeSettings,
    create_app,
    default_prefill_chunk,
    embedded_store_dir,
    open_engine,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

N = 8
PROMPT = "The expert store"
MESSAGES = [{"role": "user", "content": "Tell me about experts"}]


@pytest.fixture(scope="module")
def store_dir() -> str:
    return embedded_store_dir()


@pytest.fixture(scope="module")
def srv(store_dir: str) -> Iterator[BackgroundServer]:
    app = create_app(lambda: open_engine(store_dir, resident=0.5), ServeSettings(max_tokens_limit=64))
    with BackgroundServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def ref(store_dir: str) -> Any:
    return load_reference_model(store_dir)[0]


def tok(srv: BackgroundServer) -> Any:
    return srv.app.state.asyncside.batcher.tokenizer


def mid(srv: BackgroundServer) -> str:
    return srv.app.state.asyncside.model_id


def client(srv: BackgroundServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


def mlx_lm_text(srv: BackgroundServer, ref: Any, prompt_ids: list[int], max_tokens: int = N,
                **processors: Any) -> str:
    """Greedy text of mlx-lm's generate_step on the all-resident model, with mlx-lm's processors."""
    t = tok(srv)
    procs = make_logits_processors(**processors) if processors else None
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), ref, max_tokens=max_tokens, logits_processors=procs,
                                  prefill_step_size=default_prefill_chunk()):
        if int(token) in t.eos_token_ids:
            break
        out.append(int(token))
    return t.decode(out)


@pytest.mark.asyncio
async def test_greedy_by_default_equals_mlx_lm(srv: BackgroundServer, ref: Any) -> None:
    async with client(srv) as c:
        resp = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N)
        zero = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, temperature=0)
    expected = mlx_lm_text(srv, ref, tok(srv).encode(PROMPT))
    assert resp.choices[0].text == zero.choices[0].text == expected


@pytest.mark.asyncio
@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 1.5, "repetition_context_size": 3},
    {"presence_penalty": 1.5},
    {"presence_penalty": -1.0, "presence_context_size": 4},
    {"frequency_penalty": 1.2},
    {"frequency_penalty": 2.0, "frequency_context_size": 6},
    {"logit_bias": {"90": 8.0, "112": -100}},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"48": 3}},
])
async def test_penalties_and_logit_bias_equal_mlx_lm(srv: BackgroundServer, ref: Any, params: dict[str, Any]) -> None:
    known = {"presence_penalty", "frequency_penalty", "logit_bias"}  # named arguments of the client
    kwargs = {k: v for k, v in params.items() if k in known}
    extra = {k: v for k, v in params.items() if k not in known}
    async with client(srv) as c:
        resp = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, extra_body=extra or None,
                                          **kwargs)
        greedy = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N)
    mlx_params = dict(params)
    if "logit_bias" in mlx_params:
        mlx_params["logit_bias"] = {int(k): float(v) for k, v in mlx_params["logit_bias"].items()}
    expected = mlx_lm_text(srv, ref, tok(srv).encode(PROMPT), **mlx_params)
    assert resp.choices[0].text == expected
    assert resp.choices[0].text != greedy.choices[0].text  # the parameter did something


@pytest.mark.asyncio
async def test_logit_bias_forces_a_token(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        resp = await c.chat.completions.create(model=mid(srv), messages=MESSAGES, max_tokens=5,
                                               logit_bias={"90": 100})
    assert resp.choices[0].message.content == "ZZZZZ"


@pytest.mark.asyncio
async def test_seed_reproducible_alone_and_beside_others(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        async def sample(seed: int, prompt: str = PROMPT, temperature: float = 1.0) -> str:
            r = await c.completions.create(model=mid(srv), prompt=prompt, max_tokens=N, temperature=temperature,
                                           seed=seed)
            return r.choices[0].text

        alone = await sample(7)
        again = await sample(7)
        together = await asyncio.gather(sample(7), sample(8, "Hello there"), sample(9, "0 1 2"))
        other = await sample(8)
        greedy = (await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N)).choices[0].text
    assert alone == again == together[0]
    assert other != alone and alone != greedy


@pytest.mark.asyncio
async def test_truncation_filters_reduce_to_greedy(srv: BackgroundServer) -> None:
    """top_k=1, min_p=1 and a tiny top_p each keep only the best token: any seed gives the greedy text."""
    async with client(srv) as c:
        greedy = (await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N)).choices[0].text
        hot = (await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, temperature=1.5,
                                          seed=3)).choices[0].text
        got = []
        for extra in ({"top_k": 1}, {"min_p": 1.0}, {}):
            kw: dict[str, Any] = {"top_p": 1e-6} if not extra else {}
            r = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, temperature=1.5, seed=3,
                                           extra_body=extra or None, **kw)
            got.append(r.choices[0].text)
        wide = (await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, temperature=1.5, seed=3,
                                           extra_body={"top_k": 0, "min_p": 0.0}, top_p=1.0)).choices[0].text
    assert hot != greedy
    assert got == [greedy] * 3
    assert wide == hot  # the filters switched off explicitly change nothing


@pytest.mark.asyncio
async def test_chat_logprobs_and_top_logprobs(srv: BackgroundServer, ref: Any) -> None:
    async with client(srv) as c:
        resp = await c.chat.completions.create(model=mid(srv), messages=MESSAGES, max_tokens=N, logprobs=True,
                                               top_logprobs=3)
        stream = await c.chat.completions.create(model=mid(srv), messages=MESSAGES, max_tokens=N, logprobs=True,
                                                 top_logprobs=3, stream=True)
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(model=mid(srv), messages=MESSAGES, max_tokens=N)
    content = resp.choices[0].logprobs.content
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode())
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
    assert plain.choices[0].logprobs is None
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # The first token's log-probability is mlx-lm's, from the all-resident model.
    from asyncside.serving.protocol import ChatMessage, chat_prompt_ids

    ids = chat_prompt_ids(tok(srv), [ChatMessage(m["role"], m["content"]) for m in MESSAGES])
    logits = ref(mx.array(ids)[None])[:, -1, :]
    lp = (logits - mx.logsumexp(logits, keepdims=True))[0]
    assert content[0].logprob == pytest.approx(lp[int(mx.argmax(lp))].item(), abs=1e-4)


@pytest.mark.asyncio
async def test_completion_logprobs(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        resp = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, logprobs=2)
        only = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=N, logprobs=0)
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(max(t.values()) == x for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert only.choices[0].logprobs.top_logprobs is None and only.choices[0].logprobs.token_logprobs == lp.token_logprobs


@pytest.mark.asyncio
async def test_stop_max_tokens_n_user_and_usage(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        full = (await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=16)).choices[0].text
        stop = full[5:8]
        cut = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=16, stop=[stop, "\x00never"],
                                         n=1, user="tester")
        stream = await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=16, stop=stop, stream=True,
                                            stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
            await c.completions.create(model=mid(srv), prompt=PROMPT, max_tokens=2, n=2)
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(tok(srv).encode(PROMPT))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.asyncio
async def test_chat_template_kwargs_and_prompt_cache_on_the_real_model(srv: BackgroundServer) -> None:
    system = {"role": "system", "content": "You are a terse assistant. Answer in one short line, never more."}
    turn1 = [system, {"role": "user", "content": "hi"}]
    async with client(srv) as c:
        a = await c.chat.completions.create(model=mid(srv), messages=turn1, max_tokens=4)
        turn2 = [*turn1, {"role": "assistant", "content": a.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        b = await c.chat.completions.create(model=mid(srv), messages=turn2, max_tokens=4)
        think = await c.chat.completions.create(model=mid(srv), messages=turn1, max_tokens=4,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    # The second turn starts with the first turn's prompt and answer: those tokens come from the cache.
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens
    assert think.usage.prompt_tokens == a.usage.prompt_tokens + len("<think>\n")


def test_a_greedy_batch_draws_one_argmax_with_the_tokens_of_its_rows_drawn_alone() -> None:
    """draw_step: a batch of plain greedy requests takes one argmax over the batch's
    log-probabilities; its tokens are the rows' own draws, token for token, including near ties.
    A batch with any other request draws row by row (packed as before)."""
    from asyncside.serving.protocol import SamplingParams
    from asyncside.serving.sampling import RequestSampler, draw_step, unpack

    vocab = 512
    logits = mx.random.normal((6, vocab), key=mx.random.key(3)) * 4
    logits[:, 7] = logits.max(axis=-1)  # ties with the row's best: the first index wins, as alone
    greedy = [RequestSampler(SamplingParams(), [1, 2], vocab) for _ in range(6)]
    assert all(s.plain_greedy for s in greedy)
    values, layout = draw_step(greedy, logits)
    mx.eval(values)
    assert values.size == 6 and all(s.steps == 1 for s in greedy)  # one value per request: the batched path
    alone = [RequestSampler(SamplingParams(), [1, 2], vocab) for _ in range(6)]
    expected = [int(s.draw(logits[i:i + 1]).token.item()) for i, s in enumerate(alone)]
    assert [t for t, _, _ in unpack(values.tolist(), layout)] == expected
    mixed = greedy[:5] + [RequestSampler(SamplingParams(logprobs=True, top_logprobs=2), [1, 2], vocab)]
    assert not mixed[-1].plain_greedy
    values, layout = draw_step(mixed, logits)
    out = unpack(values.tolist(), layout)
    assert [t for t, _, _ in out] == expected and out[-1][1] is not None and len(out[-1][2]) == 2

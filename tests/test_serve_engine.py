"""The server around the model, with a scripted model (tests/_serving_support.py): tool calls,
admission (429), timeouts, context limits, hostile input, errors counted, CORS, access log, and the
engine's interleaving of prefill chunks with decode steps.

The model here answers a fixed text, so what reaches the client is known exactly; everything
between HTTP and the model (parsing, the engine loop, sampling, text assembly, SSE) is the real
code. The real model is served in tests/test_serve.py and tests/test_serve_sampling.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.serving import BackgroundServer, Batcher, QueueFull, ServeSettings, create_app
from asyncside.serving.protocol import SamplingParams
from asyncside.serving.streaming import EventStream, Frame

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOOL_REPLY = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def make_model(tokenizer: Any) -> ScriptedModel:
    return ScriptedModel(tokenizer, "hello world. bye", {
        "in Paris?": TOOL_REPLY,
        "broken tool": "<tool_call>\n{not json}\n</tool_call>",
        "count": "one two three four five six seven eight",
    }, fail_when="explode")


def server(tokenizer: Any, **settings: Any) -> BackgroundServer:
    defaults: dict[str, Any] = {"prompt_cache_size": 0, "max_tokens_limit": 256}
    app = create_app(scripted_engine(make_model(tokenizer)), ServeSettings(**{**defaults, **settings}))
    return BackgroundServer(app)


@pytest.fixture(scope="module")
def srv(tokenizer: Any) -> Iterator[BackgroundServer]:
    with server(tokenizer) as s:
        yield s


def client(srv: BackgroundServer, base: str = "/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + base, api_key="x", max_retries=0, timeout=60)


def samples(srv: BackgroundServer) -> dict[str, float]:
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def requests_total(srv: BackgroundServer, endpoint: str, status: int) -> float:
    return samples(srv).get(f'asyncside_http_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0.0)


class Paused:
    """Holds the server's engine between two steps, so nothing it queued can finish."""

    def __init__(self, srv: BackgroundServer) -> None:
        self.srv = srv
        self.held = threading.Event()
        self.release = threading.Event()
        self.future: Any = None

    async def _hold(self) -> None:
        async with self.srv.app.state.asyncside.batcher.paused():
            self.held.set()
            while not self.release.is_set():
                await asyncio.sleep(0.005)

    def __enter__(self) -> Paused:
        self.future = asyncio.run_coroutine_threadsafe(self._hold(), self.srv.loop)
        assert self.held.wait(30), "could not pause the engine"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.future.result(30)


async def health_until(srv: BackgroundServer, pred: Any) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        for _ in range(3000):
            health = (await http.get(srv.url + "/health")).json()
            if pred(health):
                return health
            await asyncio.sleep(0.01)
    raise AssertionError(f"health never matched: {health}")


# --- answers ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_scripted_reply_and_stop_sequence(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        full = await c.completions.create(model="scripted", prompt="hi", max_tokens=32)
        cut = await c.completions.create(model="scripted", prompt="hi", max_tokens=32, stop=[". "])
        short = await c.completions.create(model="scripted", prompt="hi", max_tokens=5)
    assert full.choices[0].text == "hello world. bye" and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len("hello world. bye") + 1  # the EOS counts
    assert cut.choices[0].text == "hello world" and cut.choices[0].finish_reason == "stop"
    assert short.choices[0].text == "hello" and short.choices[0].finish_reason == "length"


@pytest.mark.asyncio
async def test_tool_call_parsed_non_streaming(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        resp = await c.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS, max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.asyncio
async def test_tool_call_parsed_streaming(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        stream = await c.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=200,
            stream=True)
        chunks = [ch async for ch in stream]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "Let me look."  # the tool-call markup never reaches the content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.asyncio
async def test_tool_call_that_does_not_parse_stays_content(srv: BackgroundServer) -> None:
    async with client(srv) as c:
        resp = await c.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "broken tool please"}], tools=TOOLS,
            max_tokens=64)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == "<tool_call>\n{not json}\n</tool_call>"
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.asyncio
async def test_tool_choice_none_and_multi_turn_tool_messages(srv: BackgroundServer) -> None:
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    async with client(srv) as c:
        # tool_choice "none": the tools are not offered and nothing is parsed as a call
        resp = await c.chat.completions.create(model="scripted", messages=history[:1], tools=TOOLS,
                                               tool_choice="none", max_tokens=200)
        follow = await c.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=200)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await c.chat.completions.create(model="scripted", messages=history[:1], tools=TOOLS,
                                            tool_choice="required", max_tokens=8)
    assert resp.choices[0].message.tool_calls is None and "<tool_call>" in resp.choices[0].message.content
    # The assistant's call and the tool's answer went through the chat template.
    assert follow.usage.prompt_tokens > resp.usage.prompt_tokens


@pytest.mark.asyncio
async def test_chat_completions_alias_without_v1(srv: BackgroundServer) -> None:
    async with client(srv, base="") as c:
        resp = await c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        comp = await c.completions.create(model="scripted", prompt="hi")
    assert resp.choices[0].message.content == "hello world. bye"
    assert comp.choices[0].text == "hello world. bye"[:16]


@pytest.mark.asyncio
async def test_chat_template_kwargs_reach_the_template(srv: BackgroundServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with client(srv) as c:
        plain = await c.chat.completions.create(model="scripted", messages=messages, max_tokens=2)
        thinking = await c.chat.completions.create(model="scripted", messages=messages, max_tokens=2,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            await c.chat.completions.create(model="scripted", messages=messages, max_tokens=2,
                                            extra_body={"chat_template_kwargs": {"tools": []}})
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens + len("<think>\n")


@pytest.mark.asyncio
async def test_unsupported_parameters_are_400_by_name(srv: BackgroundServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with client(srv) as c:
        for extra, param in [({"frobnicate": 1}, "frobnicate"), ({"xtc_probability": 0.5}, "xtc_probability"),
                             ({"response_format": {"type": "json_object"}}, "response_format"),
                             ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options")]:
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model="scripted", messages=messages, max_tokens=2,
                                                stream="stream_options" in extra, extra_body=extra)
            assert info.value.body["param"] == param, info.value.body
            assert param.split(".")[0] in info.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await c.chat.completions.create(model="scripted", messages=messages, max_tokens=2, top_logprobs=3)
        with pytest.raises(openai.BadRequestError, match="echo"):
            await c.completions.create(model="scripted", prompt="x", max_tokens=2, echo=True)


# --- admission and limits ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_queue_full_answers_429_with_retry_after(tokenizer: Any) -> None:
    with server(tokenizer, max_batch=1, max_queue=1) as s:
        body = {"model": "scripted", "prompt": "hi", "max_tokens": 4}
        async with httpx.AsyncClient(timeout=60) as http:
            with Paused(s):
                # One slot and one queue place: two requests are taken, the third is refused.
                first = asyncio.ensure_future(http.post(s.url + "/v1/completions", json=body))
                second = asyncio.ensure_future(http.post(s.url + "/v1/completions", json=body))
                await health_until(s, lambda h: h["waiting_requests"] == 2)
                third = await http.post(s.url + "/v1/completions", json=body)
                assert third.status_code == 429, third.text
                assert int(third.headers["retry-after"]) >= 1
                assert third.json()["error"]["code"] == "server_busy"
                async with client(s) as c:
                    with pytest.raises(openai.RateLimitError):
                        await c.completions.create(model="scripted", prompt="hi", max_tokens=4)
            assert (await first).status_code == 200 and (await second).status_code == 200
        assert samples(s)['asyncside_rejected_requests_total{endpoint="/v1/completions"}'] == 2


@pytest.mark.asyncio
async def test_request_timeout_answers_504(tokenizer: Any) -> None:
    with server(tokenizer, request_timeout=0.3) as s:
        body = {"model": "scripted", "prompt": "hi", "max_tokens": 4}
        async with httpx.AsyncClient(timeout=60) as http:
            with Paused(s):  # the request can never finish: only the timeout ends it
                resp = await http.post(s.url + "/v1/completions", json=body)
                assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
                async with http.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as st:
                    lines = [line async for line in st.aiter_lines() if line.startswith("data: ")]
                assert json.loads(lines[-2][6:])["error"]["code"] == "timeout" and lines[-1] == "data: [DONE]"
            health = await health_until(s, lambda h: h["active_requests"] == 0 and h["waiting_requests"] == 0)
            assert health["audit"]["ok"]
            ok = await http.post(s.url + "/v1/completions", json=body)
            assert ok.status_code == 200
        assert samples(s)['asyncside_request_timeouts_total{endpoint="/v1/completions"}'] == 2
        assert requests_total(s, "/v1/completions", 504) == 2


def test_prompt_past_the_context_is_400_at_once(srv: BackgroundServer) -> None:
    steps = httpx.get(srv.url + "/health").json()["decode_steps"]
    # The scripted model's context is 1024 tokens.
    resp = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": "x" * 1020, "max_tokens": 10})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "1024" in err["message"]
    ids = list(range(97, 97 + 20)) * 50  # 1000 token ids
    resp = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "y" * 1010}], "max_tokens": 8})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    ok = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": ids, "max_tokens": 16})
    assert ok.status_code == 200
    assert httpx.get(srv.url + "/health").json()["decode_steps"] > steps  # only the one that fits ran


# --- hostile input and errors ------------------------------------------------------------------


@pytest.mark.parametrize("name, payload, param", [
    ("nested 100000 deep", b'{"model": "scripted", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("integer of 5000 digits", b'{"model": "scripted", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("lone surrogate in the prompt", b'{"model": "scripted", "prompt": "ab\\ud800cd"}', "prompt"),
    ("lone surrogate in a stop sequence", b'{"model": "scripted", "prompt": "x", "stop": ["\\udfff"]}', "stop"),
])
def test_hostile_completion_bodies_are_400(srv: BackgroundServer, name: str, payload: bytes,
                                           param: str | None) -> None:
    before = requests_total(srv, "/v1/completions", 500)
    resp = httpx.post(srv.url + "/v1/completions", content=payload, headers={"content-type": "application/json"})
    assert resp.status_code == 400, (name, resp.text[:300])
    assert resp.json()["error"]["param"] == param
    assert requests_total(srv, "/v1/completions", 500) == before


def test_lone_surrogate_in_chat_content_is_400(srv: BackgroundServer) -> None:
    payload = b'{"model": "scripted", "messages": [{"role": "user", "content": "hi \\ud83d"}]}'
    resp = httpx.post(srv.url + "/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert "surrogate" in resp.json()["error"]["message"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.asyncio
async def test_client_leaving_while_sending_its_body_is_499_and_quiet(srv: BackgroundServer) -> None:
    seen = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "asyncside", "asyncside.serving")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        before = requests_total(srv, "/v1/completions", 499)
        host, port = srv.host, srv.port
        with socket.create_connection((host, port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": "scripted", "prompt": "')
            await asyncio.sleep(0.05)
        for _ in range(3000):
            if requests_total(srv, "/v1/completions", 499) == before + 1:
                break
            await asyncio.sleep(0.01)
        assert requests_total(srv, "/v1/completions", 499) == before + 1
        assert requests_total(srv, "/v1/completions", 500) == 0
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    noisy = [r for r in seen.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]


@pytest.mark.asyncio
async def test_generation_errors_are_500_and_counted(srv: BackgroundServer) -> None:
    before = requests_total(srv, "/v1/completions", 500)
    errors = samples(srv).get('asyncside_generation_errors_total{endpoint="/v1/completions"}', 0.0)
    async with client(srv) as c:
        with pytest.raises(openai.InternalServerError, match="scripted failure"):
            await c.completions.create(model="scripted", prompt="explode", max_tokens=4)
        stream = await c.completions.create(model="scripted", prompt="explode now", max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="scripted failure"):
            async for _ in stream:
                pass
        ok = await c.completions.create(model="scripted", prompt="fine", max_tokens=4)  # the server goes on
    assert ok.choices[0].text == "hell"
    # The stream's status is counted when its task ends, which may be just after the client has
    # the error; it is 500 even though the client closed the connection without reading [DONE].
    for _ in range(1000):
        if requests_total(srv, "/v1/completions", 500) == before + 2:
            break
        await asyncio.sleep(0.01)
    assert requests_total(srv, "/v1/completions", 500) == before + 2
    assert samples(srv)['asyncside_generation_errors_total{endpoint="/v1/completions"}'] == errors + 2


@pytest.mark.asyncio
async def test_a_stream_that_sent_its_error_reports_that_status_though_the_client_then_leaves() -> None:
    # The OpenAI client closes the connection as soon as it reads an error event, before [DONE]:
    # the request failed with the error's status, it was not abandoned (499).
    error_sent = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        sent.append(body)
        if b'"error"' in body:
            error_sent.set()
            await asyncio.sleep(60)  # the client leaves while the server is still writing

    async def receive() -> dict[str, Any]:
        await error_sent.wait()
        return {"type": "http.disconnect"}

    async def produce(frame: Frame) -> int:
        await frame({"choices": [{"text": "he"}]})
        return await frame.error(500, {"error": {"message": "scripted failure"}})

    reported: list[int] = []
    scope: dict[str, Any] = {"type": "http"}
    with anyio.fail_after(30):
        await EventStream(produce, reported.append)(scope, receive, send)
    assert reported == [500]
    assert scope["state"]["asyncside_status"] == 500
    assert any(b"scripted failure" in body for body in sent)


def test_unexpected_exception_is_500_and_counted(tokenizer: Any) -> None:
    class Boom:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def encode(self, text: str, **kw: Any) -> list[int]:
            if "boom" in text:
                raise RuntimeError("tokenizer exploded")
            return self._inner.encode(text, **kw)

    model = make_model(tokenizer)
    model.tokenizer = Boom(tokenizer)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0))
    with BackgroundServer(app) as s:
        resp = httpx.post(s.url + "/v1/completions", json={"model": "scripted", "prompt": "boom"})
        assert resp.status_code == 500 and "tokenizer exploded" in resp.json()["error"]["message"]
        assert requests_total(s, "/v1/completions", 500) == 1


# --- CORS and the access log ---------------------------------------------------------------------


def test_cors_off_by_default_and_on_with_allow_origin(srv: BackgroundServer, tokenizer: Any) -> None:
    headers = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    off = httpx.options(srv.url + "/v1/chat/completions", headers=headers)
    assert "access-control-allow-origin" not in off.headers
    with server(tokenizer, allow_origins=("http://example.com",)) as s:
        pre = httpx.options(s.url + "/v1/chat/completions", headers=headers)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://example.com"
        resp = httpx.post(s.url + "/v1/completions", json={"model": "scripted", "prompt": "hi"},
                          headers={"Origin": "http://example.com"})
        assert resp.headers["access-control-allow-origin"] == "http://example.com"
        other = httpx.options(s.url + "/v1/chat/completions",
                              headers={**headers, "Origin": "http://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_one_access_log_line_per_request(srv: BackgroundServer) -> None:
    seen = _Records()
    access = logging.getLogger("asyncside.access")
    old = access.level
    access.setLevel(logging.INFO)
    access.addHandler(seen)
    try:
        httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": "hi", "max_tokens": 3})
        httpx.get(srv.url + "/v1/models")
        httpx.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    finally:
        access.removeHandler(seen)
        access.setLevel(old)
    lines = [r.getMessage() for r in seen.records]
    assert len(lines) == 3, lines
    assert '"POST /v1/completions" 200' in lines[0] and "prompt=2 cached=0 completion=3" in lines[0]
    assert '"GET /v1/models" 200' in lines[1]
    assert '"POST /v1/completions" 404' in lines[2]


# --- the engine, without HTTP -------------------------------------------------------------------


@pytest.mark.anyio
async def test_long_prefill_never_holds_a_stream_for_more_than_one_chunk(tokenizer: Any) -> None:
    """While a long prompt prefills, a decoding request gets a token every engine step, and at
    most one chunk of prefill runs between two of its tokens."""
    model = make_model(tokenizer)
    model.config["max_position_embeddings"] = 4096
    chunk = 16
    b = Batcher(model, None, max_batch=4, prefill_chunk=chunk, prompt_cache_size=0)
    prefill_at: list[int] = []
    long_done: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        short = b.submit(tokenizer.encode("count"), 40)
        long = b.submit(tokenizer.encode("z" * 300), 2)

        async def read_long() -> None:
            async for _ in long:
                long_done.append(b.prefill_tokens)

        tg.start_soon(read_long)
        async for _ev in short:
            prefill_at.append(b.prefill_tokens)
        tg.cancel_scope.cancel()
    assert long_done, "the long request never produced a token"
    gaps = [b2 - a for a, b2 in zip(prefill_at, prefill_at[1:])]
    assert max(gaps) <= chunk, gaps
    # The long prompt's prefill (299 tokens) really happened while the short one streamed.
    assert prefill_at[0] < 299 <= prefill_at[-1]


@pytest.mark.anyio
async def test_short_prompts_prefill_first_and_a_long_one_still_advances(tokenizer: Any) -> None:
    model = make_model(tokenizer)
    model.config["max_position_embeddings"] = 4096
    b = Batcher(model, None, max_batch=8, prefill_chunk=16, prompt_cache_size=0)
    long_ids = tokenizer.encode("z" * 300)
    progress: list[int] = []  # the long prompt's tokens still to prefill, at each short request's first token
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        long = b.submit(long_ids, 1)
        for i in range(6):  # short requests keep arriving while the long one prefills
            short = b.submit(tokenizer.encode(f"count {i} " * 3), 2)
            async for _ in short:
                progress.append(len(b._active[0].todo) if b._active and b._active[0] is long._slot else 0)
                break
            short.cancel()
        async for _ in long:
            pass
        tg.cancel_scope.cancel()
    assert all(p > 0 for p in progress), progress  # each short one answered while the long one still prefilled
    assert progress == sorted(progress, reverse=True) and progress[0] > progress[-1]  # and the long one advanced
    assert long.finish_reason == "length"


@pytest.mark.anyio
async def test_engine_admission_cancel_and_failure_isolation(tokenizer: Any) -> None:
    model = make_model(tokenizer)
    b = Batcher(model, None, max_batch=1, max_queue=1, prefill_chunk=8, prompt_cache_size=0)
    a = b.submit(tokenizer.encode("hi"), 3)
    queued = b.submit(tokenizer.encode("hi"), 3)
    with pytest.raises(QueueFull) as info:
        b.submit(tokenizer.encode("hi"), 3)
    assert info.value.retry_after >= 1
    queued.cancel()  # leaves the queue at once
    assert b.waiting == 1
    bad = b.submit(tokenizer.encode("explode"), 3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        got = [ev.token async for ev in a]
        from asyncside.serving.engine import GenerationFailed

        with pytest.raises(GenerationFailed, match="scripted failure"):
            async for _ in bad:
                pass
        after = [ev.token async for ev in b.submit(tokenizer.encode("hi"), 3, SamplingParams())]
        tg.cancel_scope.cancel()
    assert tokenizer.decode(got) == "hel" and tokenizer.decode(after) == "hel"
    assert a.finish_reason == "length" and bad.finish_reason == "error"
    assert b.active == 0 and b.waiting == 0

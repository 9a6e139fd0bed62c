"""Unit tests of the server's pure parts: request parsing, text assembly, Prometheus rendering.

No model and no HTTP here; the server itself is tested end to end, with the real embedded model
and real clients, in tests/test_serve.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from asyncside.serving import protocol as oai
from asyncside.serving.metrics import Registry, format_value
from asyncside.serving.text import TextAssembler

MODELS = ["m"]


def parse_completion(body: object) -> oai.CompletionRequest:
    return oai.parse_completion(body, served_models=MODELS, default_max_tokens=16, max_tokens_limit=64)


def parse_chat(body: object) -> oai.CompletionRequest:
    return oai.parse_chat(body, served_models=MODELS, default_max_tokens=32, max_tokens_limit=64)


def test_completion_prompt_forms() -> None:
    assert parse_completion({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompt_ids == (1, 2)
    assert parse_completion({"model": "m", "prompt": [[3]]}).prompt_ids == (3,)
    req = parse_completion({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True},
                            "stop": "\n", "temperature": 0.7, "max_tokens": 5})
    assert (req.stream, req.include_usage, req.stop, req.max_tokens) == (True, True, ("\n",), 5)
    assert parse_completion({"model": "m", "prompt": "x"}).max_tokens == 16


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ([], 400, None, "JSON object"),
        ({"prompt": "x"}, 400, "model", "required"),
        ({"model": 3, "prompt": "x"}, 400, "model", "string"),
        ({"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
        ({"model": "m"}, 400, "prompt", "required"),
        ({"model": "m", "prompt": ""}, 400, "prompt", "empty"),
        ({"model": "m", "prompt": ["a", "b"]}, 400, "prompt", "2 prompts"),
        ({"model": "m", "prompt": [1, -2]}, 400, "prompt", "prompt[1]"),
        ({"model": "m", "prompt": 5}, 400, "prompt", "got int"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"model": "m", "prompt": "x", "max_tokens": 65}, 400, "max_tokens", "at most 64"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
        ({"model": "m", "prompt": "x", "n": 2}, 400, "n", "must be 1"),
        ({"model": "m", "prompt": "x", "temperature": 3}, 400, "temperature", "[0, 2]"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
        ({"model": "m", "prompt": "x", "echo": True}, 400, "echo", "not supported"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
        ({"model": "m", "prompt": "x", "stop": [1]}, 400, "stop", "strings"),
    ],
)
def test_completion_rejects(body: object, status: int, param: str | None, words: str) -> None:
    with pytest.raises(oai.RequestError) as info:
        parse_completion(body)
    err = info.value
    assert (err.status, err.param) == (status, param)
    assert words in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_parsing_and_template() -> None:
    req = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ], "max_completion_tokens": 7})
    assert req.max_tokens == 7 and req.kind == "chat"
    assert [m.content for m in req.messages] == ["be brief", "hi there"]
    assert oai.simple_chat_template(req.messages) == "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).max_tokens == 32


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools"),
    ],
)
def test_chat_rejects(body: object, param: str) -> None:
    with pytest.raises(oai.RequestError) as info:
        parse_chat(body)
    assert info.value.status == 400 and info.value.param == param


class ByteTokenizer:
    """UTF-8 bytes as token ids, 256 = EOS (the shape of the embedded model's tokenizer)."""

    eos_token_ids = {256}

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def feed(asm: TextAssembler, text: str) -> list[str]:
    out = []
    for t in text.encode():
        out.append(asm.push(t))
        if asm.finished:
            break
    return out


def test_text_assembler_holds_incomplete_utf8() -> None:
    asm = TextAssembler(ByteTokenizer())
    deltas = feed(asm, "aé€")
    assert deltas == ["a", "", "é", "", "", "€"]  # no replacement character ever released
    assert asm.flush() == "" and asm.finish_reason == "length" and asm.completion_tokens == 6


def test_text_assembler_stop_sequence_is_held_back_and_cut() -> None:
    asm = TextAssembler(ByteTokenizer(), stop=("END",))
    deltas = feed(asm, "abENxEND tail")
    assert "".join(deltas) == "abENx" and asm.text == "abENx"
    assert asm.finished and asm.finish_reason == "stop"
    assert all("END" not in d for d in deltas)


def test_text_assembler_eos_and_flush_of_held_prefix() -> None:
    asm = TextAssembler(ByteTokenizer(), stop=("xyz",))
    assert [asm.push(t) for t in b"ax"] == ["a", ""]  # 'x' might start the stop sequence
    assert asm.push(256) == "x" and asm.finish_reason == "stop"
    asm2 = TextAssembler(ByteTokenizer(), stop=("xyz",))
    feed(asm2, "ax")
    assert asm2.flush() == "x" and asm2.finish_reason == "length"


def test_prometheus_text_format() -> None:
    r = Registry()
    c = r.counter("req_total", "requests", ("endpoint", "status"))
    c.inc(endpoint="/a", status="200")
    c.inc(2, endpoint='/b"q', status="400")
    h = r.histogram("lat_seconds", "latency", (0.1, 1))
    for v in (0.05, 0.5, 5):
        h.observe(v)
    r.gauge("active", "active now", lambda: 3)
    text = r.render()
    assert '# TYPE req_total counter\n' in text
    assert 'req_total{endpoint="/a",status="200"} 1\n' in text
    assert 'req_total{endpoint="/b\\"q",status="400"} 2\n' in text
    assert 'lat_seconds_bucket{le="0.1"} 1\nlat_seconds_bucket{le="1"} 2\nlat_seconds_bucket{le="+Inf"} 3\n' in text
    assert "lat_seconds_count 3\n" in text and "active 3\n" in text
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1, endpoint="/a", status="200")
    with pytest.raises(ValueError, match="labels"):
        c.inc(endpoint="/a")
    assert format_value(math.inf) == "+Inf" and format_value(2.0) == "2" and format_value(0.25) == "0.25"


@pytest.mark.parametrize("parse, base", [
    (parse_completion, {"model": "m", "prompt": "x"}),
    (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_openai_fields_that_change_nothing_are_accepted_and_ignored(parse: Any, base: dict[str, Any]) -> None:
    plain = parse(dict(base))
    extra = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "safety_identifier": "u1",
             "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prediction": {"type": "content", "content": "x"}}
    assert parse({**base, **extra}) == plain
    assert parse({**base, "stream": True, "stream_options": {"include_obfuscation": False}}).stream
    with pytest.raises(oai.RequestError) as info:
        parse({**base, "store": "yes"})
    assert info.value.param == "store" and "boolean" in info.value.message
    # Fields that would change the answer's shape stay refused, by name.
    for key, value in [("modalities", ["text", "audio"]), ("audio", {"voice": "x"}), ("functions", [])]:
        with pytest.raises(oai.RequestError) as info:
            parse({**base, key: value})
        assert info.value.status == 400 and info.value.param == key


def test_prompt_cache_is_bounded_in_bytes() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from asyncside.serving.prompt_cache import PrefixCache, cache_nbytes

    def cache(n: int) -> list[KVCache]:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
        return [c]

    one = cache_nbytes(cache(20))
    assert one > 0
    pc = PrefixCache(max_entries=100, min_tokens=1, max_bytes=3 * one)
    for i in range(10):
        pc.insert([1000 + i] + list(range(19)), cache(20))
        assert pc.nbytes <= 3 * one
    assert len(pc) == 3 and pc.nbytes == 3 * one
    pc.insert(list(range(5000)), cache(5000))  # larger than the whole bound: not kept
    assert len(pc) == 3
    pc.clear()
    assert pc.nbytes == 0 and len(pc) == 0

"""Serving on unseen inputs, round 12: the server as the openai Python client meets it, on text whose
characters a byte-level tokenizer splits across tokens (``café``, CJK, an emoji), with logprobs
asked for, streamed and not; and ``serve`` options given from shell variables that were unset.

The model is scripted (tests/_serving_support.py): its reply is known exactly, so the bytes and
offsets the logprobs give can be checked against it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app
from tests._cli_support import run_cli

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: a reply whose characters take 2, 3 and 4 bytes: one byte-level token each byte
REPLY = "café 日本 🎉!"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tokenizer = byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    app = create_app(scripted_engine(ScriptedModel(tokenizer, REPLY)), ServeSettings(prompt_cache_size=0))
    with BackgroundServer(app) as s:
        yield s


def client(srv: BackgroundServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(srv: BackgroundServer) -> None:
    """OpenAI's ``bytes`` is there to join tokens that split a character. Each byte token of ``é``,
    ``日`` or ``🎉`` gave the bytes of U+FFFD (its text decoded alone), so the joined bytes of
    "café" were b"caf\\xef\\xbf\\xbd\\xef\\xbf\\xbd": the token's own bytes now, alternatives too."""

    async def go() -> None:
        async with client(srv) as c:
            kw: dict[str, Any] = dict(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=40, logprobs=True, top_logprobs=2)
            whole = await c.chat.completions.create(**kw)
            assert whole.choices[0].message.content == REPLY
            entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
            assert b"".join(bytes(e.bytes or []) for e in entries) == REPLY.encode()
            e_acute = [e for e in entries if e.bytes and e.bytes[0] >= 0x80][:2]
            assert [e.bytes for e in e_acute] == [[0xC3], [0xA9]]
            for e in entries:  # the chosen token is among the top two: the same bytes there
                assert any(t.bytes == e.bytes for t in e.top_logprobs), e
            streamed = []
            async for ch in await c.chat.completions.create(stream=True, **kw):
                if ch.choices and ch.choices[0].logprobs is not None:
                    streamed += ch.choices[0].logprobs.content or []
            assert b"".join(bytes(e.bytes or []) for e in streamed) == REPLY.encode()

    anyio.run(go)


def test_streamed_text_offsets_count_earlier_chunks(srv: BackgroundServer) -> None:
    """Completions' ``text_offset`` was 0 in every streamed chunk (each chunk counted from its own
    start); a stream now gives each token the offset the whole answer gives it."""

    async def go() -> None:
        async with client(srv) as c:
            kw: dict[str, Any] = dict(model="scripted", prompt="hi", max_tokens=40, logprobs=1)
            whole = (await c.completions.create(**kw)).choices[0].logprobs
            assert whole is not None and whole.text_offset is not None
            offsets: list[int] = []
            async for ch in await c.completions.create(stream=True, **kw):
                if ch.choices and ch.choices[0].logprobs is not None:
                    offsets += ch.choices[0].logprobs.text_offset or []
            assert offsets == whole.text_offset
            assert offsets[:6] == [0, 1, 2, 3, 3, 4]  # "caf", both bytes of "é", " "

    anyio.run(go)


def test_text_offsets_index_the_text_past_characters_split_across_tokens(srv: BackgroundServer) -> None:
    """Each ``text_offset`` was the sum of the earlier tokens' own texts, U+FFFD for each byte
    token of a character: after "é" (two tokens) every offset was one past its character, after
    "🎉" (four) four past, and the last ones past the end of the text. A token's offset is now
    where its character starts in the text, the bytes of one character sharing it."""

    async def go() -> None:
        async with client(srv) as c:
            choice = (await c.completions.create(model="scripted", prompt="hi", max_tokens=40, logprobs=1)).choices[0]
            assert choice.text == REPLY and choice.logprobs is not None
            offsets = choice.logprobs.text_offset or []
            raw = REPLY.encode()
            assert len(offsets) == len(raw)  # one byte-level token per byte
            for i, at in enumerate(offsets):  # the character the token's byte belongs to starts there
                assert REPLY[at].encode() == raw[len(REPLY[:at].encode()):][:len(REPLY[at].encode())], (i, at)
                assert len(REPLY[:at].encode()) <= i < len(REPLY[:at + 1].encode()), (i, at)
            assert offsets[-1] == len(REPLY) - 1

    anyio.run(go)


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--api-key", "", "argument --api-key: expected a key, got '' (an empty key would leave every endpoint open"),
    ("--api-key", "two words", "argument --api-key: expected a key of printable characters without spaces"),
    ("--host", "", "argument --host: expected an interface to bind (127.0.0.1; 0.0.0.0 for every interface), got ''"),
    ("--host", " ", "argument --host: expected an interface to bind"),
])
def test_serve_refuses_an_empty_key_or_host(tmp_path: Any, option: str, value: str, said: str,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --api-key "$KEY"`` with KEY unset served every endpoint without a key and without a
    word (an empty key was read as none given); ``--host "$HOST"`` with HOST unset bound every
    interface (uvicorn's reading of ''). Both are usage errors now, before anything loads; a key
    with a space was refused only once the settings were made, naming ServeSettings.api_key."""
    monkeypatch.delenv("ASYNCSIDE_API_KEY", raising=False)
    rc, err = run_cli(capsys, "serve", str(tmp_path / "no-such-store"), option, value)
    assert rc == 2 and said in err, err
    assert "no-such-store" not in err

"""A scripted model for server tests that need exact control over what the model says.

:class:`ScriptedModel` answers every prompt with a fixed reply (chosen by a substring of the
prompt), one token per decode step, then EOS. It speaks the engine's model interface (``forward``
awaited per step with a KV cache of its own, ``make_cache``, ``tokenizer``) with the embedded
model's real byte-level tokenizer (chat template, tool-call format), so everything between the
HTTP request and the model runs for real: parsing, admission, the engine loop, sampling, text
assembly, tool-call parsing, SSE.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import mlx.core as mx

from asyncside.models.tokenizer import load_tokenizer, save_byte_level_tokenizer
from asyncside.serving import Engine

VOCAB = 512
EOS = 257


def byte_tokenizer(directory: pathlib.Path) -> Any:
    """The embedded model's tokenizer (mlx-lm's TokenizerWrapper over tokenizer.json), written to ``directory``."""
    save_byte_level_tokenizer(directory)
    return load_tokenizer(directory, {"eos_token_id": EOS})


@dataclass
class _Cache:
    tokens: list[int] = field(default_factory=list)
    replied: int = 0

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def is_trimmable(self) -> bool:
        return False


class _Forward:
    def __init__(self, model: ScriptedModel) -> None:
        self.model = model

    async def completed(self, x: mx.array) -> None:
        mx.eval(x)

    def make_predictor(self, name: str) -> None:
        return None

    # The step protocol of AsyncForward (context, step, finish), as the engine's decode step uses it.
    def context(self, cache: list[_Cache], source: Any, predictor: Any = None) -> tuple[Any, Any, Any]:
        return cache, source, predictor

    async def step(self, ctx: tuple[Any, Any, Any], inputs: mx.array, *, logits: bool = True,
                   finish: bool = True, head: Any = None) -> Any:
        out = await self(inputs, *ctx, logits=logits)
        return out if head is None else head(out)

    async def finish(self, ctx: tuple[Any, Any, Any], y: mx.array | None) -> None:
        if y is not None:  # a prefill chunk's hidden state: this model computes none
            mx.eval(y)

    async def __call__(self, inputs: mx.array, cache: list[_Cache], source: Any, predictor: Any, *,
                       logits: bool = True) -> Any:
        m = self.model
        if m.step_delay:
            await anyio.sleep(m.step_delay)
        c = cache[0]
        c.tokens.extend(int(t) for t in inputs.reshape(-1).tolist())
        m.forwards += 1
        prompt = m.tokenizer.decode(c.tokens)
        if m.fail_when and m.fail_when in prompt:
            raise RuntimeError(f"scripted failure ({m.fail_when!r} in the prompt)")
        if not logits:
            return None
        reply = m.reply_for(prompt)
        token = reply[c.replied] if c.replied < len(reply) else EOS
        c.replied += 1
        out = mx.full((1, inputs.shape[-1], VOCAB), -1e9)
        out[..., token] = 0.0
        return out


class ScriptedModel:
    """Replies ``replies[key]`` to a prompt containing ``key`` (the first that matches), else ``default``."""

    def __init__(self, tokenizer: Any, default: str = "ok", replies: Mapping[str, str] | None = None, *,
                 context: int = 1024, fail_when: str | None = None, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.model_id = "scripted"
        self.config: dict[str, Any] = {"vocab_size": VOCAB, "max_position_embeddings": context}
        self.default = default
        self.replies = dict(replies or {})
        self.fail_when = fail_when
        self.step_delay = step_delay  # seconds each forward sleeps (streams that stay in flight a while)
        self.forwards = 0
        self.forward = _Forward(self)

    def reply_for(self, prompt: str) -> list[int]:
        for key, text in self.replies.items():
            if key in prompt:
                return list(self.tokenizer.encode(text))
        return list(self.tokenizer.encode(self.default))

    def make_cache(self) -> list[_Cache]:
        return [_Cache()]


def scripted_engine(model: ScriptedModel) -> Any:
    """An engine factory serving ``model`` (no expert source, a clean audit)."""

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[Engine]:
        yield Engine(model=model, source=None, audit=lambda: (True, []), description={"model": "scripted"})

    return factory


def raw_request(body: dict[str, Any], extra: str = "") -> bytes:
    """A whole POST /v1/completions of ``body`` as bytes on the wire (``extra``: header lines, each
    ending in CRLF), for tests that speak HTTP over a socket of their own."""
    raw = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}\r\n").encode() + raw


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes the connection; the socket's own
    timeout running out fails the test (the server held the connection)."""
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return out
        except TimeoutError:
            raise AssertionError(f"the server still held the connection after {sock.gettimeout():g} s; "
                                 f"got {out[:200]!r}") from None
        if not data:
            return out
        out += data


def read_stream(url: str, started: threading.Event, *, max_tokens: int, timeout: float,
                status: int | None = None) -> dict[str, Any]:
    """A streamed completion of the scripted model's "count" reply from the server at ``url``:
    ``{"events": [...], "done": bool}``, the events in order (a ``{"broken": ...}`` one last where
    the connection broke) and whether ``data: [DONE]`` came. ``started`` is set at the first
    event; ``status``: the status the answer must have."""
    events: list[Any] = []
    done = False
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=timeout,
                          json={"model": "scripted", "prompt": "count", "max_tokens": max_tokens,
                                "stream": True}) as r:
            if status is not None:
                assert r.status_code == status, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
                    started.set()
    except httpx.HTTPError as exc:
        events.append({"broken": repr(exc)})
    return {"events": events, "done": done}

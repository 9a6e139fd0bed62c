"""Serving behind a load balancer, round 14b: what a readiness probe sees while the server drains,
a keep-alive longer than the proxies' idle timeouts, and a request body limit a long-context
prompt fits.

The model is the scripted one (tests/_serving_support.py); everything between the socket and the
model is the real code.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: how long a connection gets to send its request, in these tests
READ_TIMEOUT = 0.3
#: what a socket read waits at most before the test says the server held the connection
HELD = 30.0


def _server(tmp: Any, **settings: Any) -> BackgroundServer:
    model = ScriptedModel(byte_tokenizer(tmp), "hello", context=settings.pop("context", 1024))
    return BackgroundServer(create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, **settings)))


def _request(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


def _answer(sock: socket.socket) -> bytes:
    """One whole answer (with its Content-Length) read from ``sock``; b"" if the server closed it."""
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        if not data:
            return got
        got += data
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        data = sock.recv(65536)
        assert data, got
        body += data
    return head + b"\r\n\r\n" + body


def _read_to_close(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return out
        except TimeoutError:
            raise AssertionError(f"the server still held the connection after {HELD:g} s; got {out[:200]!r}") from None
        if not data:
            return out
        out += data


# -- /health while draining -------------------------------------------------------------------------


def test_health_answers_503_draining_once_the_drain_began(tmp_path: Any) -> None:
    """After SIGTERM the server refuses new requests with 503, but /health still answered 200 "ok":
    a load balancer or a readiness probe kept sending it traffic that then got 503. /health now
    answers 503 with status "draining" and the other 503s' Retry-After, its body otherwise as
    before; /metrics and /v1/models still answer (the process is alive)."""
    srv = _server(tmp_path, shutdown_grace=7).start()
    try:
        before = httpx.get(srv.url + "/health")
        assert before.status_code == 200 and before.json()["status"] == "ok"
        state = srv.app.state.asyncside
        srv.call(lambda: state.drain(0.0))  # nothing in flight: the drain has begun and stays on
        refused = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": "hi"})
        assert refused.status_code == 503
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "draining" and set(body) == set(before.json()), body
        assert r.headers["retry-after"] == refused.headers["retry-after"] == "7"
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert 'asyncside_http_requests_total{endpoint="/health",status="503"} 1' in \
            httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()

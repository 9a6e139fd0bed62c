"""Serving behind a load balancer, round 14b: what a readiness probe sees while the server drains,
a keep-alive longer than the proxies' idle timeouts, and a request body limit a long-context
prompt fits.

The model is the scripted one (tests/_serving_support.py); everything between the socket and the
model is the real code.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, raw_request, read_to_close, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: how long a connection gets to send its request, in these tests
READ_TIMEOUT = 0.3
#: what a socket read waits at most before the test says the server held the connection
HELD = 30.0


def _server(tmp: Any, **settings: Any) -> BackgroundServer:
    model = ScriptedModel(byte_tokenizer(tmp), "hello", context=settings.pop("context", 1024))
    return BackgroundServer(create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, **settings)))


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


# -- keep-alive ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """A server whose idle connections are kept far longer than a request may take to arrive."""
    with _server(tmp_path_factory.mktemp("tok"), request_read_timeout=READ_TIMEOUT, keep_alive=HELD * 2) as srv:
        yield srv


def test_the_keep_alive_setting_reaches_uvicorn_and_outlasts_common_proxies() -> None:
    """uvicorn's keep-alive (5 s) could not be set, and is shorter than nginx's upstream keepalive
    and an AWS ALB's idle timeout (60 s): the proxy reused a connection the server had just closed
    and its client got a 502. The default now outlasts them, and it reaches uvicorn."""
    from asyncside.serving.background import _uvicorn_server

    assert ServeSettings().keep_alive > 60
    app = create_app(scripted_engine(ScriptedModel(None)), ServeSettings(keep_alive=12.5))
    assert _uvicorn_server(app, "warning").config.timeout_keep_alive == 12.5
    with pytest.raises(ValueError, match="ServeSettings.keep_alive"):
        ServeSettings(keep_alive=-1)


def test_an_idle_connection_is_kept_past_the_request_read_timeout(kept: BackgroundServer) -> None:
    """The request read timeout (the time a connection has to send a whole request) also ran
    between requests, so an idle kept-alive connection was closed after it whatever the keep-alive
    said. Between requests the keep-alive bounds the wait; a request still has the read timeout
    from its first byte (the next test)."""
    with socket.create_connection((kept.host, kept.port)) as sock:
        sock.settimeout(HELD)
        body = {"model": "scripted", "prompt": "hi", "max_tokens": 3}
        sock.sendall(raw_request(body))
        first = _answer(sock)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        time.sleep(READ_TIMEOUT * 4)  # idle, well within the keep-alive
        sock.sendall(raw_request(body))
        second = _answer(sock)
        assert second.startswith(b"HTTP/1.1 200"), second[:200]
        assert json.loads(second.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == "hel"


def test_a_request_that_stalls_after_an_idle_wait_is_still_closed(kept: BackgroundServer) -> None:
    """A kept-alive connection whose next request begins and then stalls is closed once the read
    timeout has passed from its first byte, not held for the keep-alive."""
    with socket.create_connection((kept.host, kept.port)) as sock:
        sock.settimeout(HELD)
        sock.sendall(raw_request({"model": "scripted", "prompt": "hi", "max_tokens": 2}))
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        assert read_to_close(sock) == b""


@pytest.mark.parametrize("text, value", [("75", 75.0), ("120.5", 120.5), ("0", 0.0)])
def test_keep_alive_on_the_command_line(text: str, value: float) -> None:
    from asyncside.cli import build_parser
    from asyncside.serving.settings import settings_from_args

    args = build_parser(["serve"]).parse_args(["serve", "--keep-alive", text])
    assert settings_from_args(args).keep_alive == value
    default = build_parser(["serve"]).parse_args(["serve"])
    assert settings_from_args(default).keep_alive == ServeSettings().keep_alive


@pytest.mark.parametrize("bad", ["-1", "soon", "inf", "nan", ""])
def test_a_bad_keep_alive_is_a_one_line_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser(["serve"]).parse_args(["serve", "--keep-alive", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("asyncside serve: error: argument --keep-alive: expected seconds >= 0"), err
    assert "Traceback" not in "\n".join(err)


# -- the request body limit ---------------------------------------------------------------------------


def test_a_body_past_the_limit_is_told_which_option_raises_it(tmp_path: Any) -> None:
    with _server(tmp_path, max_body_bytes=64 * 1024) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "scripted", "prompt": [100] * 20_000})
        assert r.status_code == 413
        assert "--max-request-bytes" in r.json()["error"]["message"], r.text


def test_a_prompt_of_the_models_context_as_token_ids_fits_the_default_limit(tmp_path: Any) -> None:
    """The body limit was 1 MiB whatever the model: a prompt of a long-context model's length as
    token ids (a 262144-token Qwen3-Coder context, DeepSeek-V3's 163840: several bytes an id) got
    413. The default now follows the served context: a prompt of it as JSON ids fits."""
    context = 300_000  # ids of this vocabulary are up to 3 digits: 5 bytes each with ", "
    with _server(tmp_path, context=context, prefill_chunk=1 << 17) as srv:
        prompt = [100] * (context - 1)
        assert len(json.dumps({"prompt": prompt})) > 1 << 20
        r = httpx.post(srv.url + "/v1/completions", timeout=HELD * 4,
                       json={"model": "scripted", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["prompt_tokens"] == context - 1
        over = httpx.post(srv.url + "/v1/completions", content=b" " * (1 << 21),
                          headers={"content-type": "application/json"})
        assert over.status_code == 413 and "--max-request-bytes" in over.json()["error"]["message"]


def test_max_request_bytes_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import build_parser
    from asyncside.serving.settings import settings_from_args

    parse = build_parser(["serve"]).parse_args
    assert settings_from_args(parse(["serve", "--max-request-bytes", "8M"])).max_body_bytes == 8 << 20
    assert settings_from_args(parse(["serve"])).max_body_bytes is None  # follows the model's context
    for bad in ("0", "-1M", "lots", "4Q"):
        with pytest.raises(SystemExit) as info:
            parse(["serve", "--max-request-bytes", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("asyncside serve: error: argument --max-request-bytes: "), err

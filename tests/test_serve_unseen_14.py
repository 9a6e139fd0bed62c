"""Serving to clients, proxies and process managers that are not ours, round 14: what a
wrong method is told.

The model is the scripted one (tests/_serving_support.py); everything between the socket and the
model is the real code.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.serving import BackgroundServer, ServeSettings, create_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LONG = "one two three four five six seven eight nine ten " * 2


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tok = byte_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    model = ScriptedModel(tok, "hello", {"count": LONG}, step_delay=0.02)
    app = create_app(scripted_engine(model), ServeSettings(prompt_cache_size=0, max_tokens_limit=256))
    with BackgroundServer(app) as server:
        yield server


@pytest.mark.parametrize("method, path, allowed", [("DELETE", "/health", {"GET", "HEAD"}),
                                                   ("GET", "/v1/completions", {"POST"}),
                                                   ("PUT", "/v1/chat/completions", {"POST"})])
def test_a_wrong_method_is_told_which_methods_the_route_takes(srv: BackgroundServer, method: str, path: str,
                                                              allowed: set[str]) -> None:
    """A 405 must carry ``Allow`` (HTTP): the server's own error handler dropped Starlette's."""
    r = httpx.request(method, srv.url + path)
    assert r.status_code == 405 and r.json()["error"]["message"] == f"method {method} not allowed on {path}"
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed

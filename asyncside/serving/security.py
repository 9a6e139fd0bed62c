"""Who may ask what: the API key, a bound on request headers, and keeping host paths private.

:class:`Guard` is ASGI middleware in front of every route. It answers 431 to a request whose
headers exceed ``max_header_bytes``; with an API key configured, it answers 401 (with
``WWW-Authenticate: Bearer``) to any request but ``GET /health`` that does not carry
``Authorization: Bearer <key>``, comparing in constant time. Whether the request carried the key
is left in ``scope["state"]["asyncside_authenticated"]`` for ``/health``, which names files of
the host only to an authenticated client (:func:`public_text` strips them otherwise).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


def _reply(status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, object]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return {"status": status, "body": body, "headers": [(b"content-type", b"application/json"),
                                                        (b"content-length", str(len(body)).encode()),
                                                        *(headers or [])]}


def bearer_matches(header: bytes | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (constant time in the key)."""
    if header is None:
        return False
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key)


class Guard:
    """ASGI middleware: header size bound and API key (see the module docstring).

    ``on_refused(path, status)`` is called for every request it answers itself (metrics).
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_header_bytes: int,
                 on_refused: Callable[[str, int], None] | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_header_bytes = max_header_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
        if size > self.max_header_bytes:
            await self._send(scope, send, _reply(431, f"request headers are {size} bytes; the limit is "
                                                      f"{self.max_header_bytes}", "headers_too_large"))
            return
        authorized = self.key is not None and bearer_matches(
            next((v for k, v in headers if k == b"authorization"), None), self.key)
        scope.setdefault("state", {})["asyncside_authenticated"] = authorized
        if self.key is not None and not authorized and scope["path"] not in OPEN_PATHS \
                and scope["method"] != "OPTIONS":  # CORS preflights carry no credentials
            await self._send(scope, send, _reply(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key",
                [(b"www-authenticate", b'Bearer realm="asyncside"')]))
            return
        await self.app(scope, receive, send)

    async def _send(self, scope: Scope, send: Send, reply: dict[str, object]) -> None:
        status = reply["status"]
        assert isinstance(status, int)
        scope.setdefault("state", {})["asyncside_status"] = status
        if self.on_refused is not None:
            self.on_refused(scope["path"], status)
        await send({"type": "http.response.start", "status": status, "headers": reply["headers"]})
        await send({"type": "http.response.body", "body": reply["body"]})


def public_text(text: str, private_dirs: list[str]) -> str:
    """``text`` with each of ``private_dirs`` (absolute directories of the host) shortened to its
    last component, so a message names a store's files without saying where the store is."""
    for d in sorted((d.rstrip("/") for d in private_dirs if d and d != "/"), key=len, reverse=True):
        text = text.replace(d + "/", os.path.basename(d) + "/").replace(d, os.path.basename(d))
    return text

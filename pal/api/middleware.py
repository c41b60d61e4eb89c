"""ASGI middleware of the API: a request id on every request, a size limit on every
request body checked before anything parses it, and ids in paths checked before routing.

Request ids: each request gets one (``req-<16 hex>``, or the client's own ``X-Request-Id``
when it is a short safe token), answered in the ``X-Request-Id`` header and in every error
body, and put on every log line written while the request runs (``RequestIdFilter``), so
an error a user reports can be found in the server log. Errors never carry host paths or
QEMU output: those details stay in the log under that id (errors.py).

Ids in paths (``IdPathMiddleware``): the segment that names a VM (``/v1/runtime/vms/{id}``,
the dashboard's ``/runtime/{id}``) and a code context (``.../code/contexts/{id}``) must be
an id (pal/ids.py), checked on the raw path before any route is matched: ``%2F`` in it
would otherwise become a ``/`` and the request another route (an id pasted into a URL by a
client: ``vm-1/resume?x=`` must never resume vm-1). Anything else is 400.

Body limit: ``MAX_BODY_BYTES`` for any request body (JSON requests are far smaller; a file
upload is capped lower by its route). A declared Content-Length over it is refused with 413
before a byte is read; a chunked body is counted as it streams and cut off at the limit.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import unquote

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pal.errors import InvalidRequest, PalError, TooLarge
from pal.ids import CONTEXT_ID_PATTERN, is_safe_id

REQUEST_ID_HEADER = "x-request-id"
MAX_BODY_BYTES = 2 * 1024 * 1024
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pal_request_id", default=None)


def new_request_id() -> str:
    return "req-" + secrets.token_hex(8)


def current_request_id() -> str | None:
    return request_id.get()


class RequestIdFilter(logging.Filter):
    """Prefixes a record's message with ``[<request id>]`` while a request runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        if rid and not getattr(record, "_pal_rid", False):
            record.msg = f"[{rid}] {record.msg}"
            record._pal_rid = True
        return True


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER)
        rid = given if given and _CLIENT_ID.match(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        # In the headers too, so a follower forwarding to the leader passes the same id on.
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"x-request-id"]
        scope["headers"].append((b"x-request-id", rid.encode()))
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


_PORTS = re.compile(r"^/v1/runtime/vms/[^/]+/ports/")


class BodyLimitMiddleware:
    """For the API's routes (``/v1/``); the dashboard's forms have their own, lower limit
    and their own error page, and a VM's ports proxy streams bodies to the guest's server
    (whose business their size is) without holding them."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES, prefix: str = "/v1/") -> None:
        self.app = app
        self.limit = limit
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not path.startswith(self.prefix) or _PORTS.match(path):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, "content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.limit
            except ValueError:
                await _error(send, InvalidRequest("Content-Length is not a number"), scope)
                return
            if too_big:
                msg = f"request body is {declared} bytes; the limit is {self.limit} bytes"
                await _error(send, TooLarge(msg), scope)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Raised into whoever reads the body; the app's handler answers 413.
                    raise HTTPException(413, f"request body exceeds the limit of {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


# (path prefix as raw segments, the id's kind) for each place a path names an id.
_VM_PREFIXES = ((b"v1", b"runtime", b"vms"), (b"runtime",))
_CONTEXT = re.compile(CONTEXT_ID_PATTERN)


def bad_path_id(raw_path: bytes) -> str | None:
    """Why ``raw_path`` names an id that is none (None: it names none, or good ones)."""
    parts = raw_path.split(b"?", 1)[0].split(b"/")[1:]
    for prefix in _VM_PREFIXES:
        n = len(prefix)
        if tuple(parts[:n]) != prefix or len(parts) <= n or not parts[n]:
            continue
        vm = unquote(parts[n].decode("latin-1"), errors="replace")
        if not is_safe_id(vm):
            return f"invalid VM id {vm[:80]!r}: use 1-128 of [A-Za-z0-9._-], not starting with '.'"
        rest = parts[n + 1 :]
        if rest[:2] == [b"code", b"contexts"] and len(rest) > 2 and rest[2]:
            ctx = unquote(rest[2].decode("latin-1"), errors="replace")
            if not _CONTEXT.match(ctx) or ctx.endswith("\n"):
                return f"invalid context id {ctx[:80]!r}"
    return None


class IdPathMiddleware:
    """Refuses (400) a request whose path names an id that fails the id pattern, before
    routing (see the module's doc); HTTP and WebSocket alike."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            why = bad_path_id(scope.get("raw_path") or str(scope.get("path", "")).encode())
            if why is not None:
                await _error(send, InvalidRequest(why), scope)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: str) -> str | None:
    key = name.encode()
    for k, v in scope.get("headers", []):
        if k.lower() == key:
            return str(v.decode("latin-1"))
    return None


async def _error(send: Send, exc: PalError, scope: Scope) -> None:
    rid = scope.get("state", {}).get("request_id")
    err: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if rid:
        err["requestId"] = rid
    await deny(scope, send, exc.status, {"error": err})


async def deny(
    scope: Mapping[str, Any],
    send: Callable[[dict[str, Any]], Awaitable[None]],
    status: int,
    body: dict[str, Any],
) -> None:
    """Answer ``status`` with a JSON ``body``: an HTTP response, or the refusal of a
    WebSocket handshake (the ASGI denial-response extension where the server has it, else
    a close with 4000 + status)."""
    raw = json.dumps(body).encode() + b"\n"  # as every JSON answer (json_response.py)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})
    elif "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": raw})
    else:
        message = str((body.get("error") or {}).get("message", ""))[:120]
        await send({"type": "websocket.close", "code": 4000 + status, "reason": message})

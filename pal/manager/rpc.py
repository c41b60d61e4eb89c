"""The node RPC's server: every verb of pal/wire/verbs.py served from a handler table
(pal/wire/handlers.py), over a unix socket (the embedded node of `pal up`: who may connect
is rpc_socket.py's business) or TCP (`pal node`, every request carrying the node's token:
pal/wire/auth.py).

Nothing here knows a verb: how one travels is pal/wire/http.py's rule, what it does is its
handler's. A PalError answers with its status and ``{"error": {code, message}}``; one in the
middle of a stream is an ``error`` line with its ``status``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from pal.errors import PalError, Unauthorized
from pal.wire import http, tunnel
from pal.wire.auth import bearer_matches
from pal.wire.handlers import Handlers
from pal.wire.verbs import VERBS, Call, Stream, Tunnel

Endpoint = Callable[[Request], Awaitable[Response]]


def create_rpc_app(handlers: Handlers, token: str | None = None) -> ASGIApp:
    """``token``: required on every request (a node reached over the network); None on the
    embedded node's root-only unix socket."""
    routes: list[BaseRoute] = []
    for verb in VERBS:
        if isinstance(verb, Tunnel):
            routes.append(WebSocketRoute(verb.path, _tunnel(verb, handlers, token), name=verb.name))
        elif isinstance(verb, Stream):
            routes.append(Route(verb.path, _stream(verb, handlers), methods=[verb.method], name=verb.name))
        else:
            routes.append(Route(verb.path, _call(verb, handlers), methods=[verb.method], name=verb.name))
    app = Starlette(routes=routes, exception_handlers={PalError: _pal_error})
    return app if token is None else _TokenCheck(app, token)


async def _pal_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, PalError)
    return JSONResponse(exc.to_body(), status_code=exc.status)


async def _request_of(verb: Call[Any, Any] | Stream[Any, Any], request: Request) -> Any:
    body = b"" if verb.method == "GET" else await request.body()
    return http.decode_request(verb, dict(request.path_params), request.query_params.multi_items(), body)


def _call(verb: Call[Any, Any], handlers: Handlers) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        ans = await handlers.call_fn(verb)(await _request_of(verb, request))
        body, media_type, headers = http.encode_answer(ans)
        return Response(body, media_type=media_type, headers=headers)

    return endpoint


def _stream(verb: Stream[Any, Any], handlers: Handlers) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        events = handlers.stream_fn(verb)(await _request_of(verb, request))
        return StreamingResponse(_lines(events), media_type=http.NDJSON)

    return endpoint


async def _lines(events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The events as NDJSON, ending with an ``error`` line if they end in a PalError (a
    refusal before the first event too: the client raises it as the same error)."""
    try:
        async for ev in events:
            yield http.event_line(ev)
    except PalError as exc:
        yield http.error_line(exc)
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def _tunnel(
    verb: Tunnel[Any], handlers: Handlers, token: str | None
) -> Callable[[WebSocket], Awaitable[None]]:
    async def endpoint(ws: WebSocket) -> None:
        # The HTTP check (_TokenCheck) does not see WebSockets: the same check, here.
        if token is not None and not bearer_matches(ws.headers.get("authorization"), token):
            await ws.close(code=4401, reason="node RPC: missing or wrong node token")
            return
        await ws.accept()
        try:
            req = http.decode_request(verb, dict(ws.path_params), ws.query_params.multi_items(), b"")
            conn = await handlers.tunnel_fn(verb)(req)
        except PalError as exc:
            await ws.send_text(tunnel.error_frame(exc))
            await ws.close()
            return
        await ws.send_text(tunnel.status_frame(conn.route))
        await tunnel.serve_stream(ws, conn.reader, conn.writer, conn.on_traffic)

    return endpoint


class _TokenCheck:
    """Every HTTP request carries the node's token (``Authorization: Bearer``), else 401."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization")
            if not bearer_matches(auth.decode("latin-1") if auth else None, self.token):
                err = Unauthorized("node RPC: missing or wrong node token")
                await JSONResponse(err.to_body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

"""The MCP server as a Streamable HTTP endpoint of the control plane (``/mcp``), with the
tenant's API key as a bearer token: the same keys as the REST API. A request without a
valid key is refused (401) before any MCP message is read; each tool call then runs with
the caller's key against this server's own app, in process (httpx's ASGI transport), so it
passes the same authentication, tenant scoping (another tenant's VM is 404), limits and
leader forwarding as any API request.

Stateless: each request stands alone (no session to pin to a replica, nothing to keep in
memory between calls), which is all the tools need.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.types import ASGIApp, Receive, Scope, Send

from pal.sdk import AsyncClient

from .server import build_server

MCP_PATH = "/mcp"
# Tool calls reach the app in process; the name is one every server answers as (loopback).
INTERNAL_URL = "http://127.0.0.1"
TOOL_CALL_TIMEOUT_S = 120.0  # above the longest wait a tool asks for (60 s)

# The reason a key is refused (None: it is a tenant's key).
KeyCheck = Callable[[str], Awaitable[str | None]]


def bearer_key(headers: Any) -> str | None:
    scheme, _, key = str(headers.get("authorization") or "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class McpEndpoint:
    """The ASGI app at ``/mcp``. ``app``: the control plane's app the tools call (with the
    caller's key); ``check_key``: the API's key check, so a wrong key is a 401 here too."""

    def __init__(self, app: ASGIApp, check_key: KeyCheck) -> None:
        self._app = app
        self._check_key = check_key
        server = build_server(self._client, "http")
        self.manager = StreamableHTTPSessionManager(app=server, stateless=True, json_response=True)

    @contextlib.asynccontextmanager
    async def _client(self, ctx: ServerRequestContext[Any, Any]) -> AsyncIterator[AsyncClient]:
        key = bearer_key(ctx.request.headers) if ctx.request is not None else None
        if key is None:
            raise PermissionError("no API key on this request")
        transport = httpx.ASGITransport(app=self._app)
        http = httpx.AsyncClient(transport=transport, base_url=INTERNAL_URL, timeout=TOOL_CALL_TIMEOUT_S)
        async with AsyncClient(INTERNAL_URL, key, TOOL_CALL_TIMEOUT_S, http_client=http) as client:
            yield client

    def run(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The session manager's task group: entered for the app's lifetime (its lifespan)."""
        return self.manager.run()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = bearer_key(headers)
        why = "missing API key: send 'Authorization: Bearer <apiKey>'" if key is None else None
        if key is not None:
            why = await self._check_key(key)
        if why is not None:
            await _unauthorized(send, why)
            return
        await self.manager.handle_request(scope, receive, send)


async def _unauthorized(send: Send, message: str) -> None:
    body = json.dumps({"error": {"code": "UNAUTHENTICATED", "message": message}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_mcp(app: Any, check_key: KeyCheck) -> McpEndpoint:
    """Serve ``/mcp`` on the control plane's FastAPI ``app`` (outside its OpenAPI document),
    its session manager running for the app's lifetime."""
    from starlette.routing import Route

    endpoint = McpEndpoint(app, check_key)
    app.router.routes.append(Route(MCP_PATH, endpoint=endpoint, methods=["GET", "POST", "DELETE"]))
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with endpoint.run(), inner(a) as state:
            yield state

    app.router.lifespan_context = lifespan
    return endpoint

"""The MCP server as a Streamable HTTP endpoint of the control plane (``/mcp``), with the
tenant's API key as a bearer token: the same keys as the REST API. A request without a
valid key is refused (401) before any MCP message is read; each tool call then runs with
the caller's key against this server's own app, in process (httpx's ASGI transport), so it
passes the same authentication, tenant scoping (another tenant's VM is 404), limits and
leader forwarding as any API request.

Stateless: each request stands alone (no session to pin to a replica, nothing to keep in
memory between calls), which is all the tools need.

Shared fairly (docs/security.md, "Fair shares"): a tenant holds at most
``max_per_tenant`` requests here at once (an idle ``GET /mcp`` stream counts, as a tool
call does); past it 429. And, as the MCP specification asks, a request whose ``Origin``
is neither this server's own (the ``Host`` it was sent to) nor one of ``PAL_CORS_ORIGINS``
is refused (403): a web page elsewhere never drives these tools.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

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

# (the key's tenant id, None), or (None, why the key is refused).
KeyCheck = Callable[[str], Awaitable[tuple[str | None, str | None]]]


def bearer_key(headers: Any) -> str | None:
    scheme, _, key = str(headers.get("authorization") or "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class McpEndpoint:
    """The ASGI app at ``/mcp``. ``app``: the control plane's app the tools call (with the
    caller's key); ``check_key``: the API's key check, so a wrong key is a 401 here too."""

    def __init__(
        self,
        app: ASGIApp,
        check_key: KeyCheck,
        *,
        max_per_tenant: int = 128,
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        self._app = app
        self._check_key = check_key
        self.max_per_tenant = max_per_tenant
        self.cors_origins = {o.rstrip("/") for o in cors_origins}
        self.held: dict[str, int] = {}
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
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, headers.get("host", "")):
            msg = (
                f"Origin {origin[:100]!r} may not use this MCP endpoint (its own origin or PAL_CORS_ORIGINS)"
            )
            await _answer(send, 403, "FORBIDDEN", msg)
            return
        key = bearer_key(headers)
        tenant: str | None = None
        why: str | None = "missing API key: send 'Authorization: Bearer <apiKey>'"
        if key is not None:
            tenant, why = await self._check_key(key)
        if tenant is None:
            await _answer(send, 401, "UNAUTHENTICATED", why or "invalid API key")
            return
        held = self.held.get(tenant, 0)
        if held >= self.max_per_tenant:
            msg = (
                f"this tenant already holds {held} requests on /mcp, its budget (PAL_TENANT_MAX_STREAMS="
                f"{self.max_per_tenant}): close idle streams, or retry when calls have ended"
            )
            await _answer(send, 429, "RESOURCE_EXHAUSTED", msg)
            return
        self.held[tenant] = held + 1
        try:
            await self.manager.handle_request(scope, receive, send)
        finally:
            left = self.held.get(tenant, 1) - 1
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)

    def _origin_ok(self, origin: str, host: str) -> bool:
        """Same origin (a page this server served: its host is the one the request went
        to, which the Host check vouches for), or a listed one."""
        return urlsplit(origin).netloc.lower() == host.lower() or origin.rstrip("/") in self.cors_origins


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_mcp(
    app: Any, check_key: KeyCheck, *, max_per_tenant: int = 128, cors_origins: tuple[str, ...] = ()
) -> McpEndpoint:
    """Serve ``/mcp`` on the control plane's FastAPI ``app`` (outside its OpenAPI document),
    its session manager running for the app's lifetime."""
    from starlette.routing import Route

    endpoint = McpEndpoint(app, check_key, max_per_tenant=max_per_tenant, cors_origins=cors_origins)
    app.router.routes.append(Route(MCP_PATH, endpoint=endpoint, methods=["GET", "POST", "DELETE"]))
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with endpoint.run(), inner(a) as state:
            yield state

    app.router.lifespan_context = lifespan
    return endpoint

"""Ports: `/v1/runtime/vms/{id}/ports/{port}/{path}` reverse-proxies HTTP and WebSockets to a
server listening inside the VM (docs/ports.md); `/v1/runtime/vms/{id}/tunnel/{port}` is a raw
byte stream over a WebSocket (`pal vm port-forward`); `POST .../ports/{port}/url` signs a link
to the port's own origin (port_origins.py, served by port_host.py) and
`DELETE .../port-links/{linkId}` revokes one (port_links.py).

This path route on the API's origin is for programmatic clients (SDKs, curl, the CLI): what
it returns is sent with ``Content-Security-Policy: sandbox`` and without
``Service-Worker-Allowed``, so a browser that opens it runs no script of the guest's in the
API's origin (docs/ports.md, "Origins").

Each request goes control plane -> node (a WebSocket on the node RPC carrying the TCP
stream, manager/tunnel.py) -> guest. The HTTP/1.1 exchange with the guest's server is
httpcore's (the client half of httpx) over that stream, and the WebSocket one is the
``websockets`` client's, so nothing here parses HTTP by hand.

Authorisation: the tenant's API key (``Authorization: Bearer``, never forwarded to the
guest), or a signed link's token (``?palToken=``) bound to one VM and port, taken only from
this origin's own pages or a client that sends no ``Origin`` (port_links.py). No cookie is
set or read on this origin. An expired, foreign or revoked link is 401, and what it opened
(a WebSocket, a tunnel, a response still streaming) ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Mapping, MutableMapping
from typing import Any

import httpcore
from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from pydantic import Field
from starlette.background import BackgroundTask

from pal.errors import BadGateway, Forbidden, InvalidRequest, PalError, Unauthorized
from pal.scheduler.scheduler import Scheduler
from pal.store.store import hash_api_key
from pal.wire.models import PortOpen
from pal.wire.tunnel import TunnelStream, error_frame, serve_stream, status_frame

from .auth import tenant_for_key
from .body import require_json
from .deps import scheduler_of
from .errors import error_responses
from .json_response import JSONResponse
from .port_links import MAX_LINK_SECS, Link, Links, is_link_id, origin_ok
from .port_listen import listening_stream
from .port_origins import PortsOrigins
from .shapes import Shape as _Model
from .wsrelay import relay

log = logging.getLogger("pal.api.ports")

TOKEN_PARAM = "palToken"
LINK_COOKIE = "pal_link"
# Guest content on the API's origin: a browser renders it in a unique opaque origin, with no
# scripts, forms, popups or storage of that origin (CSP Level 2 "sandbox", no tokens).
SANDBOX_CSP = (b"content-security-policy", b"sandbox")
# Would let a guest's script widen a service worker's scope to the whole origin.
NEVER_FROM_GUEST = {b"service-worker-allowed"}
PREFIX = "/v1/runtime/vms/{vm_id}/ports/{port}"
# Any method a guest's server may speak: HTTP's own (RFC 9110) and WebDAV's (RFC 4918,
# 3253, 5323); Starlette routes need them listed.
METHODS = [
    *("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "QUERY"),
    *("PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "REPORT", "SEARCH"),
]
# RFC 9110 7.6.1 hop-by-hop fields, never forwarded either way.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
API_KEY_PREFIX = "bearer pal_"  # pal/store: API keys are "pal_" + random


class PortUrlRequest(_Model):
    expires_in_secs: int = Field(..., ge=1, le=MAX_LINK_SECS, description="how long the link works")


class PortUrlOut(_Model):
    url: str = Field(
        description="opens the port on its own origin without an API key (this VM and port only)"
    )
    expires_at: int = Field(description="unix seconds")
    link_id: str = Field(description="revokes this link: DELETE /v1/runtime/vms/{id}/port-links/{linkId}")


class PortLinkRevokedOut(_Model):
    link_id: str
    revoked: bool = Field(description="true: the link opens nothing from now on (revoking again is fine)")


def port_link(
    links: Links, origins: PortsOrigins, tenant: str, key_hash: str, vm_id: str, port: int, expires_in: int
) -> PortUrlOut:
    """The signed link to a VM's port, on the port's own origin (POST .../ports/{port}/url,
    and the dashboard's form); ``key_hash``: the API key it is made with (rotating the key
    ends it)."""
    link = links.sign(tenant, vm_id, port, int(time.time()) + expires_in, key_hash)
    url = f"{origins.origin(vm_id, port)}/?{TOKEN_PARAM}={links.token(link)}"
    return PortUrlOut(url=url, expires_at=link.expires_at, link_id=link.link_id)


def _header_items(scope: MutableMapping[str, Any]) -> list[tuple[bytes, bytes]]:
    return list(scope.get("headers") or [])


def _get(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _query_without_token(query: bytes) -> tuple[bytes, str | None]:
    """The query string minus ``palToken`` (forwarded byte for byte otherwise), and the token."""
    token = None
    kept = []
    for part in query.split(b"&") if query else []:
        if part.startswith(TOKEN_PARAM.encode() + b"="):
            token = part.split(b"=", 1)[1].decode("ascii", "replace")
            continue
        kept.append(part)
    return b"&".join(kept), token


def cookie_tokens(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """Every ``pal_link`` cookie's value, in the order sent (a browser may send several of
    one name: the port's own and any another origin managed to add)."""
    out = []
    for k, v in headers:
        if k.lower() != b"cookie":
            continue
        for part in v.split(b";"):
            name, eq, value = part.strip().partition(b"=")
            if eq and name == LINK_COOKIE.encode() and value:
                out.append(value.strip(b'"').decode("latin-1"))
    return out


def _strip_link_cookie(value: bytes) -> bytes:
    parts = [p for p in value.split(b";") if not p.strip().startswith(LINK_COOKIE.encode() + b"=")]
    return b";".join(parts).strip()


def _target(raw_path: bytes, query: bytes, *, under_prefix: bool = True) -> bytes:
    """The path inside the guest: what follows /v1/runtime/vms/{id}/ports/{port} (the path
    route), or the whole path (a port's own origin)."""
    if under_prefix:
        parts = raw_path.split(b"/", 7)
        raw_path = b"/" + (parts[7] if len(parts) > 7 else b"")
    return raw_path + (b"?" + query if query else b"")


def client_scheme(scope: Mapping[str, Any]) -> str:
    """What X-Forwarded-Proto says: how the client reached Pal, ``http`` or ``https``, for
    an HTTP request and a WebSocket alike (whose scope says ``ws`` or ``wss``). uvicorn has
    already applied a trusted proxy's own X-Forwarded-Proto to the scope."""
    return "https" if scope.get("scheme") in ("https", "wss") else "http"


def forwarded_headers(
    headers: list[tuple[bytes, bytes]], *, client: str, scheme: str, prefix: str
) -> list[tuple[bytes, bytes]]:
    """The request's headers as a reverse proxy forwards them: hop-by-hop fields dropped
    (and those ``Connection`` names), Pal's API key and link cookie removed, Host kept, and
    X-Forwarded-For/-Host/-Proto/-Prefix set."""
    conn_named = set()
    for k, v in headers:
        if k.lower() == b"connection":
            conn_named |= {x.strip().lower().decode("latin-1") for x in v.split(b",")}
    out: list[tuple[bytes, bytes]] = []
    prior_xff = None
    host = b""
    for k, v in headers:
        name = k.lower().decode("latin-1")
        if name in HOP_BY_HOP or name in conn_named or name.startswith("x-forwarded-"):
            if name == "x-forwarded-for":
                prior_xff = v
            continue
        if name == "authorization" and v.lower().startswith(API_KEY_PREFIX.encode()):
            continue  # the tenant's key: never into the guest
        if name == "cookie":
            v = _strip_link_cookie(v)
            if not v:
                continue
        if name == "host":
            host = v
        out.append((k, v))
    # uvicorn may already have taken the client from a trusted proxy's X-Forwarded-For
    # (its last entry): then the chain is complete as it came.
    chain = [x.strip() for x in prior_xff.split(b",")] if prior_xff else []
    if not chain or chain[-1] != client.encode():
        chain.append(client.encode())
    xff = b", ".join(chain)
    out += [
        (b"x-forwarded-for", xff),
        (b"x-forwarded-host", host),
        (b"x-forwarded-proto", scheme.encode()),
    ]
    if prefix:  # the path route: where the app is mounted (its own origin: at the root)
        out.append((b"x-forwarded-prefix", prefix.encode()))
    return out


def _response_headers(
    raw: list[tuple[bytes, bytes]], prefix: str, *, sandbox: bool
) -> list[tuple[bytes, bytes]]:
    """The guest's response headers minus hop-by-hop ones. Its cookies never name a
    ``Domain`` (a guest must not set cookies for Pal's pages or another port's origin) and,
    on the path route, stay under this port's path. ``sandbox`` (the API's origin): no
    ``Service-Worker-Allowed``, and ``Content-Security-Policy: sandbox`` added to whatever
    policy the guest sent (every policy a response carries applies)."""
    out = []
    for k, v in raw:
        name = k.lower()
        if name.decode("latin-1") in HOP_BY_HOP or (sandbox and name in NEVER_FROM_GUEST):
            continue
        if name == b"set-cookie":
            v = _scope_cookie(v, prefix)
        out.append((k, v))
    if sandbox:
        out.append(SANDBOX_CSP)
    return out


def _scope_cookie(value: bytes, prefix: str) -> bytes:
    parts = [p.strip() for p in value.split(b";")]
    kept = [parts[0]]
    path = b"/"
    for attr in parts[1:]:
        low = attr.lower()
        if low.startswith(b"domain="):
            continue
        if low.startswith(b"path="):
            path = attr.split(b"=", 1)[1] or b"/"
            continue
        kept.append(attr)
    if not path.startswith(b"/"):
        path = b"/" + path
    kept.append(b"Path=" + prefix.encode() + path)
    return b"; ".join(kept)


class _NetworkStream(httpcore.AsyncNetworkStream):
    """httpcore's view of a tunnel: the guest's server at the other end."""

    def __init__(self, stream: TunnelStream) -> None:
        self.stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.stream.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self.stream.write(buffer)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return None


async def socket_bridge(stream: TunnelStream) -> tuple[socket.socket, asyncio.Task[None]]:
    """A local socket whose peer is the tunnel (for libraries that want a socket)."""
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=mine)

    async def pump() -> None:
        async def to_tunnel() -> None:
            while data := await reader.read(65536):
                await stream.write(data)
            with contextlib.suppress(Exception):
                await stream.write_eof()

        async def from_tunnel() -> None:
            while data := await stream.read(65536):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        tasks = [asyncio.create_task(to_tunnel()), asyncio.create_task(from_tunnel())]
        try:
            await asyncio.gather(*tasks)
        except Exception:
            pass
        finally:
            for t in tasks:
                t.cancel()
            writer.close()
            await stream.aclose()

    return theirs, asyncio.create_task(pump())


async def key_tenant(store: Any, headers: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """(tenant id, key hash) of a Pal API key in ``Authorization``; None without one;
    Unauthorized for a key that opens no tenant."""
    auth = (_get(headers, b"authorization") or b"").decode("latin-1")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.startswith("pal_"):
        return None
    tenant = await tenant_for_key(store, key.strip())
    if tenant is None:
        raise Unauthorized("invalid API key")
    return str(tenant.id), hash_api_key(key.strip())


async def signing_key(request: Request) -> tuple[str, str]:
    """(tenant id, key hash) of the API key that signs a link (a port's, a process attach's):
    only the key itself signs one, never another link."""
    by_key = await key_tenant(request.app.state.store, _header_items(request.scope))
    if by_key is None:
        raise Unauthorized("signing a link needs the API key: send 'Authorization: Bearer <apiKey>'")
    return by_key


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port} is outside 1-65535")


MISSING_CREDENTIALS = (
    "missing API key: send 'Authorization: Bearer <apiKey>' or open a signed link (POST .../ports/{port}/url)"
)


# Its handlers find the scheduler, store, links and port origins on app.state (create_app).
ports_router = APIRouter(prefix="/v1/runtime", tags=["ports"])


async def authorise(
    state: Any, headers: list[tuple[bytes, bytes]], query: bytes, vm_id: str, port: int
) -> tuple[str, Link | None]:
    """The tenant, and the link that opened the request (None: the key). The key first,
    else a link's ``?palToken=`` from this origin or no browser (cookies are not read on
    the API's origin)."""
    by_key = await key_tenant(state.store, headers)
    if by_key is not None:
        return by_key[0], None
    _, token = _query_without_token(query)
    if token is None:
        raise Unauthorized(MISSING_CREDENTIALS)
    if not origin_ok(_get(headers, b"origin"), _get(headers, b"host")):
        raise Forbidden("a port link on this path opens only from this origin's pages, or with no Origin")
    link = await state.links.check(token, vm_id, port)
    return link.tenant_id, link


async def close_for(ws: WebSocket, why: str) -> None:
    """Close a socket whose link ended, saying why."""
    with contextlib.suppress(Exception):
        await ws.close(1008, why[:120])


@ports_router.post(
    "/vms/{vm_id}/ports/{port}/url",
    response_model=PortUrlOut,
    summary="A signed link that opens the port on its own origin without the API key, until it expires",
    dependencies=[Depends(require_json)],
    responses=error_responses(400, 401, 404, 413, 415),
)
async def port_url(vm_id: str, port: int, body: PortUrlRequest, request: Request) -> PortUrlOut:
    state = request.app.state
    tenant, key_hash = await signing_key(request)
    check_port(port)
    await scheduler_of(state).reads.get(tenant, vm_id)  # 404 for unknown and other tenants' VMs
    return port_link(state.links, state.port_origins, tenant, key_hash, vm_id, port, body.expires_in_secs)


@ports_router.delete(
    "/vms/{vm_id}/port-links/{link_id}",
    response_model=PortLinkRevokedOut,
    summary="Revoke a port link: it opens nothing from now on, on every replica",
    responses=error_responses(400, 401, 404),
)
async def revoke_link(vm_id: str, link_id: str, request: Request) -> PortLinkRevokedOut:
    state = request.app.state
    by_key = await key_tenant(state.store, _header_items(request.scope))
    if by_key is None:
        raise Unauthorized("revoking a link needs the API key: send 'Authorization: Bearer <apiKey>'")
    if not is_link_id(link_id):
        raise InvalidRequest(f"{link_id[:40]!r} is not a link id (POST .../ports/{{port}}/url gives linkId)")
    await scheduler_of(state).reads.get(by_key[0], vm_id)  # 404 for unknown and other tenants' VMs
    await state.links.revoke(by_key[0], link_id)
    return PortLinkRevokedOut(link_id=link_id, revoked=True)


@ports_router.api_route("/vms/{vm_id}/ports/{port}/{path:path}", methods=METHODS, include_in_schema=False)
async def proxy(vm_id: str, port: int, path: str, request: Request) -> Response:
    scope = request.scope
    query, _ = _query_without_token(scope.get("query_string") or b"")
    state = request.app.state
    tenant, link = await authorise(state, _header_items(scope), scope.get("query_string") or b"", vm_id, port)
    check_port(port)
    prefix = PREFIX.format(vm_id=vm_id, port=port)
    target = _target(scope["raw_path"], query)
    opened = None if link is None else (state.links, link)
    return await proxy_http(
        scheduler_of(state), request, tenant, vm_id, port, target, prefix=prefix, sandbox=True, link=opened
    )


@ports_router.websocket("/vms/{vm_id}/ports/{port}/{path:path}")
async def proxy_ws(ws: WebSocket, vm_id: str, port: int, path: str) -> None:
    scope = ws.scope
    headers = _header_items(scope)
    query, _ = _query_without_token(scope.get("query_string") or b"")
    state = ws.app.state
    try:
        tenant, link = await authorise(state, headers, scope.get("query_string") or b"", vm_id, port)
        check_port(port)
        stream = await scheduler_of(state).guest.open_port(tenant, PortOpen(vm_id=vm_id, port=port))
    except PalError as exc:
        await _refuse(ws, exc)
        return
    prefix = PREFIX.format(vm_id=vm_id, port=port)
    session = proxy_websocket(ws, stream, headers, _target(scope["raw_path"], query), port, prefix)
    await state.links.while_valid(link, session, lambda why: close_for(ws, why))


@ports_router.websocket("/vms/{vm_id}/tunnel/{port}")
async def tunnel(ws: WebSocket, vm_id: str, port: int) -> None:
    """A raw TCP stream to the port (manager/tunnel.py's framing): `pal vm port-forward`."""
    headers = _header_items(ws.scope)
    state = ws.app.state
    try:
        tenant, link = await authorise(state, headers, ws.scope.get("query_string") or b"", vm_id, port)
        check_port(port)
        stream = await scheduler_of(state).guest.open_port(tenant, PortOpen(vm_id=vm_id, port=port))
    except PalError as exc:
        await ws.accept()
        await ws.send_text(error_frame(exc))
        await ws.close()
        return
    await ws.accept()
    await ws.send_text(status_frame(stream.route))
    sock, pump = await socket_bridge(stream)
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
        await state.links.while_valid(link, serve_stream(ws, reader, writer), lambda why: close_for(ws, why))
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        await stream.aclose()


async def proxy_http(
    scheduler: Scheduler,
    request: Request,
    tenant: str,
    vm_id: str,
    port: int,
    target: bytes,
    *,
    prefix: str,
    sandbox: bool,
    set_cookie: bytes | None = None,
    link: tuple[Links, Link] | None = None,
) -> Response:
    """Send the request to the guest's server on ``port`` and stream its answer back.
    ``prefix``: where the port is mounted ("" on its own origin); ``sandbox``: the API's
    origin (see :func:`_response_headers`); ``set_cookie``: a link cookie to set;
    ``link``: the link that opened it, and its kind (a response still streaming ends with it)."""
    scope = request.scope
    headers = _header_items(scope)
    client = request.client.host if request.client else ""
    fwd = forwarded_headers(headers, client=client, scheme=client_scheme(scope), prefix=prefix)
    method = request.method.encode()
    has_body = _get(headers, b"content-length") not in (None, b"0") or _get(headers, b"transfer-encoding")
    if has_body and _get(headers, b"content-length") is None:
        fwd.append((b"transfer-encoding", b"chunked"))

    stack = contextlib.AsyncExitStack()
    try:
        at = PortOpen(vm_id=vm_id, port=port)
        stream = await listening_stream(stack, lambda: scheduler.guest.port_stream(tenant, at))
        conn = httpcore.AsyncHTTP11Connection(
            origin=httpcore.Origin(b"http", b"guest", port), stream=_NetworkStream(stream)
        )
        stack.push_async_callback(conn.aclose)
        req = httpcore.Request(
            method,
            httpcore.URL(scheme=b"http", host=b"guest", port=port, target=target),
            headers=fwd,
            content=request.stream() if has_body else None,
            extensions={"timeout": {"read": None, "write": None}},
        )
        try:
            resp = await conn.handle_async_request(req)
        except httpcore.ProtocolError as exc:
            raise BadGateway(f"the server on port {port} answered with broken HTTP: {exc}") from None
        except (httpcore.NetworkError, httpcore.TimeoutException, OSError) as exc:
            raise BadGateway(
                f"the server on port {port} closed the connection without answering ({exc})"
            ) from None
    except BaseException:
        await stack.aclose()
        raise
    stack.push_async_callback(resp.aclose)

    async def body() -> AsyncIterator[bytes]:
        chunks: Any = resp.stream if link is None else link[0].cut_when_ended(link[1], resp.stream)  # type: ignore[arg-type]
        try:
            async for chunk in chunks:
                yield chunk
        except (httpcore.NetworkError, httpcore.ProtocolError, OSError) as exc:
            log.info("VM %s port %d: response cut short: %s", vm_id, port, exc)
        finally:
            await stack.aclose()

    out = StreamingResponse(body(), status_code=resp.status, background=BackgroundTask(stack.aclose))
    out.raw_headers = _response_headers(resp.headers, prefix, sandbox=sandbox)
    if set_cookie is not None:
        out.raw_headers.append((b"set-cookie", set_cookie))
    return out


def link_cookie(token: str, scheme: str) -> bytes:
    """The link's cookie on the port's own origin: host-only (no Domain), httpOnly."""
    secure = "; Secure" if scheme == "https" else ""
    return f"{LINK_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax{secure}".encode()


async def _refuse(ws: WebSocket, exc: PalError) -> None:
    """Refuse a WebSocket handshake with the error's status and body where the server can
    (the ASGI denial-response extension), else close with 4000 + status."""
    if "websocket.http.response" in (ws.scope.get("extensions") or {}):
        await ws.send_denial_response(JSONResponse(exc.to_body(), status_code=exc.status))
        return
    await ws.close(code=4000 + exc.status, reason=exc.message[:120])


async def proxy_websocket(
    ws: WebSocket,
    stream: TunnelStream,
    headers: list[tuple[bytes, bytes]],
    target: bytes,
    port: int,
    prefix: str,
) -> None:
    """Open the same WebSocket to the guest's server over the tunnel, accept the client's
    with the subprotocol the guest chose, then relay messages both ways until one closes."""
    import websockets
    from websockets.asyncio.client import connect

    client = ws.client.host if ws.client else ""
    host = (_get(headers, b"host") or b"guest").decode("latin-1")
    skip = {"host", "origin", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions"}
    skip.add("sec-websocket-protocol")
    extra = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in forwarded_headers(headers, client=client, scheme=client_scheme(ws.scope), prefix=prefix)
        if k.lower().decode("latin-1") not in skip
    ]
    protocols = [
        p.strip()
        for k, v in headers
        if k.lower() == b"sec-websocket-protocol"
        for p in v.decode("latin-1").split(",")
        if p.strip()
    ]
    origin = _get(headers, b"origin")
    sock, pump = await socket_bridge(stream)
    try:
        try:
            guest = await connect(
                f"ws://{host}{target.decode('latin-1')}",
                sock=sock,
                additional_headers=extra,
                subprotocols=protocols or None,  # type: ignore[arg-type]
                origin=origin.decode("latin-1") if origin else None,  # type: ignore[arg-type]
                compression=None,
                max_size=16 * 1024 * 1024,
                ping_interval=None,
                open_timeout=30,
            )
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            sock.close()
            await _refuse(ws, BadGateway(f"the WebSocket handshake with port {port} failed: {exc}"))
            return
        await ws.accept(subprotocol=guest.subprotocol)

        await relay(ws.receive, ws.send, guest)
    finally:
        # ``sock`` belongs to the WebSocket client's transport (closed with it), never
        # closed behind the event loop's back.
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        await stream.aclose()

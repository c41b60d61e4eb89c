"""Ports: `/v1/runtime/vms/{id}/ports/{port}/{path}` reverse-proxies HTTP and WebSockets to a
server listening inside the VM (docs/ports.md); `/v1/runtime/vms/{id}/tunnel/{port}` is a raw
byte stream over a WebSocket (`pal vm port-forward`); `POST .../ports/{port}/url` signs a link.

Each request goes control plane -> node (a WebSocket on the node RPC carrying the TCP
stream, manager/tunnel.py) -> guest. The HTTP/1.1 exchange with the guest's server is
httpcore's (the client half of httpx) over that stream, and the WebSocket one is the
``websockets`` client's, so nothing here parses HTTP by hand.

Authorisation: the tenant's API key (``Authorization: Bearer``, never forwarded to the
guest), or a signed link (``?palToken=``) bound to one VM and port, which also sets a
cookie scoped to that port's path so a browser's later requests (assets, fetches) carry
it. An expired or foreign link is 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Mapping, MutableMapping
from http.cookies import SimpleCookie
from typing import Any

import httpcore
from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from itsdangerous import BadSignature, URLSafeSerializer
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from starlette.background import BackgroundTask

from pal.errors import BadGateway, InvalidRequest, PalError, Unauthorized
from pal.manager.tunnel import TunnelStream, error_frame, serve_stream, status_frame

from .auth import tenant_for_key
from .body import require_json
from .errors import error_responses
from .port_listen import listening_stream
from .wsrelay import relay

log = logging.getLogger("pal.api.ports")

TOKEN_PARAM = "palToken"
LINK_COOKIE = "pal_link"
MAX_LINK_SECS = 7 * 24 * 3600
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


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PortUrlRequest(_Model):
    expires_in_secs: int = Field(..., ge=1, le=MAX_LINK_SECS, description="how long the link works")


class PortUrlOut(_Model):
    url: str = Field(description="opens the port without an API key (bound to this VM and port)")
    expires_at: int = Field(description="unix seconds")


class Links:
    """Signed, expiring links to one VM's port (HMAC with the server's secret)."""

    def __init__(self, secret: bytes) -> None:
        self._signer = URLSafeSerializer(secret, salt="pal-port-link")

    def sign(self, tenant_id: str, vm_id: str, port: int, expires_at: int) -> str:
        return str(self._signer.dumps({"t": tenant_id, "v": vm_id, "p": port, "e": expires_at}))

    def tenant(self, token: str, vm_id: str, port: int, now: float) -> str:
        """The tenant a valid link for this VM and port was made by; Unauthorized otherwise."""
        try:
            data = self._signer.loads(token)
            tenant, vm, p, exp = str(data["t"]), str(data["v"]), int(data["p"]), int(data["e"])
        except (BadSignature, KeyError, TypeError, ValueError):
            raise Unauthorized("invalid port link") from None
        if vm != vm_id or p != port:
            raise Unauthorized("this link is for another VM or port")
        if exp <= now:
            raise Unauthorized("this port link has expired")
        return tenant


def port_link(links: Links, base_url: str, tenant: str, vm_id: str, port: int, expires_in: int) -> PortUrlOut:
    """The signed link to a VM's port (POST .../ports/{port}/url, and the dashboard's form)."""
    expires_at = int(time.time()) + expires_in
    token = links.sign(tenant, vm_id, port, expires_at)
    url = f"{base_url.rstrip('/')}/v1/runtime/vms/{vm_id}/ports/{port}/?{TOKEN_PARAM}={token}"
    return PortUrlOut(url=url, expires_at=expires_at)


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


def _cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    raw = _get(headers, b"cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    with contextlib.suppress(Exception):
        jar.load(raw.decode("latin-1"))
    morsel = jar.get(LINK_COOKIE)
    return morsel.value if morsel else None


def _strip_link_cookie(value: bytes) -> bytes:
    parts = [p for p in value.split(b";") if not p.strip().startswith(LINK_COOKIE.encode() + b"=")]
    return b";".join(parts).strip()


def _target(raw_path: bytes, query: bytes) -> bytes:
    """The path inside the guest: what follows /v1/runtime/vms/{id}/ports/{port}."""
    parts = raw_path.split(b"/", 7)
    target = b"/" + (parts[7] if len(parts) > 7 else b"")
    return target + (b"?" + query if query else b"")


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
        (b"x-forwarded-prefix", prefix.encode()),
    ]
    return out


def _response_headers(raw: list[tuple[bytes, bytes]], prefix: str) -> list[tuple[bytes, bytes]]:
    """The guest's response headers minus hop-by-hop ones; its cookies are kept under this
    port's path (a guest must not set cookies for Pal's other pages, nor for a domain)."""
    out = []
    for k, v in raw:
        name = k.lower()
        if name.decode("latin-1") in HOP_BY_HOP:
            continue
        if name == b"set-cookie":
            v = _scope_cookie(v, prefix)
        out.append((k, v))
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


def ports_router(scheduler: Any, store: Any, links: Links) -> APIRouter:
    r = APIRouter(prefix="/v1/runtime", tags=["ports"])

    async def authorise(
        headers: list[tuple[bytes, bytes]], query: bytes, vm_id: str, port: int
    ) -> tuple[str, str | None]:
        """(tenant, the token of a link given in the query, to be kept as a cookie). The key
        first; else ?palToken=; else the link cookie."""
        auth = (_get(headers, b"authorization") or b"").decode("latin-1")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() == "bearer" and key.startswith("pal_"):
            tenant = await tenant_for_key(store, key.strip())
            if tenant is None:
                raise Unauthorized("invalid API key")
            return str(tenant.id), None
        _, token = _query_without_token(query)
        if token is not None:
            return links.tenant(token, vm_id, port, time.time()), token
        cookie = _cookie_token(headers)
        if cookie is None:
            raise Unauthorized(
                "missing API key: send 'Authorization: Bearer <apiKey>' or open a signed link "
                "(POST .../ports/{port}/url)"
            )
        return links.tenant(cookie, vm_id, port, time.time()), None

    def check_port(port: int) -> None:
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")

    @r.post(
        "/vms/{vm_id}/ports/{port}/url",
        response_model=PortUrlOut,
        summary="A signed link that opens the port without the API key, until it expires",
        dependencies=[Depends(require_json)],
        responses=error_responses(400, 401, 404, 413, 415),
    )
    async def port_url(vm_id: str, port: int, body: PortUrlRequest, request: Request) -> PortUrlOut:
        headers = _header_items(request.scope)
        auth = (_get(headers, b"authorization") or b"").decode("latin-1")
        if not auth.lower().startswith(API_KEY_PREFIX):
            raise Unauthorized("signing a link needs the API key: send 'Authorization: Bearer <apiKey>'")
        tenant, _ = await authorise(headers, b"", vm_id, port)
        check_port(port)
        await scheduler.get(tenant, vm_id)  # 404 for unknown and other tenants' VMs
        return port_link(links, str(request.base_url), tenant, vm_id, port, body.expires_in_secs)

    @r.api_route("/vms/{vm_id}/ports/{port}/{path:path}", methods=METHODS, include_in_schema=False)
    async def proxy(vm_id: str, port: int, path: str, request: Request) -> Response:
        scope = request.scope
        headers = _header_items(scope)
        query, _ = _query_without_token(scope.get("query_string") or b"")
        tenant, token = await authorise(headers, scope.get("query_string") or b"", vm_id, port)
        check_port(port)
        prefix = PREFIX.format(vm_id=vm_id, port=port)
        client = request.client.host if request.client else ""
        fwd = forwarded_headers(headers, client=client, scheme=client_scheme(scope), prefix=prefix)
        method = request.method.encode()
        has_body = _get(headers, b"content-length") not in (None, b"0") or _get(headers, b"transfer-encoding")
        if has_body and _get(headers, b"content-length") is None:
            fwd.append((b"transfer-encoding", b"chunked"))

        stack = contextlib.AsyncExitStack()
        try:
            stream = await listening_stream(stack, lambda: scheduler.port_stream(tenant, vm_id, port))
            conn = httpcore.AsyncHTTP11Connection(
                origin=httpcore.Origin(b"http", b"guest", port), stream=_NetworkStream(stream)
            )
            stack.push_async_callback(conn.aclose)
            target = _target(scope["raw_path"], query)
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
            try:
                async for chunk in resp.stream:  # type: ignore[union-attr]
                    yield chunk
            except (httpcore.NetworkError, httpcore.ProtocolError, OSError) as exc:
                log.info("VM %s port %d: response cut short: %s", vm_id, port, exc)
            finally:
                await stack.aclose()

        out = StreamingResponse(body(), status_code=resp.status, background=BackgroundTask(stack.aclose))
        out.raw_headers = _response_headers(resp.headers, prefix)
        if token is not None:  # a link opened in a browser: its next requests carry the cookie
            out.raw_headers.append((b"set-cookie", _link_cookie(token, prefix, client_scheme(scope))))
        return out

    @r.websocket("/vms/{vm_id}/ports/{port}/{path:path}")
    async def proxy_ws(ws: WebSocket, vm_id: str, port: int, path: str) -> None:
        scope = ws.scope
        headers = _header_items(scope)
        query, _ = _query_without_token(scope.get("query_string") or b"")
        try:
            tenant, _token = await authorise(headers, scope.get("query_string") or b"", vm_id, port)
            check_port(port)
            stream = await scheduler.open_port(tenant, vm_id, port)
        except PalError as exc:
            await _refuse(ws, exc)
            return
        await _proxy_websocket(ws, stream, headers, query, vm_id, port)

    @r.websocket("/vms/{vm_id}/tunnel/{port}")
    async def tunnel(ws: WebSocket, vm_id: str, port: int) -> None:
        """A raw TCP stream to the port (manager/tunnel.py's framing): `pal vm port-forward`."""
        headers = _header_items(ws.scope)
        try:
            tenant, _ = await authorise(headers, ws.scope.get("query_string") or b"", vm_id, port)
            check_port(port)
            stream = await scheduler.open_port(tenant, vm_id, port)
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
            await serve_stream(ws, reader, writer)
        finally:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
            await stream.aclose()

    return r


def _link_cookie(token: str, prefix: str, scheme: str) -> bytes:
    secure = "; Secure" if scheme == "https" else ""
    return f"{LINK_COOKIE}={token}; Path={prefix}/; HttpOnly; SameSite=Lax{secure}".encode()


async def _refuse(ws: WebSocket, exc: PalError) -> None:
    """Refuse a WebSocket handshake with the error's status and body where the server can
    (the ASGI denial-response extension), else close with 4000 + status."""
    if "websocket.http.response" in (ws.scope.get("extensions") or {}):
        await ws.send_denial_response(JSONResponse(exc.to_body(), status_code=exc.status))
        return
    await ws.close(code=4000 + exc.status, reason=exc.message[:120])


async def _proxy_websocket(
    ws: WebSocket,
    stream: TunnelStream,
    headers: list[tuple[bytes, bytes]],
    query: bytes,
    vm_id: str,
    port: int,
) -> None:
    """Open the same WebSocket to the guest's server over the tunnel, accept the client's
    with the subprotocol the guest chose, then relay messages both ways until one closes."""
    import websockets
    from websockets.asyncio.client import connect

    prefix = PREFIX.format(vm_id=vm_id, port=port)
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
                f"ws://{host}{_target(ws.scope['raw_path'], query).decode('latin-1')}",
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

"""A VM port on its own origin: ``{port}-{vm}.{domain}/{path}`` reverse-proxied to the
server on that port (docs/ports.md; the names: port_origins.py).

This app is everything that answers on a port's origin: no API route, no dashboard page.
The guest's page is at home here (its scripts, cookies and service workers live in an
origin no other port, VM, the API or the dashboard shares), so nothing is sandboxed.

Authorisation: the tenant's API key; or a link's ``?palToken=``, which also sets the link
cookie (host-only, httpOnly) so the browser's later requests carry it; or that cookie. A
socket or a streaming response a link (or its cookie) opened ends when the link does
(port_links.py).
Because sibling origins (``*.localhost``, ``*.ports.example.com``) may count as one *site*,
a browser could send a port's cookie along with a request another port's page makes; the
cookie therefore authorises only a request of the port's own origin, a navigation, or a
request whose ``Origin`` is another port of the same VM (a front end on 3000 calling its API
on 8000). Anything else a cookie alone would open is 403.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from pal.errors import Forbidden, PalError, Unauthorized
from pal.scheduler.scheduler import Scheduler
from pal.wire.models import PortOpen

from .deps import scheduler_of
from .errors import install_error_handlers
from .forward import forward_to_leader
from .middleware import RequestIdMiddleware
from .port_links import Link, Links
from .port_origins import PortsOrigins, scope_host
from .ports import (
    METHODS,
    MISSING_CREDENTIALS,
    _get,
    _header_items,
    _query_without_token,
    _refuse,
    _target,
    check_port,
    client_scheme,
    close_for,
    cookie_tokens,
    key_tenant,
    link_cookie,
    proxy_http,
    proxy_websocket,
)

Headers = list[tuple[bytes, bytes]]


def cookie_use_allowed(headers: Headers, vm_id: str, origins: PortsOrigins, *, websocket: bool) -> bool:
    """Whether the link cookie may authorise this request: a browser says where a request
    comes from (``Origin``; ``Sec-Fetch-Site``/``-Mode``). Allowed: the same VM's ports
    (own origin included), a navigation (a link opened, a bookmark), a non-browser client."""
    origin = _get(headers, b"origin")
    if origin is not None:
        of = origins.origin_of(origin)
        return of is not None and of[0] == vm_id
    if websocket:
        return True  # browsers always send Origin on a WebSocket: this is not one
    site = _get(headers, b"sec-fetch-site")
    if site in (None, b"same-origin", b"none"):
        return True
    return _get(headers, b"sec-fetch-mode") == b"navigate"


async def _authorise(
    store: Any,
    links: Links,
    origins: PortsOrigins,
    headers: Headers,
    query: bytes,
    vm_id: str,
    port: int,
    *,
    websocket: bool = False,
) -> tuple[str, str | None, Link | None]:
    """(tenant, a link token given in the query, to be kept as the cookie, the link that
    opened the request: None for the key). A link, in the query or its cookie, is taken from
    the same VM's ports' pages or a request without ``Origin`` only."""
    by_key = await key_tenant(store, headers)
    if by_key is not None:
        return by_key[0], None, None
    if not cookie_use_allowed(headers, vm_id, origins, websocket=websocket):
        raise Forbidden(
            "this port's link came with a request of another origin's page: open the "
            "port itself, or call it from a port of the same VM"
        )
    _, token = _query_without_token(query)
    if token is not None:
        link = await links.check(token, vm_id, port)
        return link.tenant_id, token, link
    tokens = cookie_tokens(headers)
    if not tokens:
        raise Unauthorized(MISSING_CREDENTIALS)
    link = await links.first_valid(tokens, vm_id, port)
    return link.tenant_id, None, link


async def _port_websocket(
    ws: WebSocket, store: Any, links: Links, origins: PortsOrigins, where: Callable[[Any], tuple[str, int]]
) -> None:
    """A WebSocket to a VM's port on its own origin (the cookie or link that opens it)."""
    scope = ws.scope
    headers = _header_items(scope)
    raw_query = scope.get("query_string") or b""
    try:
        vm_id, port = where(scope)
        tenant, _, link = await _authorise(
            store, links, origins, headers, raw_query, vm_id, port, websocket=True
        )
        check_port(port)
        stream = await scheduler_of(ws.app.state).guest.open_port(tenant, PortOpen(vm_id=vm_id, port=port))
    except PalError as exc:
        await _refuse(ws, exc)
        return
    query, _ = _query_without_token(raw_query)
    session = proxy_websocket(
        ws, stream, headers, _target(scope["raw_path"], query, under_prefix=False), port, ""
    )
    await links.while_valid(link, session, lambda why: close_for(ws, why))


def create_ports_app(
    scheduler: Scheduler | None,
    store: Any,
    links: Links,
    origins: PortsOrigins,
    failover_s: float,
    *,
    forwarding_key: bytes,
    known_caller: Callable[[Any], Awaitable[bool]] | None = None,
) -> FastAPI:
    """The app every port origin is served by (on the ports listener, and on the API's
    listener for requests whose Host names a port). A follower forwards to the leader, as
    the API does, with the Host kept: it names the port."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    install_error_handlers(app)

    def where(scope: Any) -> tuple[str, int]:
        named = origins.parse(scope_host(scope))
        if named is None:  # port_origins routes only port names here
            raise Forbidden("not a VM port's host name")
        return named

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def proxy(path: str, request: Request) -> Response:
        scope = request.scope
        vm_id, port = where(scope)
        raw_query = scope.get("query_string") or b""
        tenant, token, link = await _authorise(
            store, links, origins, _header_items(scope), raw_query, vm_id, port
        )
        check_port(port)
        query, _ = _query_without_token(raw_query)
        cookie = link_cookie(token, client_scheme(scope)) if token is not None else None
        target = _target(scope["raw_path"], query, under_prefix=False)
        opened = None if link is None else (links, link)
        sched = scheduler_of(request.app.state)
        return await proxy_http(
            sched,
            request,
            tenant,
            vm_id,
            port,
            target,
            prefix="",
            sandbox=False,
            set_cookie=cookie,
            link=opened,
        )

    @app.websocket("/{path:path}")
    async def proxy_ws(ws: WebSocket, path: str) -> None:
        await _port_websocket(ws, store, links, origins, where)

    forward_to_leader(
        app,
        scheduler,
        failover_s=failover_s,
        key=forwarding_key,
        known_caller=known_caller,
        keep_host=True,
    )
    # No body limit: a port's bodies stream to the guest's server, whose business their size is.
    app.add_middleware(RequestIdMiddleware)
    return app

"""The ``Host`` check: the API and the dashboard answer only for this server's own names.

Against DNS rebinding: a web page on ``attacker.example`` re-points that name at
127.0.0.1 and then calls the API from the victim's browser as a same-origin page. The
browser still sends ``Host: attacker.example``, so a request naming a host this server is
not is refused (421 ``MISDIRECTED_REQUEST``) before anything else runs.

Allowed: ``localhost``, the loopback addresses, the address the server listens on and its
advertised URL's host (a follower forwards there), and every name in ``PAL_HOSTS``. When it
listens on every interface (``0.0.0.0``, ``::``) any IP literal is allowed too: a page can
make the browser send an address as Host only by being served from that address, which is
no rebinding. The check is on the name: the port is not compared (a port forward or proxy
changes it, a rebinding attack does not need to). A request without ``Host`` (HTTP/1.0
tools) is not a browser's and passes.

This guards the API/dashboard app only; the ports listener's per-VM host names
(``{port}-{vm}.localhost``) are a separate app, and those names are refused here, as the
API and the dashboard must never answer on a guest's origin.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from pal.config import Settings

WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
STATUS = 421
CODE = "MISDIRECTED_REQUEST"


def host_name(value: str) -> str:
    """The name part of a Host header or a PAL_HOSTS entry: no port, no brackets, no final
    dot, lower case."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowedHosts:
    names: frozenset[str]
    any_ip: bool = False  # listening on every interface: any address literal

    @classmethod
    def for_server(
        cls, settings: Settings, listen: str | None = None, advertise: str | None = None
    ) -> AllowedHosts:
        names = set(LOOPBACK_NAMES) | {host_name(h) for h in settings.hosts}
        wildcard = listen is not None and listen in WILDCARD_HOSTS
        if listen and not wildcard:
            names.add(host_name(listen if ":" not in listen else f"[{listen.strip('[]')}]"))
        if advertise and (adv := urlsplit(advertise).hostname):
            names.add(adv.lower())
        return cls(frozenset(n for n in names if n), wildcard)

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return name in self.names or (self.any_ip and _is_ip(name))


class HostCheckMiddleware:
    """Refuses an HTTP request or WebSocket whose ``Host`` is not one of ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"host"), None)
        if host is None or self.allowed.allows(host):
            await self.app(scope, receive, send)
            return
        message = (
            f"this server does not answer for the host {host[:100]!r}; "
            "if that is one of its names, add it to PAL_HOSTS"
        )
        err: dict[str, str] = {"code": CODE, "message": message}
        rid = scope.get("state", {}).get("request_id")
        if rid:
            err["requestId"] = rid
        await _refuse(scope, send, json.dumps({"error": err}).encode() + b"\n")


async def _refuse(scope: Scope, send: Send, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": STATUS, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": STATUS, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 4000 + STATUS, "reason": "misdirected request"})

"""Every VM port on a browser origin of its own: ``{port}-{vm}.{domain}`` (docs/ports.md).

A guest's page must never share an origin with the dashboard, the API or another VM's port:
same-origin scripts read each other's pages, cookies and CSRF tokens and register service
workers over each other. So a port is served under a host name of its own, as E2B does:

- by default ``http://{port}-{vm}.localhost:{PAL_PORTS_PORT}``: browsers and curl resolve
  every ``*.localhost`` name to loopback themselves, so nothing needs configuring;
- with ``PAL_PORTS_DOMAIN`` (``ports.example.com``, ``https://ports.example.com`` or
  ``http://ports.lan:8082``): ``https://{port}-{vm}.ports.example.com``, for a deployment
  with a wildcard DNS name and certificate in front of Pal.

Which requests belong to a port is decided here, by the ``Host`` header alone:
:class:`PortsHostDispatch` sends a request whose Host is a port's name to the ports app and
nothing else (the API and the dashboard never answer on a port's origin), and
:func:`ports_listener_app` (the ports listener) answers only such requests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from pal.config import DEFAULT_PORTS_PORT, Settings

LOCAL_DOMAIN = "localhost"
# One DNS label: the port, a dash, the VM id (pal/scheduler: "vm-" + 24 hex).
_LABEL = re.compile(r"^([1-9][0-9]{0,4})-(vm-[0-9a-z]{1,56})$")


@dataclass(frozen=True)
class PortsOrigins:
    """How a VM port's origin is named: ``{scheme}://{port}-{vm}.{domain}[:{public_port}]``."""

    domain: str
    scheme: str = "http"
    public_port: int | None = None  # in links; None: the scheme's default port

    @classmethod
    def from_settings(cls, settings: Settings) -> PortsOrigins:
        """PAL_PORTS_DOMAIN, else ``*.localhost`` on the ports listener's port. ValueError
        (naming the setting) for a domain that cannot name hosts."""
        raw = (settings.ports_domain or "").strip()
        if not raw:
            return cls(LOCAL_DOMAIN, "http", settings.ports_port or DEFAULT_PORTS_PORT)
        url = urlsplit(raw if "://" in raw else f"https://{raw}")
        domain = (url.hostname or "").rstrip(".").lower()
        if url.scheme not in ("http", "https") or not domain or url.path not in ("", "/"):
            raise ValueError(f"PAL_PORTS_DOMAIN must be a domain or an http(s)://domain[:port], got {raw!r}")
        literal = re.fullmatch(r"[0-9.]+|\[?[0-9a-f:]+\]?", domain)
        if literal or ("." not in domain and domain != LOCAL_DOMAIN):
            raise ValueError(
                f"PAL_PORTS_DOMAIN needs a DNS name (its subdomains name the ports), got {raw!r}"
            )
        return cls(domain, url.scheme, url.port)

    def host(self, vm_id: str, port: int) -> str:
        return f"{port}-{vm_id}.{self.domain}".lower()

    def origin(self, vm_id: str, port: int) -> str:
        return f"{self.scheme}://{self.host(vm_id, port)}{self._shown_port()}"

    def pattern(self) -> str:
        """What a port's origin looks like, for people (logs, docs)."""
        return f"{self.scheme}://{{port}}-{{vmId}}.{self.domain}{self._shown_port()}"

    def _shown_port(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return f":{self.public_port}" if self.public_port and self.public_port != default else ""

    def parse(self, host: bytes | str | None) -> tuple[str, int] | None:
        """(vm id, port) when ``host`` (a Host header: name, optional ``:port``) names a
        VM port under this domain; None for any other name."""
        if not host:
            return None
        name = host.decode("latin-1") if isinstance(host, bytes) else host
        name = name.strip().lower()
        if name.startswith("["):
            return None  # an IPv6 literal names no port
        name = name.rsplit(":", 1)[0] if ":" in name else name
        name = name.rstrip(".")
        suffix = "." + self.domain
        if not name.endswith(suffix):
            return None
        m = _LABEL.match(name[: -len(suffix)])
        if m is None or int(m.group(1)) > 65535:
            return None
        return m.group(2), int(m.group(1))

    def origin_of(self, origin: bytes | str | None) -> tuple[str, int] | None:
        """(vm id, port) of an ``Origin`` header that is one of the ports' origins."""
        if not origin:
            return None
        text = origin.decode("latin-1") if isinstance(origin, bytes) else origin
        url = urlsplit(text)
        if url.scheme != self.scheme:
            return None
        return self.parse(url.netloc)


def scope_host(scope: Scope) -> bytes | None:
    for k, v in scope.get("headers") or []:
        if k.lower() == b"host":
            return bytes(v)
    return None


class PortsHostDispatch:
    """The control plane's outermost layer: a request whose Host names a VM port goes to
    ``ports_app`` (the proxy, nothing else); every other one to ``app`` (API, dashboard)."""

    def __init__(self, app: ASGIApp, ports_app: ASGIApp, origins: PortsOrigins) -> None:
        self.app = app
        self.ports_app = ports_app
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.origins.parse(scope_host(scope)) is not None:
            await self.ports_app(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def ports_listener_app(ports_app: ASGIApp, origins: PortsOrigins) -> ASGIApp:
    """The ports listener's app: only requests whose Host names a VM port, to the proxy;
    anything else (the dashboard, the API, a bare address) is 404 here."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return  # served without a lifespan: nothing to start
        if origins.parse(scope_host(scope)) is not None:
            await ports_app(scope, receive, send)
            return
        await _not_a_port(scope, send, origins)

    return app


async def _not_a_port(scope: Scope, send: Send, origins: PortsOrigins) -> None:
    message = (
        "this listener serves VM ports only, at http(s)://{port}-{vmId}."
        f"{origins.domain}: open a port's link (POST /v1/runtime/vms/{{id}}/ports/{{port}}/url)"
    )
    body = json.dumps({"error": {"code": "NOT_A_PORT", "message": message}}).encode() + b"\n"
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if scope["type"] == "websocket":
        if "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": 404, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 4404, "reason": "not a VM port"})
        return
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": body})

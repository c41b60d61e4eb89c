"""Followers forward to the leader: a client may talk to any control-plane replica.

A replica that does not lead serves the reads it can answer from the store itself
(listing and getting VMs, their events, nodes, health, metrics, the OpenAPI document, the
dashboard's static files) and forwards every other request, unchanged, to the leader's
advertised URL (from the lease row), streaming the answer back (exec's SSE included).
WebSockets (the ports proxy, `/tunnel`) are forwarded too: the follower opens the same
WebSocket to the leader and relays messages both ways, so the leader sees the connection
(it wakes the VM, and its idle sweeper counts the connection as activity). The dashboard
is forwarded like the API: its pages and actions run on the leader.

A forwarded request carries ``X-Pal-Forwarded``; a replica never forwards one again (a
replica that lost the lead meanwhile answers 503 NOT_LEADER through the store's fencing
instead of looping). The header is signed, so only a replica can send it: an HMAC, under a
key derived from the secret the replicas share, of the method, the path and the time
(``v1.<unix seconds>.<hex>``, good for ``FORWARDED_MAX_AGE_S``). A request with a header
that does not verify is refused (403) by every replica.

A follower holds a request body before it forwards it; it holds more than
``UNAUTHENTICATED_BODY_MAX`` only of a caller it knows (callers.py): an anonymous caller
with a larger body gets 401 before the rest of it is read.

During a failover there is briefly no leader, or the lease still names a leader that died:
the follower waits for a leader and retries a request the leader never received (its
connection was refused) until one answers, at most ``failover_s`` (``PAL_LEADER_LEASE`` +
2 s: the lease expires, a replica takes it at its next tick), and handles the request itself
if it became the leader meanwhile. A request the leader received but did not answer (it
died in the middle) is not sent again: the leader may have carried it out, so the client is
told so (503) and decides.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from pal.errors import Forbidden, NotLeader, PalError, TooLarge, Unauthorized
from pal.scheduler.scheduler import Scheduler

from .body import decimal
from .callers import UNAUTHENTICATED_BODY_MAX
from .middleware import deny
from .wsrelay import relay

log = logging.getLogger(__name__)

FORWARDED = "x-pal-forwarded"
FORWARDED_MAX_AGE_S = 60  # clock skew between replicas plus the time a forward takes
# Reads a follower answers from the store (method, path pattern).
LOCAL_READS = [
    re.compile(p)
    for p in (
        r"^/healthz$",
        r"^/readyz$",
        r"^/metrics$",
        r"^/openapi\.json$",
        r"^/v1/runtime/vms$",
        r"^/v1/runtime/vms/[^/]+$",
        r"^/v1/runtime/vms/[^/]+/events$",
        r"^/v1/nodes$",
        r"^/runtime/static/",  # the dashboard's assets: files of the package, the same everywhere
    )
]
MAX_FORWARDED_BODY = 4 << 20  # above any request the API accepts (files are 1 MiB)
MAX_WS_MESSAGE = 16 << 20  # as the ports proxy's (pal/api/ports.py)
RETRY_S = 0.2  # how often a follower looks for a leader that answers during a failover
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}
# Made again by the WebSocket client for its own handshake with the leader.
_WS_HANDSHAKE = _HOP | {
    "origin",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-protocol",
}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def forwarding_key(shared_secret: bytes) -> bytes:
    """The key that signs ``X-Pal-Forwarded``, from the secret every replica has."""
    return hmac.new(shared_secret, b"pal-forwarded", hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, ts: int) -> str:
    return hmac.new(key, f"{method}\n{path}\n{ts}".encode(), hashlib.sha256).hexdigest()


def sign_forwarded(key: bytes, method: str, path: str, now: float | None = None) -> str:
    ts = int(time.time() if now is None else now)
    return f"v1.{ts}.{_mac(key, method, path, ts)}"


def forwarded_ok(key: bytes, value: str, method: str, path: str, now: float | None = None) -> bool:
    """``value`` is a replica's signature of this method and path, made recently."""
    version, _, rest = value.partition(".")
    raw_ts, _, mac = rest.partition(".")
    ts = decimal(raw_ts)
    if version != "v1" or ts is None:
        return False
    if abs((time.time() if now is None else now) - ts) > FORWARDED_MAX_AGE_S:
        return False
    return hmac.compare_digest(mac.encode(), _mac(key, method, path, ts).encode())


def _method(scope: Scope) -> str:
    return str(scope.get("method") or "GET") if scope["type"] == "http" else "WEBSOCKET"


class _NeverReached(Exception):
    """The leader did not take the connection: nothing was sent, sending again is safe."""


class ForwardToLeader:
    """ASGI middleware; ``is_leader()`` and ``leader_url()`` come from the Leadership."""

    def __init__(
        self,
        app: Any,
        is_leader: Callable[[], Awaitable[bool]],
        leader_url: Callable[[], Awaitable[str | None]],
        failover_s: float,
        key: bytes,
        known_caller: Callable[[Scope], Awaitable[bool]] | None = None,
        keep_host: bool = False,
    ) -> None:
        """``key`` signs and checks ``X-Pal-Forwarded`` (:func:`forwarding_key`);
        ``known_caller(scope)``: the caller carries a credential (callers.py); None: nobody."""
        self.app = app
        # A VM port's origin (pal/api/port_host.py) is named by the Host: the leader needs it.
        self.keep_host = keep_host
        self.is_leader = is_leader
        self.leader_url = leader_url
        self.failover_s = failover_s
        self.key = key
        self.known_caller = known_caller
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    def _local(self, scope: Scope) -> bool:
        return (
            scope["type"] == "http"
            and not self.keep_host  # a port's paths are the guest's, never Pal's reads
            and scope["method"] in ("GET", "HEAD")
            and any(p.match(scope["path"]) for p in LOCAL_READS)
        )

    def _forwarded(self, scope: Scope) -> bool | None:
        """None: no ``X-Pal-Forwarded``; else whether a replica signed it."""
        value = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == FORWARDED.encode()), None
        )
        if value is None:
            return None
        return forwarded_ok(self.key, value, _method(scope), scope["path"])

    def _signed(self, scope: Scope) -> tuple[str, str]:
        return (FORWARDED, sign_forwarded(self.key, _method(scope), scope["path"]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        forwarded = self._forwarded(scope)
        if forwarded is False:
            err = Forbidden(
                "X-Pal-Forwarded is sent by control-plane replicas only, and this one does not verify"
            )
            if scope["type"] == "http":
                await _error(send, err)
            else:
                await deny(scope, send, err.status, err.to_body())
            return
        if forwarded or self._local(scope) or await self.is_leader():
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._forward_http(scope, receive, send)
        else:
            await self._forward_websocket(scope, receive, send)

    # -- finding a leader that answers ------------------------------------------------------

    async def _to_leader(self, attempt: Callable[[str], Awaitable[Any]], what: str) -> tuple[str, Any] | None:
        """``attempt(url)`` on the leader; retried (every RETRY_S, for at most failover_s)
        while there is no leader or the one the lease names refuses connections. Returns
        (url, attempt's result), or None when this replica leads meanwhile; raises NotLeader
        when no leader answered in time."""
        deadline = time.monotonic() + self.failover_s
        refused: str | None = None
        while True:
            url = await self._leader_url()
            if url is None and await self.is_leader():
                return None
            if url is not None:
                try:
                    return url, await attempt(url)
                except _NeverReached as exc:
                    if url != refused:
                        log.warning("forwarding %s to the leader %s: %s; retrying", what, url, exc.__cause__)
                    refused = url
            if time.monotonic() >= deadline:
                if await self.is_leader():
                    return None
                if refused:
                    raise NotLeader(f"the leader ({refused}) did not answer; retry shortly")
                raise NotLeader("no control-plane replica leads right now; retry shortly")
            await asyncio.sleep(RETRY_S)

    async def _leader_url(self) -> str | None:
        try:
            return await self.leader_url()
        except Exception as exc:
            log.warning("cannot read the leadership lease: %s", exc)
            return None

    # -- HTTP --------------------------------------------------------------------------------

    async def _body_limit(self, scope: Scope) -> int | PalError:
        """How much of this request's body the follower may hold, or the error that refuses it
        before a byte is read (an anonymous caller whose body may pass the small bound)."""
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        chunked = any(k.lower() == b"transfer-encoding" for k, _ in scope["headers"])
        declared = int(length) if length is not None and length.isdigit() else None
        small = declared is not None and declared <= UNAUTHENTICATED_BODY_MAX
        if small or (declared is None and not chunked):
            return MAX_FORWARDED_BODY
        if self.known_caller is not None and await self.known_caller(scope):
            return MAX_FORWARDED_BODY
        if declared is not None:
            return _anonymous_too_big()
        return UNAUTHENTICATED_BODY_MAX

    async def _forward_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = await self._body_limit(scope)
        if isinstance(limit, PalError):
            await _error(send, limit)
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > limit:
                tiny = limit == UNAUTHENTICATED_BODY_MAX
                await _error(send, _anonymous_too_big() if tiny else TooLarge("request body too large"))
                return
            if not msg.get("more_body"):
                break
        keep = {"host"} if self.keep_host else set()
        headers = [
            (k.decode(), v.decode())
            for k, v in scope["headers"]
            if k.decode().lower() not in _HOP or k.decode().lower() in keep
        ]
        target = scope["path"] + ("?" + scope["query_string"].decode() if scope.get("query_string") else "")

        async def attempt(leader: str) -> httpx.Response:
            signed = [*headers, self._signed(scope)]  # at each try: a failover may outlast one
            req = self._http.build_request(
                scope["method"], leader.rstrip("/") + target, headers=signed, content=bytes(body)
            )
            try:
                return await self._http.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                raise _NeverReached from exc

        what = f"{scope['method']} {scope['path']}"
        try:
            got = await self._to_leader(attempt, what)
        except NotLeader as exc:
            await _error(send, exc)
            return
        except httpx.TransportError as exc:
            log.warning("forwarding %s: the leader stopped answering: %s", what, exc)
            await _error(send, _lost_midway())
            return
        if got is None:  # this replica leads now: the request is its own
            await self.app(scope, _replay(bytes(body), receive), send)
            return
        resp = got[1]
        try:
            out = [(k.encode(), v.encode()) for k, v in resp.headers.multi_items() if k.lower() not in _HOP]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.TransportError:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    # -- WebSocket ---------------------------------------------------------------------------

    async def _forward_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        import websockets
        from websockets.asyncio.client import connect

        first = await receive()
        if first["type"] != "websocket.connect":
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _WS_HANDSHAKE
        ]
        protocols = [
            p.strip()
            for k, v in scope["headers"]
            if k.lower() == b"sec-websocket-protocol"
            for p in v.decode("latin-1").split(",")
            if p.strip()
        ]
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"origin"), None)
        path = scope.get("raw_path") or scope["path"].encode()
        target = path.decode("latin-1") + (
            "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""
        )

        host = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"), None)

        async def attempt(leader: str) -> Any:
            url = re.sub(r"^http", "ws", leader.rstrip("/")) + target
            to: dict[str, Any] = {}
            if self.keep_host and host:  # the port's name in the handshake, the leader's address
                where = urlsplit(leader)
                url = f"{'wss' if where.scheme == 'https' else 'ws'}://{host}{target}"
                to = {"host": where.hostname, "port": where.port or (443 if where.scheme == "https" else 80)}
                if where.scheme == "https":
                    to["server_hostname"] = where.hostname
            try:
                return await connect(
                    url,
                    **to,
                    additional_headers=[*headers, self._signed(scope)],  # signed at each try
                    subprotocols=protocols or None,
                    origin=origin,
                    compression=None,
                    max_size=MAX_WS_MESSAGE,
                    ping_interval=None,
                    open_timeout=30,
                )
            except TimeoutError:
                raise  # the handshake may have reached it (a slow wake): not sent again
            except OSError as exc:  # refused, unreachable: the leader never saw it
                raise _NeverReached from exc

        what = f"WebSocket {scope['path']}"
        try:
            got = await self._to_leader(attempt, what)
        except NotLeader as exc:
            await deny(scope, send, exc.status, exc.to_body())
            return
        except websockets.InvalidStatus as exc:  # the leader refused it: its answer, as it is
            body = exc.response.body or b""
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = {"error": {"code": "REFUSED", "message": body.decode(errors="replace")[:200]}}
            await deny(scope, send, exc.response.status_code, parsed)
            return
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            log.warning("forwarding %s: the leader stopped answering: %s", what, exc)
            err = _lost_midway()
            await deny(scope, send, err.status, err.to_body())
            return
        if got is None:
            await self.app(scope, _replay_ws(first, receive), send)
            return
        upstream = got[1]
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay(receive, send, upstream)

    async def aclose(self) -> None:
        await self._http.aclose()


def _anonymous_too_big() -> PalError:
    return Unauthorized(
        f"a request body over {UNAUTHENTICATED_BODY_MAX} bytes needs credentials this replica can check "
        "(an API key, the operator token, a dashboard session): send them first"
    )


def _lost_midway() -> PalError:
    return NotLeader(
        "the leader stopped answering in the middle of this request: it may or may not have been "
        "carried out; check (GET) before sending it again"
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The request body once more, for the local app; then the client's own messages (its
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again


def _replay_ws(first: Message, receive: Receive) -> Receive:
    """The client's ``websocket.connect`` once more, then its messages."""
    pending = [first]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again


async def _error(send: Send, err: Any) -> None:
    body = json.dumps(err.to_body()).encode() + b"\n"
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def forward_to_leader(
    app: Any,
    scheduler: Scheduler | None,
    *,
    failover_s: float,
    key: bytes,
    known_caller: Callable[[Scope], Awaitable[bool]] | None,
    keep_host: bool = False,
) -> None:
    """Put :class:`ForwardToLeader` on ``app`` when ``scheduler`` runs under a leadership
    (a replica of ``pal server``); ``pal up``'s single process has none."""
    if scheduler is None:
        return
    leader = scheduler.leader
    app.add_middleware(
        ForwardToLeader,
        is_leader=leader.is_leader,
        leader_url=leader.leader_url,
        failover_s=failover_s,
        key=key,
        known_caller=known_caller,
        keep_host=keep_host,
    )

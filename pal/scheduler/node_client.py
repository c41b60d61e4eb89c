"""The control plane's one client of the node RPC (implements
:class:`pal.wire.handlers.NodeCalls` for every verb of pal/wire/verbs.py).

``HttpNode(socket)`` reaches the embedded node of `pal up` over its root-only unix socket;
``HttpNode(url=..., token=...)`` a remote `pal node`, every request carrying the node's
token (``Authorization: Bearer``; pal/wire/auth.py). One code path for both: what one tests,
the other runs. A node that cannot be reached at all answers 503 ``NODE_UNREACHABLE``
(nothing was done there: a resume tries another node).

**Fair shares.** Two kinds of call, on two pools of connections (docs/security.md), chosen
by the verb's declaration:

- **control calls** (heartbeats, spawns, snapshots, stops, and the short guest calls: files,
  a process's state, stdin, signals) each end by their own deadline, and have connections
  of their own that no long-lived call ever takes;
- **long-lived calls** (streams: exec, a process's output, a cell; long polls; a kernel's
  start; a port tunnel) each hold a slot of the node's budget (:class:`StreamSlots`) while
  they last, on a pool that grows with them up to that budget. Past it a new one is 429 at
  once: a call never waits for a connection without end.

Who may hold how many of those slots (per tenant, per VM) is the scheduler's rule
(streams.py); this is the node's own ceiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from pal.errors import TooManyRequests, Unavailable
from pal.wire import http
from pal.wire.tunnel import MAX_FRAME, TunnelStream, open_tunnel
from pal.wire.verbs import Call, Stream, Tunnel

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)
Ev = TypeVar("Ev", bound=BaseModel)

# The node could not be reached at all (nothing was done there): callers may try another.
UNREACHABLE = "NODE_UNREACHABLE"

CONNECT_TIMEOUT_S = 5.0
# A control call waits this long at most for a free connection of its own pool.
CONTROL_POOL_WAIT_S = 30.0
CONTROL_CONNECTIONS = 100
DEFAULT_MAX_STREAMS = 1024
# A stream runs as long as it runs. Its slot is taken before the request, so its pool has a
# connection for it: the pool wait is a hang guard.
STREAM_TIMEOUT = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S, pool=10.0)
TUNNEL_OPEN_TIMEOUT_S = 30.0  # the node's connect to the guest has its own 10 s bound


class StreamSlots:
    """The long-lived calls open to one node, at most ``limit``; a new one past it is 429
    at once. The embedded node and a remote one keep the same count."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self) -> None:
        if self.held >= self.limit:
            raise TooManyRequests(
                f"this node already carries {self.held} long-lived calls (streams, attaches, "
                f"long polls, cells, port tunnels), its budget (PAL_NODE_MAX_STREAMS={self.limit}): "
                "retry when some have ended"
            )
        self.held += 1

    def give(self) -> None:
        self.held = max(0, self.held - 1)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        self.take()
        try:
            yield
        finally:
            self.give()


def unreachable(exc: Exception) -> Unavailable:
    # httpx's errors often have no text (a reset connection reads as ReadError('')).
    return Unavailable(f"runtime manager unreachable: {str(exc) or type(exc).__name__}", code=UNREACHABLE)


class HttpNode:
    """``max_streams``: the node's budget of long-lived calls."""

    def __init__(
        self,
        socket_path: Path | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if (socket_path is None) == (url is None):
            raise ValueError("HttpNode needs exactly one of a unix socket path or a URL")
        self.socket_path = socket_path
        self.url = url
        self._auth_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.slots = StreamSlots(max_streams)
        self._control = self._client(httpx.Limits(max_connections=CONTROL_CONNECTIONS))
        # Grows with the streams open, up to their budget (one connection each).
        self._streams = self._client(httpx.Limits(max_connections=max_streams, max_keepalive_connections=32))

    def _client(self, limits: httpx.Limits) -> httpx.AsyncClient:
        uds = str(self.socket_path) if self.socket_path is not None else None
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits),
            base_url=self.url or "http://manager",
            headers=self._auth_headers,
        )

    async def aclose(self) -> None:
        await self._control.aclose()
        await self._streams.aclose()

    # ------------------------------------------------------------------ the verbs

    async def call(self, verb: Call[Req, Ans], req: Req) -> Ans:
        out = http.encode_request(verb, req)
        timeout = httpx.Timeout(verb.timeout(req), connect=CONNECT_TIMEOUT_S, pool=CONTROL_POOL_WAIT_S)
        with self.slots.slot() if verb.is_long(req) else contextlib.nullcontext():
            pool = self._streams if verb.is_long(req) else self._control
            try:
                resp = await pool.request(
                    out.method,
                    out.path,
                    params=out.params,
                    json=out.json,
                    content=out.content,
                    timeout=timeout,
                )
            except httpx.TransportError as exc:
                raise unreachable(exc) from exc
        if resp.status_code >= 400:
            raise http.error_of(resp.status_code, resp.content)
        ans: Ans = http.decode_answer(verb, resp.headers, resp.content)
        return ans

    async def stream(self, verb: Stream[Req, Ev], req: Req) -> AsyncGenerator[Ev, None]:
        out = http.encode_request(verb, req)
        try:
            with self.slots.slot():
                async with self._streams.stream(
                    out.method, out.path, params=out.params, json=out.json, timeout=STREAM_TIMEOUT
                ) as resp:
                    if resp.status_code >= 400:
                        raise http.error_of(resp.status_code, await resp.aread())
                    async for line in resp.aiter_lines():
                        if line.strip():
                            ev: Ev = http.decode_event(verb, line)
                            yield ev
        except httpx.TransportError as exc:
            raise unreachable(exc) from exc

    async def open(self, verb: Tunnel[Req], req: Req) -> TunnelStream:
        out = http.encode_request(verb, req)
        self.slots.take()  # a tunnel is long-lived: given back when it closes
        try:
            stream = await self._open_tunnel(out.path)
        except BaseException:
            self.slots.give()
            raise
        stream.on_close(self.slots.give)
        return stream

    async def _open_tunnel(self, path: str) -> TunnelStream:
        from websockets.asyncio.client import connect, unix_connect

        opts: dict[str, Any] = {
            "max_size": MAX_FRAME,
            "compression": None,
            "open_timeout": TUNNEL_OPEN_TIMEOUT_S,
            "additional_headers": self._auth_headers,
        }
        try:
            if self.socket_path is not None:
                # A local socket: no dead peer to detect with pings.
                ws = await unix_connect(
                    str(self.socket_path), "ws://manager" + path, ping_interval=None, **opts
                )
            else:
                assert self.url is not None
                base = self.url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
                ws = await connect(base + path, **opts)
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}", code=UNREACHABLE) from exc
        except Exception as exc:  # a refused handshake (websockets.InvalidStatus...)
            raise Unavailable(f"runtime manager refused the port stream: {exc}") from exc
        return await open_tunnel(ws)

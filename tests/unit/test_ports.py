"""Ports without VMs: the proxy's header rules, signed links, the tunnel framing over real
loopback sockets, and the guest relay against real local servers."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from websockets.sync.server import ServerConnection, serve

from pal.api.ports import (
    _header_items,
    _query_without_token,
    _scope_cookie,
    _target,
    forwarded_headers,
    proxy_websocket,
)
from pal.errors import BadGateway
from pal.guest import portrelay
from pal.wire import tunnel


def test_forwarded_headers_like_a_reverse_proxy() -> None:
    given = [
        (b"host", b"pal.example:8080"),
        (b"authorization", b"Bearer pal_secretkey"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"transfer-encoding", b"chunked"),
        (b"cookie", b"a=1; pal_link=tok; b=2"),
        (b"x-forwarded-for", b"10.0.0.9"),
        (b"x-forwarded-host", b"spoofed"),
        (b"accept", b"*/*"),
    ]
    out = dict(forwarded_headers(given, client="127.0.0.1", scheme="https", prefix="/p"))
    assert out[b"host"] == b"pal.example:8080"
    assert out[b"x-forwarded-host"] == b"pal.example:8080"
    assert out[b"x-forwarded-for"] == b"10.0.0.9, 127.0.0.1"
    assert out[b"x-forwarded-proto"] == b"https"
    assert out[b"x-forwarded-prefix"] == b"/p"
    assert out[b"cookie"] == b"a=1; b=2"
    assert out[b"accept"] == b"*/*"
    for gone in (b"authorization", b"connection", b"x-hop", b"keep-alive", b"transfer-encoding"):
        assert gone not in out
    # The app's own Authorization (not a Pal key) goes through.
    basic = [(b"authorization", b"Basic dTpw")]
    app_auth = dict(forwarded_headers(basic, client="c", scheme="http", prefix=""))
    assert app_auth[b"authorization"] == b"Basic dTpw"


class _GuestWsStream:
    """A tunnel stand-in: a plain TCP connection to a local WebSocket server (the guest's),
    opened on first use in the proxy's own event loop."""

    route = "direct"

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None

    async def _c(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.conn is None:  # one connection, whichever direction asks first
            self.conn = asyncio.create_task(asyncio.open_connection("127.0.0.1", self.port))
        return await self.conn

    async def read(self, n: int = 65536) -> bytes:
        return await (await self._c())[0].read(n)

    async def write(self, data: bytes) -> None:
        w = (await self._c())[1]
        w.write(data)
        await w.drain()

    async def write_eof(self) -> None:
        (await self._c())[1].write_eof()

    async def aclose(self) -> None:
        if self.conn is not None:
            (await self.conn)[1].close()


@pytest.mark.parametrize(("scheme", "proto"), [("ws", "http"), ("wss", "https")])
def test_a_proxied_websocket_tells_the_guest_how_the_client_connected(scheme: str, proto: str) -> None:
    """X-Forwarded-Proto of a WebSocket says https when the client used wss, as the HTTP
    path does (a guest app building absolute URLs or secure cookies relies on it)."""
    seen: dict[str, str] = {}

    def echo(conn: ServerConnection) -> None:
        assert conn.request is not None
        seen.update({k.lower(): v for k, v in conn.request.headers.raw_items()})
        for msg in conn:
            conn.send(msg)

    with serve(echo, "127.0.0.1", 0) as guest:
        threading.Thread(target=guest.serve_forever, daemon=True).start()
        port = guest.socket.getsockname()[1]
        app = FastAPI()

        @app.websocket("/v1/runtime/vms/vm-1/ports/8000/{path:path}")
        async def proxied(ws: WebSocket, path: str) -> None:
            target = _target(ws.scope["raw_path"], b"")
            prefix = "/v1/runtime/vms/vm-1/ports/8000"
            await proxy_websocket(ws, _GuestWsStream(port), _header_items(ws.scope), target, 8000, prefix)  # type: ignore[arg-type]

        with TestClient(app).websocket_connect(
            f"{scheme}://pal.example/v1/runtime/vms/vm-1/ports/8000/echo"
        ) as ws:
            ws.send_text("hi")
            assert ws.receive_text() == "hi"
        guest.shutdown()
    assert seen["x-forwarded-proto"] == proto
    assert seen["x-forwarded-prefix"] == "/v1/runtime/vms/vm-1/ports/8000"


def test_guest_cookies_stay_under_the_port_path() -> None:
    assert _scope_cookie(b"sid=1; Path=/app; Domain=pal.example; HttpOnly", "/v1/x/ports/80") == (
        b"sid=1; HttpOnly; Path=/v1/x/ports/80/app"
    )
    assert _scope_cookie(b"a=b", "/pre") == b"a=b; Path=/pre/"


def test_query_token_removed_and_target_kept_byte_for_byte() -> None:
    assert _query_without_token(b"a=1&palToken=xyz&b=%20") == (b"a=1&b=%20", "xyz")
    assert _query_without_token(b"") == (b"", None)
    assert _target(b"/v1/runtime/vms/vm-1/ports/80/a%2Fb/c", b"q=1") == b"/a%2Fb/c?q=1"
    assert _target(b"/v1/runtime/vms/vm-1/ports/80/", b"") == b"/"


class _FakeServerWs:
    """Starlette's WebSocket as serve_stream uses it, fed from a queue."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[bytes | str] = []
        self.closed = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    async def send_text(self, data: str) -> None:
        self.sent.append(data)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed.set()


async def test_tunnel_relays_half_closes_and_counts_traffic() -> None:
    """A real TCP echo-ish server: the tunnel's bytes reach it, its answer comes back, eof
    travels both ways, and every chunk moved is reported as activity."""
    got = bytearray()

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        got.extend(await r.read())  # until the tunnel's eof
        w.write(b"answer:" + bytes(got))
        await w.drain()
        w.close()

    srv = await asyncio.start_server(server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ws = _FakeServerWs()
    traffic: list[int] = []
    task = asyncio.create_task(tunnel.serve_stream(ws, reader, writer, lambda: traffic.append(1)))
    await ws.inbox.put({"type": "websocket.receive", "bytes": b"hello "})
    await ws.inbox.put({"type": "websocket.receive", "bytes": b"world"})
    await ws.inbox.put({"type": "websocket.receive", "text": tunnel.EOF})
    await asyncio.wait_for(task, 30)
    assert bytes(got) == b"hello world"
    assert b"".join(x for x in ws.sent if isinstance(x, bytes)) == b"answer:hello world"
    assert ws.sent[-1] == tunnel.EOF and ws.closed.is_set()
    assert len(traffic) >= 3
    srv.close()


def test_status_frames_round_trip() -> None:
    assert tunnel.parse_status(tunnel.status_frame("relay")) == "relay"
    with pytest.raises(BadGateway, match="nothing"):
        tunnel.parse_status(tunnel.error_frame(BadGateway("nothing is listening")))


def _relay_pair(port_line: bytes, server: socket.socket | None = None) -> bytes:
    """Run the relay's per-connection code on a socketpair; returns what it answered."""
    a, b = socket.socketpair()
    t = threading.Thread(target=portrelay._serve, args=(b,), daemon=True)
    t.start()
    a.sendall(port_line)
    a.settimeout(30)
    answer = a.recv(64)
    if server is not None:  # the relay connected: that connection ends, so does the relay
        conn, _ = server.accept()
        conn.sendall(b"from-server")
        conn.close()
        assert a.recv(64) == b"from-server"
    a.close()
    t.join(30)
    assert not t.is_alive()
    return answer


def test_relay_connects_to_loopback_and_refuses_garbage() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    assert _relay_pair(f"PORT {port}\n".encode(), srv) == b"OK\n"
    srv.close()
    with socket.socket() as probe:  # a port with nothing on it
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert _relay_pair(f"PORT {free}\n".encode()) == b"ERR ECONNREFUSED\n"
    for bad in (b"PORT 0\n", b"PORT 70000\n", b"GET / HTTP/1.1\n", b"PORT 80\nextra"):
        assert _relay_pair(bad) == b""  # closed without an answer

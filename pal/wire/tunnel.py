"""A TCP byte stream carried over a WebSocket: the control plane's way to a guest's port.

Used on two hops with the same framing: control plane -> node (the node RPC's
``/vms/{id}/ports/{port}``), and client -> control plane (``pal vm port-forward`` through
the API's ``/v1/runtime/vms/{id}/tunnel/{port}``).

Wire, after the WebSocket handshake:
- the serving side first sends one text frame, ``{"ok": true, "route": ...}`` or
  ``{"error": {"code", "message"}, "status": N}``;
- then binary frames are the stream's bytes, both ways;
- a text frame ``eof`` means its sender will send no more bytes (TCP half-close);
- closing the WebSocket ends the stream (both ways).

Flow control is the WebSocket library's and TCP's: a sender waits while its peer's buffers
are full (``send`` awaits the transport draining; the receiving side holds at most a few
frames), so one slow reader never grows memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from pal.errors import PalError, Unavailable, from_wire

EOF = "eof"
FRAME_BYTES = 64 * 1024
MAX_FRAME = 1024 * 1024  # what a receiver accepts in one frame


@dataclass
class Opened:
    """What a node's tunnel handler opened: a TCP stream (to a guest's server), the way it
    went (``direct``, ``relay``), and what bytes moved on it mean (the VM's activity)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    route: str
    on_traffic: Callable[[], None] = field(default=lambda: None)


class ServerSocket(Protocol):
    """What :func:`serve_stream` needs of the accepting side (Starlette's WebSocket)."""

    async def receive(self) -> Any: ...
    async def send_bytes(self, data: bytes) -> None: ...
    async def send_text(self, data: str) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


def status_frame(route: str) -> str:
    return json.dumps({"ok": True, "route": route})


def error_frame(exc: PalError) -> str:
    return json.dumps({**exc.to_body(), "status": exc.status})


def parse_status(text: str) -> str:
    """The route from a first frame; the error it carries, raised as a PalError."""
    try:
        msg = json.loads(text)
    except ValueError:
        raise Unavailable("the tunnel answered something that is not a status") from None
    if isinstance(msg, dict) and msg.get("ok"):
        return str(msg.get("route") or "")
    err = msg.get("error") if isinstance(msg, dict) else None
    if not isinstance(err, dict):
        raise Unavailable("the tunnel answered something that is not a status")
    raise from_wire(int(msg.get("status") or 500), str(err.get("code")), str(err.get("message")))


async def run_until_one_ends(*directions: Coroutine[Any, Any, None]) -> None:
    """The directions of a relay together, until one of them ends (or fails); the others
    are cancelled then, and all are awaited before this returns."""
    tasks = [asyncio.create_task(d) for d in directions]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_stream(
    ws: ServerSocket,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    on_traffic: Callable[[], None] = lambda: None,
) -> None:
    """Relay between an accepted WebSocket (status already sent) and a TCP stream until
    both directions ended or either side went away; then close both."""
    done_up = asyncio.Event()  # the WebSocket's peer sent eof
    done_down = asyncio.Event()  # the stream's peer sent eof

    async def up() -> None:  # WebSocket -> stream
        while True:
            msg = await ws.receive()
            if msg.get("type") == "websocket.disconnect":
                return
            data = msg.get("bytes")
            if data is not None:
                writer.write(data)
                await writer.drain()
                on_traffic()
            elif msg.get("text") == EOF:
                if writer.can_write_eof():
                    writer.write_eof()
                done_up.set()
                if done_down.is_set():
                    return

    async def down() -> None:  # stream -> WebSocket
        while True:
            data = await reader.read(FRAME_BYTES)
            if not data:
                await ws.send_text(EOF)
                done_down.set()
                if done_up.is_set():
                    return
                await asyncio.Event().wait()  # the other direction decides the end
            await ws.send_bytes(data)
            on_traffic()

    try:
        await run_until_one_ends(up(), down())
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await ws.close()


class TunnelStream:
    """The client end of a tunnel (a ``websockets`` client connection whose status frame
    said ok): read/write bytes, half-close, close."""

    def __init__(self, ws: Any, route: str = "") -> None:
        self.ws = ws
        self.route = route
        self._buf = b""
        self._eof = False
        self._closers: list[Callable[[], None]] = []  # called once, at the first aclose

    async def read(self, max_bytes: int = FRAME_BYTES) -> bytes:
        """Up to ``max_bytes``; b"" at the end of the stream."""
        import websockets

        while not self._buf and not self._eof:
            try:
                msg = await self.ws.recv()
            except websockets.ConnectionClosed:
                self._eof = True
                break
            if isinstance(msg, str):
                if msg == EOF:
                    self._eof = True
                continue
            self._buf = msg
        out, self._buf = self._buf[:max_bytes], self._buf[max_bytes:]
        return out

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            await self.ws.send(bytes(view[:FRAME_BYTES]))
            view = view[FRAME_BYTES:]

    async def write_eof(self) -> None:
        await self.ws.send(EOF)

    def on_close(self, fn: Callable[[], None]) -> None:
        """``fn`` runs when the stream is closed (what it held is given back)."""
        self._closers.append(fn)

    async def aclose(self) -> None:
        closers, self._closers = self._closers, []
        try:
            with contextlib.suppress(Exception):
                await self.ws.close()
        finally:
            for fn in closers:
                fn()


async def open_tunnel(ws: Any) -> TunnelStream:
    """Read a fresh client connection's status frame: the stream, or the error raised."""
    import websockets

    try:
        first = await ws.recv()
    except websockets.ConnectionClosed as exc:
        raise Unavailable(f"the tunnel closed before it said anything: {exc}") from None
    try:
        route = parse_status(first if isinstance(first, str) else first.decode("utf-8", "replace"))
    except BaseException:
        with contextlib.suppress(Exception):
            await ws.close()
        raise
    return TunnelStream(ws, route)

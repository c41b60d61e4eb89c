"""Forward a local TCP port to a port inside a sandbox, through the Pal API.

Each local connection opens a WebSocket to ``/v1/runtime/vms/{id}/tunnel/{port}`` that
carries its bytes (any protocol: HTTP, WebSocket upgrades, databases). Wire: the server's
first text frame is ``{"ok": true}`` or ``{"error": {...}, "status": N}``; then binary
frames carry the bytes both ways, and a text frame ``eof`` says its sender is done writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from . import _wire
from .errors import PalApiError, error_for

EOF = "eof"
FRAME = 64 * 1024


def tunnel_url(base_url: str, vm_id: str, port: int) -> str:
    scheme, rest = base_url.split("://", 1)
    ws = "wss" if scheme == "https" else "ws"
    return f"{ws}://{rest.rstrip('/')}/v1/runtime/vms/{_wire.seg(vm_id)}/tunnel/{_wire.seg(port)}"


async def open_tunnel(base_url: str, api_key: str | None, vm_id: str, port: int) -> Any:
    """A connected tunnel WebSocket (its status frame read); PalApiError if refused."""
    from websockets.asyncio.client import connect

    ws = await connect(
        tunnel_url(base_url, vm_id, port),
        additional_headers=_wire.headers(api_key),
        max_size=1024 * 1024,
        compression=None,
        open_timeout=300,  # waking an idle-suspended VM takes a restore
    )
    first = await ws.recv()
    try:
        msg = json.loads(first)
    except (TypeError, ValueError):
        msg = {}
    if not isinstance(msg, dict) or not msg.get("ok"):
        await ws.close()
        err = msg.get("error") if isinstance(msg, dict) else None
        if isinstance(err, dict):
            raise error_for(int(msg.get("status") or 500), str(err.get("code")), str(err.get("message")))
        raise error_for(502, "TUNNEL_ERROR", f"unexpected tunnel answer: {str(first)[:200]}")
    return ws


async def wait_listening(
    base_url: str | None, api_key: str | None, vm_id: str, port: int, timeout: float
) -> float:
    """Wait until something listens on ``port`` in the VM (a tunnel to it opens, and is
    closed at once); the seconds it took. PalApiError ``PORT_NOT_LISTENING`` after
    ``timeout``, or at once for any other refusal (404, 409...)."""
    url, key = _wire.resolve(base_url, api_key)
    loop = asyncio.get_running_loop()
    start = loop.time()
    delay = 0.2
    while True:
        try:
            ws = await open_tunnel(url, key, vm_id, port)
        except PalApiError as exc:
            if exc.code != "PORT_NOT_LISTENING" or loop.time() - start + delay > timeout:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        await ws.close()
        return loop.time() - start


async def _splice(ws: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    import websockets

    async def up() -> None:
        while data := await reader.read(FRAME):
            await ws.send(data)
        await ws.send(EOF)

    async def down() -> None:
        try:
            async for msg in ws:
                if isinstance(msg, str):
                    if msg == EOF and writer.can_write_eof():
                        writer.write_eof()
                    continue
                writer.write(msg)
                await writer.drain()
        except websockets.ConnectionClosed:
            pass

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    # The server closes the WebSocket once both directions are done (or on error).
    await tasks[1]
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def forward(
    base_url: str | None,
    api_key: str | None,
    vm_id: str,
    guest_port: int,
    local_port: int = 0,
    host: str = "127.0.0.1",
    *,
    on_ready: Callable[[int], None] | None = None,
    on_error: Callable[[PalApiError], None] | None = None,
) -> None:
    """Listen on ``host:local_port`` (0: any free port, given to ``on_ready``) and forward
    every connection to ``guest_port`` in the VM until cancelled."""
    url, key = _wire.resolve(base_url, api_key)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ws = await open_tunnel(url, key, vm_id, guest_port)
        except PalApiError as exc:
            if on_error is not None:
                on_error(exc)
            writer.close()
            return
        except Exception as exc:
            if on_error is not None:
                on_error(error_for(503, "UNAVAILABLE", f"cannot reach {url}: {exc}"))
            writer.close()
            return
        try:
            await _splice(ws, reader, writer)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()
            writer.close()

    server = await asyncio.start_server(handle, host, local_port)
    port = server.sockets[0].getsockname()[1]
    if on_ready is not None:
        on_ready(port)
    async with server:
        await server.serve_forever()

"""One WebSocket relayed both ways: an accepted ASGI WebSocket (its ``receive`` and
``send``) and a ``websockets`` client connection to where it goes (a port's server in a
guest, or the leader a follower forwards to)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import websockets

from pal.wire.tunnel import run_until_one_ends

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[Any], Awaitable[None]]


async def relay(receive: Receive, send: Send, upstream: Any) -> None:
    """Relay until either side ends; the other is then closed (an abnormal upstream close,
    1006, reaches the client as 1011)."""

    async def client_to_upstream() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                await upstream.close(msg.get("code") or 1000)
                return
            if msg.get("bytes") is not None:
                await upstream.send(msg["bytes"])
            elif msg.get("text") is not None:
                await upstream.send(msg["text"])

    async def upstream_to_client() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in upstream:
                if isinstance(data, str):
                    await send({"type": "websocket.send", "text": data})
                else:
                    await send({"type": "websocket.send", "bytes": data})
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await send(
                {
                    "type": "websocket.close",
                    "code": code if code != 1006 else 1011,
                    "reason": upstream.close_reason or "",
                }
            )

    try:
        await run_until_one_ends(client_to_upstream(), upstream_to_client())
    finally:
        with contextlib.suppress(Exception):
            await upstream.close()

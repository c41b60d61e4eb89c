"""A process attached over a WebSocket (docs/processes.md, "WebSocket attach"): its output
bytes as they come, stdin, terminal resizes and signals, for interactive clients
(`pal vm shell`, `pal vm attach`).

``Attachment.events()`` yields :class:`AttachEvent`: ``output`` (``data`` bytes), ``gap``
(``lost``), and last ``exit`` (``exit_code``) or ``detached`` (``reason``: the VM paused,
moved, its node restarted; the process runs on). ``offset`` is where a reattach resumes
(``open_attach(..., offset=att.offset)``): nothing is lost or repeated.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from . import _wire
from .errors import PalApiError, PalConnectionError, error_for

MAX_INPUT_FRAME = 64 * 1024  # the server's bound on one stdin frame
OPEN_TIMEOUT_S = 300.0  # an attach may wake an idle-suspended VM (a restore)


@dataclass
class AttachEvent:
    type: str  # output | gap | exit | detached | error
    data: bytes = b""
    lost: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    reason: str = ""
    code: str = ""
    message: str = ""
    status: int = 0


def attach_url(base_url: str, vm_id: str, pid: int, offset: int = 0) -> str:
    scheme, rest = base_url.split("://", 1)
    ws = "wss" if scheme == "https" else "ws"
    return f"{ws}://{rest.rstrip('/')}/v1/runtime/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/attach?from={offset}"


class Attachment:
    """One open attach socket; ``offset``: the journal offset after the last byte received."""

    def __init__(self, ws: Any, offset: int, hello: dict[str, Any]) -> None:
        self._ws = ws
        self.offset = offset
        self.pty: dict[str, int] | None = hello.get("pty")

    async def events(self) -> AsyncIterator[AttachEvent]:
        import websockets

        try:
            async for msg in self._ws:
                if isinstance(msg, bytes):
                    self.offset += len(msg)
                    yield AttachEvent("output", data=msg)
                    continue
                ev = _notice(msg)
                if ev is None:
                    continue
                if ev[1] is not None:
                    self.offset = ev[1]
                yield ev[0]
                if ev[0].type in ("exit", "detached", "error"):
                    return
        except websockets.ConnectionClosed:
            pass
        # Closed without saying why (a dropped connection): the process may run on.
        yield AttachEvent("detached", reason="connection-closed")

    async def send(self, data: bytes) -> None:
        """Bytes to its stdin (split into frames the server takes)."""
        for i in range(0, len(data), MAX_INPUT_FRAME):
            await self._ws.send(data[i : i + MAX_INPUT_FRAME])

    async def resize(self, cols: int, rows: int) -> None:
        await self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def signal(self, signal: str) -> None:
        await self._ws.send(json.dumps({"type": "signal", "signal": signal}))

    async def eof(self) -> None:
        await self._ws.send(json.dumps({"type": "eof"}))

    async def close(self) -> None:
        await self._ws.close()


def _notice(text: str) -> tuple[AttachEvent, int | None] | None:
    try:
        msg = json.loads(text)
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None
    kind, offset = str(msg.get("type", "")), msg.get("offset")
    at = int(offset) if isinstance(offset, int) else None
    if kind == "gap":
        return AttachEvent("gap", lost=int(msg.get("lost") or 0)), at
    if kind == "exit":
        code = msg.get("exitCode")
        ev = AttachEvent("exit", exit_code=int(code) if code is not None else None)
        ev.timed_out = bool(msg.get("timedOut"))
        return ev, at
    if kind == "detached":
        return AttachEvent("detached", reason=str(msg.get("reason") or "detached")), at
    if kind == "error":
        ev = AttachEvent("error", code=str(msg.get("code", "")), message=str(msg.get("message", "")))
        ev.status = int(msg.get("status") or 0)
        return ev, at
    return None  # "attached" and notices this SDK does not know


async def open_attach(
    base_url: str | None, api_key: str | None, vm_id: str, pid: int, offset: int = 0
) -> Attachment:
    """Attach to process ``pid`` from ``offset``; PalApiError when refused (404, 409...)."""
    import websockets
    from websockets.asyncio.client import connect

    url, key = _wire.resolve(base_url, api_key)
    try:
        ws = await connect(
            attach_url(url, vm_id, pid, offset),
            additional_headers=_wire.headers(key),
            max_size=16 * 1024 * 1024,
            compression=None,
            open_timeout=OPEN_TIMEOUT_S,
        )
    except websockets.InvalidStatus as exc:
        raise _wire.error_from(exc.response.status_code, bytes(exc.response.body or b"")) from None
    except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
        raise PalConnectionError(0, "CONNECTION_ERROR", f"cannot reach Pal at {url}: {exc}") from exc
    try:
        hello = json.loads(await ws.recv())
    except (ValueError, websockets.ConnectionClosed) as exc:
        await ws.close()
        raise error_for(502, "ATTACH_ERROR", f"unexpected attach answer: {exc}") from None
    if not isinstance(hello, dict) or hello.get("type") != "attached":
        await ws.close()
        raise PalApiError(502, "ATTACH_ERROR", f"unexpected attach answer: {str(hello)[:200]}")
    return Attachment(ws, offset, hello)

"""Host end of the virtio-serial channel to one VM's guest harness.

Multiplexes requests over the line-JSON protocol of ``pal/guest/protocol.py``: each request
gets an id and a queue; a single reader task routes replies and stream chunks to their
queue and keeps the latest heartbeat. The channel is per QEMU process: a restored VM gets a
new channel to its new process's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pal.errors import BackendError, GuestTimeout
from pal.guest import protocol as p

log = logging.getLogger(__name__)

_CLOSED = object()  # queue sentinel: the channel went away


class ChannelClosed(BackendError):
    code = "GUEST_DISCONNECTED"


class GuestError(BackendError):
    """An ``err`` reply from the harness; ``guest_code`` is one of protocol.ERR_*."""

    def __init__(self, guest_code: str, message: str) -> None:
        super().__init__(message, code=guest_code)
        self.guest_code = guest_code


class HarnessChannel:
    def __init__(self, socket_path: Path, vm_id: str) -> None:
        self.socket_path = socket_path
        self.vm_id = vm_id
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue[Any]] = {}
        self._write_lock = asyncio.Lock()
        self.heartbeat: p.Message | None = None
        self.heartbeat_at = 0.0  # host monotonic time of the latest heartbeat
        self._hb_cond = asyncio.Condition()
        self.closed = asyncio.Event()

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to QEMU's chardev socket (it exists as soon as QEMU is up)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=p.MAX_LINE_BYTES
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise BackendError(f"VM {self.vm_id}: agent socket did not appear") from None
                await asyncio.sleep(0.005)
        # Terminate any half line the guest may hold from a previous connection.
        self._writer.write(b"\n")
        self._task = asyncio.create_task(self._read_loop(), name=f"channel-{self.vm_id}")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    continue  # an over-long line is noise; resync on the next one
                if not line:
                    break
                msg = p.decode(line)
                if msg is None:
                    continue
                rid = msg.get("id", 0)
                if msg["k"] == p.K_HEARTBEAT:
                    self.heartbeat = msg
                    self.heartbeat_at = time.monotonic()
                    async with self._hb_cond:
                        self._hb_cond.notify_all()
                    continue
                q = self._pending.get(rid)
                if q is not None:
                    q.put_nowait(msg)
        except (ConnectionError, OSError) as exc:
            log.debug("channel %s: %s", self.vm_id, exc)
        finally:
            self.closed.set()
            for q in self._pending.values():
                q.put_nowait(_CLOSED)
            async with self._hb_cond:
                self._hb_cond.notify_all()

    async def _send(self, msg: p.Message, data: bytes | None = None) -> None:
        if self._writer is None or self.closed.is_set():
            raise ChannelClosed(f"VM {self.vm_id}: guest channel is closed")
        async with self._write_lock:
            self._writer.write(p.encode(msg, data))
            try:
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise ChannelClosed(f"VM {self.vm_id}: guest channel broke: {exc}") from exc

    async def request(
        self, msg: p.Message, data: bytes | None = None, timeout: float = 30.0
    ) -> tuple[p.Message, bytes]:
        """Send one request and wait for its single ``ok`` (or raise on ``err``)."""
        rid = next(self._ids)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[rid] = q
        try:
            await self._send({**msg, "id": rid}, data)
            try:
                reply = await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                raise GuestTimeout(
                    f"VM {self.vm_id}: guest did not answer {msg['k']} in {timeout:g}s"
                ) from None
            if reply is _CLOSED:
                raise ChannelClosed(f"VM {self.vm_id}: guest channel closed during {msg['k']}")
            if reply["k"] == p.K_ERR:
                raise GuestError(reply.get("code", p.ERR_IO), reply.get("msg", "guest error"))
            return reply, p.payload(reply)
        finally:
            self._pending.pop(rid, None)

    async def stream(self, msg: p.Message) -> AsyncIterator[p.Message]:
        """Send a streaming request (exec); yield every reply until ``exit``/``err``.

        If the consumer stops early (client went away), the guest process is cancelled.
        """
        rid = next(self._ids)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[rid] = q
        finished = False
        try:
            await self._send({**msg, "id": rid})
            while True:
                reply = await q.get()
                if reply is _CLOSED:
                    finished = True
                    raise ChannelClosed(f"VM {self.vm_id}: guest channel closed during exec")
                if reply["k"] in (p.K_EXIT, p.K_ERR):
                    finished = True
                yield reply
                if finished:
                    return
        finally:
            self._pending.pop(rid, None)
            if not finished and not self.closed.is_set():
                with contextlib.suppress(Exception):
                    await self._send({"id": next(self._ids), "k": p.K_CANCEL, "target": rid})

    async def wait_heartbeat(self, incarnation: int, timeout: float) -> p.Message:
        """Wait until the harness heartbeats as ``incarnation`` (its identity is in place)."""
        deadline = time.monotonic() + timeout
        async with self._hb_cond:
            while True:
                hb = self.heartbeat
                # vm_id too: a template's or fork source's guest may heartbeat with the same
                # incarnation number before it has processed our identify.
                if hb is not None and hb.get("incarnation") == incarnation and hb.get("vm_id") == self.vm_id:
                    return hb
                if self.closed.is_set():
                    raise ChannelClosed(f"VM {self.vm_id}: guest channel closed before it was ready")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GuestTimeout(
                        f"VM {self.vm_id}: harness did not report incarnation {incarnation} in {timeout:g}s"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hb_cond.wait(), left)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.closed.set()

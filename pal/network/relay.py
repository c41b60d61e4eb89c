"""One guest TCP connection through the gateway: guest socket <-> upstream socket.

A :class:`Connection` is the object the node can ask about and steer:
- ``waiting``: the guest has sent a request and no response byte has reached it since
  (what a wait-pause needs to know);
- ``hold()`` / ``release()``: stop delivering upstream data to the guest while still
  reading it into a bounded buffer (up to ``max_buffer`` bytes; beyond that upstream
  reading stops, which is TCP backpressure towards the server), then deliver it. The
  upstream's end (EOF) is held back too, and delivered after the data.
- ``on_waiting(conn, waiting)``: called when ``waiting`` changes; ``on_held(conn, what)``
  while held: ``data`` (bytes were buffered), ``full`` (the buffer reached its cap),
  ``eof`` / ``closed`` (the upstream ended or failed).

Flow control is end to end: a side whose socket buffer fills pauses reading on the other
side, and the VM's rate limit (egressMbps) pauses reading for the time its bucket needs.
The bytes a connection keeps itself (the guest's before the upstream is connected, the
upstream's while held) are charged to the VM's byte budget (``budget``, budgets.py): over
it, reading stops until the budget has room again (backpressure; nothing is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from pal.network.budgets import Account
from pal.spec import DEFAULT_HOLD_BUFFER

READ_LIMIT = 256 * 1024  # asyncio transport high-water mark per direction


class TokenBucket:
    """Bytes per second with a one-second burst; ``take`` says how long to wait."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate_bytes_s
        self.tokens = rate_bytes_s
        self.clock = clock
        self.at = clock()

    def take(self, n: int) -> float:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class Valve:
    """Reading on one transport, paused while any reason holds."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reasons: set[str] = set()

    def attach(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if self.reasons:
            transport.pause_reading()

    def close(self, reason: str) -> None:
        if not self.reasons and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self.reasons.add(reason)

    def open(self, reason: str) -> None:
        if reason not in self.reasons:
            return
        self.reasons.discard(reason)
        if not self.reasons and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


def reset(transport: asyncio.BaseTransport | None) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer sees ECONNRESET at once."""
    if transport is None or transport.is_closing():
        if transport is not None:
            transport.abort()  # type: ignore[attr-defined]
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # type: ignore[attr-defined]


class Connection:
    """Both halves of one relayed connection. The gateway creates it when the guest
    connects; :meth:`attach_upstream` joins the upstream side once policy allowed it."""

    def __init__(
        self,
        conn_id: int,
        guest: asyncio.Transport,
        dst: tuple[str, int],
        *,
        up_bucket: TokenBucket | None = None,
        down_bucket: TokenBucket | None = None,
        on_bytes: Callable[[int, int], None] | None = None,
        on_close: Callable[[Connection], None] | None = None,
        max_buffer: int = DEFAULT_HOLD_BUFFER,
        on_waiting: Callable[[Connection, bool], None] | None = None,
        on_held: Callable[[Connection, str], None] | None = None,
        budget: Account | None = None,
    ) -> None:
        self.id = conn_id
        self.dst = dst  # what the guest asked for: (ip, port)
        self.name: str | None = None  # the name it asked for (DNS, SNI or Host)
        self.upstream_addr: tuple[str, int] | None = None
        self.rule = ""
        self.state = "deciding"  # deciding | connecting | open | closed
        self.opened_at = time.time()
        self.bytes_up = 0  # guest -> upstream
        self.bytes_down = 0  # upstream -> guest (delivered)
        self.last_up = 0.0
        self.last_down = 0.0
        self.held = False
        self.max_buffer = max_buffer
        self._held_data = bytearray()
        self._pending_up = bytearray()  # guest bytes before the upstream is connected
        self.guest = guest
        self.upstream: asyncio.Transport | None = None
        self.guest_valve = Valve()  # reading from the guest
        self.up_valve = Valve()  # reading from upstream
        self.guest_valve.attach(guest)
        self._up_bucket = up_bucket
        self._down_bucket = down_bucket
        self._on_bytes = on_bytes
        self._on_close = on_close
        self._guest_eof = False
        self._up_eof = False
        self._eof_sent = False  # the upstream's EOF was passed to the guest
        self._timers: list[asyncio.TimerHandle] = []
        self._on_waiting = on_waiting
        self._on_held = on_held
        self._was_waiting = False
        self._budget = budget
        self._charged = 0  # bytes of _pending_up and _held_data charged to the budget
        self._more = asyncio.Event()  # guest bytes arrived (or the end) while deciding
        # Checks of what the connection says (namecheck.py): the guest's bytes pass
        # ``inspect_up`` before they go up (it returns what may go now; None: it reset the
        # connection); the upstream's are shown to ``inspect_down``.
        self.inspect_up: Callable[[bytes], bytes | None] | None = None
        self.inspect_down: Callable[[bytes], None] | None = None

    # -- what the node can ask --------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Request sent, no response byte delivered since."""
        return self.state == "open" and self.last_up > 0 and self.last_up >= self.last_down

    @property
    def buffered(self) -> int:
        return len(self._held_data)

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "dst": f"{self.dst[0]}:{self.dst[1]}",
            "upstream": f"{self.upstream_addr[0]}:{self.upstream_addr[1]}" if self.upstream_addr else None,
            "state": self.state,
            "bytesUp": self.bytes_up,
            "bytesDown": self.bytes_down,
            "waiting": self.waiting,
            "held": self.held,
            "buffered": self.buffered,
            "openedAt": self.opened_at,
        }

    def hold(self) -> None:
        self.held = True

    def release(self) -> int:
        """Deliver what was held (data, then the upstream's end); returns the bytes."""
        self.held = False
        n = len(self._held_data)
        if self._held_data and self.state == "open":
            data, self._held_data = bytes(self._held_data), bytearray()
            self._deliver(data)
        self._held_data = bytearray()
        self._refund(n)
        self.up_valve.open("hold")
        if self._up_eof and self.state == "open":
            # The upstream finished while held: the guest gets the end now, after the data.
            if self.upstream is None or self.upstream.is_closing():
                self.close()
            else:
                self._eof_to_guest()
                self._maybe_done()
        return n

    def _check_waiting(self) -> None:
        now = self.waiting
        if now != self._was_waiting:
            self._was_waiting = now
            if self._on_waiting is not None:
                self._on_waiting(self, now)

    def _held_event(self, what: str) -> None:
        if self._on_held is not None:
            self._on_held(self, what)

    # -- the guest side ---------------------------------------------------------------------

    def guest_data(self, data: bytes) -> None:
        if self.state == "open" and self.upstream is not None:
            self._send_up(data)
        elif self.state in ("deciding", "connecting"):
            self._pending_up += data
            self._more.set()
            if len(self._pending_up) > READ_LIMIT:
                self.guest_valve.close("pending")
            self._charge(len(data), self.guest_valve)

    def pending_bytes(self) -> bytes:
        return bytes(self._pending_up)

    async def more_pending(self, deadline: float) -> bool:
        """Wait (no polling) until more guest bytes arrive while deciding, the connection
        closes, or the loop's clock reaches ``deadline``; False on the deadline."""
        self._more.clear()
        if self.state == "closed":
            return False
        timeout = deadline - asyncio.get_running_loop().time()
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._more.wait(), timeout)
        except TimeoutError:
            return False
        return self.state != "closed"

    # -- the VM's byte budget ------------------------------------------------------------------

    def _charge(self, n: int, valve: Valve) -> None:
        if self._budget is None:
            return
        self._budget.take(n)
        self._charged += n
        if not self._budget.has_room():
            valve.close("budget")
            self._budget.wait_for_room(self._budget_room)

    def _refund(self, n: int) -> None:
        n = min(n, self._charged)
        if self._budget is not None and n > 0:
            self._charged -= n
            self._budget.give(n)

    def _budget_room(self) -> None:
        self.guest_valve.open("budget")
        self.up_valve.open("budget")

    def guest_eof(self) -> None:
        self._guest_eof = True
        if self.upstream is not None and self.upstream.can_write_eof():
            self.upstream.write_eof()
        self._maybe_done()

    def guest_pause_writing(self) -> None:
        self.up_valve.close("guest-full")

    def guest_resume_writing(self) -> None:
        self.up_valve.open("guest-full")

    # -- the upstream side ------------------------------------------------------------------

    def attach_upstream(self, transport: asyncio.Transport, addr: tuple[str, int]) -> None:
        self.upstream = transport
        self.upstream_addr = addr
        self.state = "open"
        self.up_valve.attach(transport)
        if self._pending_up:
            data, self._pending_up = bytes(self._pending_up), bytearray()
            self._send_up(data)
            self._refund(len(data))
        self.guest_valve.open("pending")
        if self._guest_eof and transport.can_write_eof():
            transport.write_eof()

    def upstream_data(self, data: bytes) -> None:
        if self.inspect_down is not None:
            self.inspect_down(data)
        if self.held:
            self._held_data += data
            full = len(self._held_data) >= self.max_buffer
            if full:
                self.up_valve.close("hold")
            self._charge(len(data), self.up_valve)
            full = full or "budget" in self.up_valve.reasons  # the VM's buffers are full
            self._held_event("full" if full else "data")
            return
        self._deliver(data)

    def upstream_eof(self) -> None:
        self._up_eof = True
        if self.held:
            self._held_event("eof")  # delivered with the held data on release
            return
        self._eof_to_guest()
        self._maybe_done()

    def _eof_to_guest(self) -> None:
        if not self._eof_sent and self.guest.can_write_eof() and not self.guest.is_closing():
            self._eof_sent = True
            self.guest.write_eof()

    def upstream_pause_writing(self) -> None:
        self.guest_valve.close("up-full")

    def upstream_resume_writing(self) -> None:
        self.guest_valve.open("up-full")

    # -- moving bytes -------------------------------------------------------------------------

    def _send_up(self, data: bytes) -> None:
        assert self.upstream is not None
        if self.inspect_up is not None:
            checked = self.inspect_up(data)
            if not checked or self.state == "closed":
                return
            data = checked
        self.upstream.write(data)
        self.bytes_up += len(data)
        self.last_up = time.monotonic()
        if self._on_bytes:
            self._on_bytes(len(data), 0)
        self._throttle(self._up_bucket, len(data), self.guest_valve)
        self._check_waiting()

    def _deliver(self, data: bytes) -> None:
        if self.guest.is_closing():
            return
        self.guest.write(data)
        self.bytes_down += len(data)
        self.last_down = time.monotonic()
        if self._on_bytes:
            self._on_bytes(0, len(data))
        self._throttle(self._down_bucket, len(data), self.up_valve)
        self._check_waiting()

    def _throttle(self, bucket: TokenBucket | None, n: int, valve: Valve) -> None:
        if bucket is None:
            return
        wait = bucket.take(n)
        if wait > 0 and "rate" not in valve.reasons:
            valve.close("rate")
            loop = asyncio.get_running_loop()
            self._timers.append(loop.call_later(wait, valve.open, "rate"))
            self._timers = [t for t in self._timers if not t.cancelled()][-4:]

    # -- closing ----------------------------------------------------------------------------

    def _maybe_done(self) -> None:
        if self._guest_eof and self._up_eof and not self._held_data:
            self.close()

    def close(self) -> None:
        """Orderly close of both sides (buffered data is flushed)."""
        if self.state == "closed":
            return
        self._finish()
        if not self.guest.is_closing():
            self.guest.close()
        if self.upstream is not None and not self.upstream.is_closing():
            self.upstream.close()

    def reset(self) -> None:
        """Abort both sides with a TCP reset."""
        if self.state == "closed":
            return
        self._finish()
        reset(self.guest)
        reset(self.upstream)

    def _finish(self) -> None:
        held = self.held
        self.state = "closed"
        self._more.set()
        self._refund(self._charged)
        if self._budget is not None:
            self._budget.forget(self._budget_room)
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        self._check_waiting()
        if held:
            self._held_event("closed")
        if self._on_close:
            cb, self._on_close = self._on_close, None
            cb(self)

    def guest_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.reset()
        elif self.upstream is None:
            self.reset()
        else:
            self._guest_eof = True
            self.close()

    def upstream_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.reset()
        else:
            self._up_eof = True
            if self.held:
                self._held_event("eof")
                if self._held_data:
                    return  # the guest gets what was buffered when released
            self.close()


class GuestSide(asyncio.Protocol):
    """The accepted socket from the guest (in the VM's namespace)."""

    def __init__(self, on_made: Callable[[GuestSide, asyncio.Transport], None]) -> None:
        self._on_made = on_made
        self.conn: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._on_made(self, transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.guest_data(data)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.guest_eof()
        return True  # keep the write side open for the response

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.guest_pause_writing()

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.guest_resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.guest_lost(exc)


class UpstreamSide(asyncio.Protocol):
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.upstream_data(data)

    def eof_received(self) -> bool:
        self.conn.upstream_eof()
        return True

    def pause_writing(self) -> None:
        self.conn.upstream_pause_writing()

    def resume_writing(self) -> None:
        self.conn.upstream_resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.upstream_lost(exc)

"""The byte stream to the host: line-framed protocol messages over the virtio port."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator

from pal.guest import protocol as P

_POLL_BAD = select.POLLHUP | select.POLLERR | select.POLLNVAL


class Channel:
    """The byte stream to the host: the virtio port (guest) or a socket (tests).

    A virtio-serial port reads EOF and polls POLLHUP while no host is connected; with
    ``reconnect`` the channel then backs off and waits for the next host instead of ending.
    Writes while disconnected are dropped: request ids belong to one connection, so stale
    output would only confuse the next host.
    """

    def __init__(self, fd: int, *, reconnect: bool) -> None:
        self.fd = fd
        self.reconnect = reconnect
        os.set_blocking(fd, False)
        self.connected = threading.Event()
        self._wlock = threading.Lock()
        self.on_connect: Callable[[], None] | None = None
        self.read_ns = 0  # monotonic time of the latest read (the identify's decode time)

    def send(self, msg: P.Message, data: bytes | None = None) -> bool:
        return self._write(P.encode(msg, data))

    def send_line(self, line: bytes) -> bool:
        """One encoded line (protocol.encode), written whole."""
        return self._write(line)

    def _write(self, line: bytes) -> bool:
        view = memoryview(line)
        with self._wlock:
            while view:
                if not self.connected.is_set():
                    return False
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    poller = select.poll()
                    poller.register(self.fd, select.POLLOUT)
                    for _, ev in poller.poll(200):
                        if ev & select.POLLHUP and not ev & select.POLLOUT:
                            return False  # host went away mid-line; reconnect sends "\n"
                    continue
                except OSError:
                    return False
                view = view[n:]
        return True

    def _peer_present(self) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        events = poller.poll(0)
        return not any(ev & _POLL_BAD for _, ev in events)

    def lines(self) -> Iterator[bytes]:
        """Request lines as they arrive; ends at EOF unless reconnecting."""
        buf = bytearray()
        skipping = False  # inside an over-long line: drop until its newline
        backoff = 0.002
        lost_at = time.monotonic()
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            if not self.connected.is_set():
                if not self._peer_present():
                    time.sleep(backoff)
                    # The port cannot signal the host's return (poll reports POLLHUP until
                    # then), so we poll. Right after a restore or fork the host reconnects
                    # within milliseconds and every ms counts; a long absence backs off.
                    recent = time.monotonic() - lost_at < 3.0
                    backoff = min(backoff * 2, 0.005 if recent else 0.1)
                    continue
                backoff = 0.002
                buf.clear()
                skipping = False
                self.connected.set()
                self._write(b"\n")  # terminate whatever half line the host may have seen
                if self.on_connect:
                    self.on_connect()
            # No timeout: a sleeping harness must hold no timer of its own (see probe), and
            # a host that goes away wakes us with POLLHUP.
            events = poller.poll()
            if not events:
                continue
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                if any(ev & _POLL_BAD for _, ev in events):
                    data = b""
                else:
                    continue
            except OSError:
                data = b""
            if not data:
                self.connected.clear()
                lost_at = time.monotonic()
                if not self.reconnect:
                    return
                continue
            buf += data
            self.read_ns = time.monotonic_ns()
            while (i := buf.find(b"\n")) >= 0:
                line = bytes(buf[:i])
                del buf[: i + 1]
                if skipping:
                    skipping = False
                    continue
                yield line
            if len(buf) > P.MAX_LINE_BYTES:
                buf.clear()
                skipping = True


class Credit:
    """One stream's flow control (protocol.py, "Flow control"): the bytes it may still
    send; a sender waits while there are none, until the host grants more or the stream
    (or the connection) ends."""

    def __init__(self, window: int) -> None:
        self.left = window
        self.closed = False
        self.cond = threading.Condition()

    def take(self, n: int) -> bool:
        """Wait for credit, then spend ``n``; False when the stream ended meanwhile."""
        with self.cond:
            while self.left <= 0 and not self.closed:
                self.cond.wait()
            if self.closed:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        with self.cond:
            self.left += n
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Credits:
    """The credits of a connection's streams, by request id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rid: dict[int, Credit] = {}

    def open(self, rid: int, window: object) -> None:
        """A stream request with ``window`` (an int above 0) is flow-controlled; without
        one (an older host) it is not."""
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            with self._lock:
                self._by_rid[rid] = Credit(window)

    def get(self, rid: int) -> Credit | None:
        with self._lock:
            return self._by_rid.get(rid)

    def give(self, rid: object, n: object) -> None:
        if isinstance(rid, int) and isinstance(n, int) and not isinstance(n, bool) and n > 0:
            credit = self.get(rid)
            if credit is not None:
                credit.give(n)

    def close(self, rid: object) -> None:
        """The stream ended (or was detached or cancelled): a sender waiting gives up."""
        if isinstance(rid, int):
            with self._lock:
                credit = self._by_rid.pop(rid, None)
            if credit is not None:
                credit.close()

    def close_all(self) -> None:
        with self._lock:
            credits, self._by_rid = list(self._by_rid.values()), {}
        for credit in credits:
            credit.close()

"""Host end of the virtio-serial channel to one VM's guest harness.

Multiplexes requests over the line-JSON protocol of ``pal/guest/protocol.py``: each request
gets an id and an inbox; a single reader task routes replies and stream chunks to their
inbox and keeps the latest heartbeat. The channel is per QEMU process: a restored VM gets a
new channel to its new process's socket.

The guest is hostile, so (docs/security.md, "The guest channel"):
- every message is checked (guest_input.py) before it is routed; anything else is dropped,
  and a guest that keeps sending such lines loses its channel. Nothing a guest sends can
  raise out of the reader: the worst outcome is that *this* channel ends;
- lines are at most ``MAX_GUEST_LINE_BYTES``; a longer one is discarded as it streams in;
- the reader never waits for a consumer: each stream has flow control (protocol.py,
  "Flow control"): the guest may send ``STREAM_WINDOW`` bytes ahead of the stream's reader,
  and the host grants more as the reader takes them. So a slow reader holds back only its
  own stream in the guest (its process slows, its output stays in the journal), while
  heartbeats and every other request's answers get through. An inbox holds at most its
  window and one line; a guest that sends past its credit (or a harness too old for
  credits) has that stream detached and the excess dropped;
- a reader that takes nothing from a stream whose credit is used up for ``slow_reader_s``
  is detached from it (``detach {reason: slow-reader}``; a cell is interrupted): the
  stream ends for its reader after what it held, with ``ok {detached, reason:
  "slow-reader"}``, and the process runs on, its output in the journal for a reattach;
- a stalled stream is not the guest talking: only heartbeats (and identify) count as
  hearing from it (``last_heard``);
- the reader yields to the event loop after every line, so one busy guest cannot starve
  the other VMs' channels or the API;
- a write the guest does not take within ``SEND_TIMEOUT_S`` ends the channel (a half
  written line cannot be resumed);
- when the channel ends (the VM stopped, QEMU died, the guest misbehaved) every request
  waiting on it ends at once, including an exec without a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

from pal.errors import BackendError, GuestTimeout
from pal.guest import protocol as p
from pal.manager import guest_input as gi

log = logging.getLogger(__name__)

_CLOSED = object()  # inbox sentinel: the channel (or the request) went away

STREAM_WINDOW = p.STREAM_WINDOW  # wire bytes a stream's guest may send ahead of its reader
CREDIT_STEP = STREAM_WINDOW // 4  # credit goes back to the guest in steps of at least this
SLOW_READER_S = 30.0  # a reader that takes nothing for this long, with the credit used up
SLOW_READER = "slow-reader"
SEND_TIMEOUT_S = 30.0  # a guest that takes no input for this long has lost its channel
REPLY_TIMEOUT_S = 30.0  # a request's default wait for its answer
# A guest sending more undecodable or malformed lines than this within the window is not
# a harness resynchronising after a restore (a line or two): its channel is closed.
MAX_VIOLATIONS = 64
VIOLATION_WINDOW_S = 10.0


class ChannelClosed(BackendError):
    # 503, not 500: the guest went away (or was cut off for misbehaving); nothing of ours
    # broke, and another request may find it back after a restart or resume.
    status, code = 503, "GUEST_DISCONNECTED"


class GuestError(BackendError):
    """An ``err`` reply from the harness; ``guest_code`` is one of protocol.ERR_* (any other
    code arrives as ERR_IO) and the message is cleaned (guest_input.text)."""

    def __init__(self, guest_code: str, message: str) -> None:
        super().__init__(message, code=guest_code)
        self.guest_code = guest_code


class _Inbox:
    """The replies of one request. ``offer`` never waits: it takes a stream's reply while the
    inbox holds less than ``window`` bytes plus a line or two (one message is always taken),
    a single request's first reply only, and refuses the rest. ``get`` waits for one; after
    ``close`` it returns what is left, then ``_CLOSED``. For a stream it also keeps the
    credit books: ``owed`` is what the reader took and the guest was not told yet."""

    def __init__(self, window: int = STREAM_WINDOW, on_slow: str | None = None) -> None:
        self.window = window
        self.on_slow = on_slow  # a stream: what a slow reader sends the guest (detach, cancel)
        self._items: collections.deque[tuple[Any, int, bool]] = collections.deque()
        self._bytes = 0
        self._closed = False
        self._readable = asyncio.Event()
        self.received = 0  # bytes of flow-controlled replies received
        self.granted = window  # credit given to the guest so far
        self.owed = 0
        self.last_get = time.monotonic()
        self.watch: asyncio.TimerHandle | None = None  # the slow-reader check, when armed
        self.slow = False  # detached for a slow reader (or for a guest past its credit)

    def offer(self, item: Any, size: int, flow: bool) -> bool:
        """``flow``: a reply the guest's credit covers (protocol.FLOW_KINDS of a stream)."""
        if self._closed:
            return True  # nobody will read it
        if self.on_slow is None and self._items:
            return False  # a single request's answer came: more is noise
        if flow:
            self.received += size
        # Output may overshoot its credit by one line; a stream's few other replies (its
        # start and end) by one more.
        limit = self.window + gi.MAX_GUEST_LINE_BYTES * (1 if flow else 2)
        if self._items and self._bytes + size > limit:
            return False
        self._put(item, size, flow)
        return True

    def _put(self, item: Any, size: int, flow: bool) -> None:
        self._items.append((item, size, flow))
        self._bytes += size
        self._readable.set()

    def end_with(self, item: Any) -> None:
        """Queue ``item`` as the last reply (whatever the bound) and take no more."""
        if not self._closed:
            self._put(item, 0, False)
            self._closed = True

    def exhausted(self) -> bool:
        """The guest has used its credit: it waits for the reader."""
        return self.received >= self.granted

    async def get(self) -> Any:
        while not self._items:
            if self._closed:
                return _CLOSED
            self._readable.clear()
            await self._readable.wait()
        item, size, flow = self._items.popleft()
        self._bytes -= size
        if flow:
            self.owed += size
        self.last_get = time.monotonic()
        return item

    def close(self) -> None:
        self._closed = True
        self._readable.set()
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None


def _decode(line: bytes) -> Any:
    """The JSON value of a line, or None for noise. Deep nesting (RecursionError) and bad
    UTF-8 are noise too."""
    line = line.strip()
    if not line:
        return None
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


class HarnessChannel:
    def __init__(self, socket_path: Path, vm_id: str, slow_reader_s: float = SLOW_READER_S) -> None:
        self.socket_path = socket_path
        self.vm_id = vm_id
        self.slow_reader_s = slow_reader_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Inbox] = {}
        self._write_lock = asyncio.Lock()
        # The latest heartbeat, cleaned (guest_input.heartbeat): only known fields, typed.
        self.heartbeat: dict[str, Any] | None = None
        self.heartbeat_at = 0.0  # host monotonic time of the latest heartbeat
        self.first_line_at = 0.0  # host monotonic time the guest first said anything (restore timing)
        self.slow_readers = 0  # streams detached for a slow reader (or a guest past its credit)
        self.violations = 0  # malformed lines dropped, over the channel's life
        self._recent: collections.deque[float] = collections.deque()
        self._hb_cond = asyncio.Condition()
        self.closed = asyncio.Event()

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to QEMU's chardev socket (it exists as soon as QEMU is up)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=gi.MAX_GUEST_LINE_BYTES
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise BackendError(f"VM {self.vm_id}: agent socket did not appear") from None
                await asyncio.sleep(0.005)
        # Terminate any half line the guest may hold from a previous connection.
        self._writer.write(b"\n")
        self._task = asyncio.create_task(self._read_loop(), name=f"channel-{self.vm_id}")

    def heard(self) -> None:
        """The guest answered as itself (an identify reply): as good as a heartbeat."""
        self.heartbeat_at = time.monotonic()

    def last_heard(self) -> float:
        """Host monotonic time the guest was last heard from: its latest heartbeat (or an
        identify answer). 0.0: never. Output waiting for a slow reader is not hearing from
        it: the reader never stalls on it, so heartbeats arrive on time or not at all."""
        return self.heartbeat_at

    def _violation(self, what: str) -> bool:
        """Count a malformed line; True when the guest has sent too many (close)."""
        self.violations += 1
        now = time.monotonic()
        self._recent.append(now)
        while self._recent and now - self._recent[0] > VIOLATION_WINDOW_S:
            self._recent.popleft()
        if self.violations <= 3 or self.violations % 1000 == 0:
            log.info("channel %s: dropped %s (%d so far)", self.vm_id, what, self.violations)
        return len(self._recent) > MAX_VIOLATIONS

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    # Over-long: asyncio discarded what it held; the rest of that line
                    # arrives as noise and is dropped below.
                    if self._violation("an over-long line"):
                        break
                    continue
                if not line:
                    break
                if not self.first_line_at:
                    self.first_line_at = time.monotonic()
                msg = _decode(line)
                key = gi.route(msg)
                if key is None:
                    # A blank line is a peer's resync after a reconnect, not a violation.
                    if line.strip() and self._violation("a malformed line"):
                        break
                    await asyncio.sleep(0)
                    continue
                rid, kind = key
                if kind == p.K_HEARTBEAT:
                    self.heartbeat = gi.heartbeat(msg, int(time.time() * 1000))
                    self.heartbeat_at = time.monotonic()
                    async with self._hb_cond:
                        self._hb_cond.notify_all()
                else:
                    inbox = self._pending.get(rid)
                    if inbox is not None:  # else: a late reply to a request that ended
                        self._deliver(rid, inbox, msg, len(line))
                # Fairness: a guest that keeps its socket full must not hold the loop.
                await asyncio.sleep(0)
            if len(self._recent) > MAX_VIOLATIONS:
                log.warning(
                    "channel %s: closed after %d malformed lines from the guest", self.vm_id, self.violations
                )
        except (ConnectionError, OSError) as exc:
            log.debug("channel %s: %s", self.vm_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever a guest sends ends at most its own channel
            log.warning("channel %s: ended on unexpected input: %s", self.vm_id, gi.text(repr(exc)))
        finally:
            self.closed.set()
            for inbox in self._pending.values():
                inbox.close()
            self._pending.clear()
            with contextlib.suppress(Exception):
                async with self._hb_cond:
                    self._hb_cond.notify_all()

    def _deliver(self, rid: int, inbox: _Inbox, msg: p.Message, size: int) -> None:
        """Into its inbox, never waiting (see the module's doc)."""
        flow = inbox.on_slow is not None and msg["k"] in p.FLOW_KINDS
        if not inbox.offer(msg, size, flow):
            if inbox.on_slow is not None:  # past its credit: an old or hostile harness
                self._detach_slow(rid, inbox, "sent past its credit")
            return  # a second answer to a single request: noise
        if flow and inbox.exhausted() and inbox.watch is None:
            self._watch(rid, inbox, self.slow_reader_s)

    def _watch(self, rid: int, inbox: _Inbox, delay: float) -> None:
        inbox.watch = asyncio.get_running_loop().call_later(delay, self._check_slow, rid, inbox)

    def _check_slow(self, rid: int, inbox: _Inbox) -> None:
        inbox.watch = None
        if self._pending.get(rid) is not inbox or inbox.slow or not inbox.exhausted():
            return
        idle = time.monotonic() - inbox.last_get
        if idle < self.slow_reader_s:
            self._watch(rid, inbox, self.slow_reader_s - idle)
            return
        self._detach_slow(rid, inbox, f"its reader took nothing for {idle:.0f}s")

    def _detach_slow(self, rid: int, inbox: _Inbox, why: str) -> None:
        """End the stream for its reader (after what it holds) and tell the guest: a
        process's stream is detached (its output stays in the journal), a cell interrupted."""
        if inbox.slow:
            return
        inbox.slow = True
        self.slow_readers += 1
        log.info("channel %s: stream %d detached (%s): %s", self.vm_id, rid, SLOW_READER, why)
        inbox.end_with({"k": p.K_OK, "id": rid, "result": {"detached": True, "reason": SLOW_READER}})
        assert inbox.on_slow is not None
        self._post_nowait({"k": inbox.on_slow, "target": rid, "reason": SLOW_READER})

    def _post_nowait(self, msg: p.Message) -> None:
        """A small control message (credit, detach) written without waiting: it is never
        held behind a consumer, and its bytes are few (one per CREDIT_STEP taken)."""
        if self._writer is None or self.closed.is_set():
            return
        with contextlib.suppress(Exception):
            self._writer.write(p.encode({**msg, "id": next(self._ids)}))

    def _grant(self, rid: int, inbox: _Inbox) -> None:
        """Return what the reader took to the guest, in steps of CREDIT_STEP."""
        if inbox.on_slow is not None and inbox.owed >= CREDIT_STEP and not inbox.slow:
            n, inbox.owed = inbox.owed, 0
            inbox.granted += n
            self._post_nowait({"k": p.K_CREDIT, "target": rid, "n": n})

    async def _send(self, msg: p.Message, data: bytes | None = None) -> None:
        if self._writer is None or self.closed.is_set():
            raise ChannelClosed(f"VM {self.vm_id}: guest channel is closed")
        async with self._write_lock:
            if self.closed.is_set():
                raise ChannelClosed(f"VM {self.vm_id}: guest channel is closed")
            self._writer.write(p.encode(msg, data))
            try:
                await asyncio.wait_for(self._writer.drain(), SEND_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "channel %s: the guest took no input for %gs; closing", self.vm_id, SEND_TIMEOUT_S
                )
                await self.close()
                raise ChannelClosed(f"VM {self.vm_id}: the guest stopped reading its channel") from None
            except (ConnectionError, OSError) as exc:
                raise ChannelClosed(f"VM {self.vm_id}: guest channel broke: {exc}") from exc

    def _open_inbox(self, on_slow: str | None = None) -> tuple[int, _Inbox]:
        if self.closed.is_set():
            raise ChannelClosed(f"VM {self.vm_id}: guest channel is closed")
        rid = next(self._ids)
        inbox = _Inbox(on_slow=on_slow)
        self._pending[rid] = inbox
        return rid, inbox

    def _close_inbox(self, rid: int) -> None:
        inbox = self._pending.pop(rid, None)
        if inbox is not None:
            inbox.close()  # releases a reader waiting to put into it

    async def post(self, msg: p.Message) -> None:
        """Send one request and wait for nothing: its answer is dropped on arrival. It is
        written before this returns, so the guest handles it before anything sent later."""
        await self._send({**msg, "id": next(self._ids)})

    async def request(
        self, msg: p.Message, data: bytes | None = None, timeout: float | None = REPLY_TIMEOUT_S
    ) -> tuple[p.Message, bytes]:
        """Send one request and wait for its single ``ok`` (or raise on ``err``).
        Returns the reply and its payload (ChannelClosed when the payload is not valid)."""
        rid, inbox = self._open_inbox()
        try:
            await self._send({**msg, "id": rid}, data)
            try:
                reply = await asyncio.wait_for(inbox.get(), timeout)
            except TimeoutError:
                raise GuestTimeout(
                    f"VM {self.vm_id}: guest did not answer {msg['k']} in {timeout:g}s"
                ) from None
            if reply is _CLOSED:
                raise ChannelClosed(f"VM {self.vm_id}: guest channel closed during {msg['k']}")
            if reply["k"] == p.K_ERR:
                raise GuestError(*gi.error(reply))
            if reply["k"] != p.K_OK:
                raise GuestError(p.ERR_IO, f"guest answered {msg['k']} with {reply['k']!r}")
            body = gi.payload(reply)
            if body is None:
                raise GuestError(p.ERR_IO, f"guest sent an invalid payload for {msg['k']}")
            return reply, body
        finally:
            self._close_inbox(rid)

    async def stream(self, msg: p.Message) -> AsyncIterator[p.Message]:
        """Send a streaming request (exec); yield every reply until ``exit``/``err``.

        If the consumer stops early (client went away), the guest process is cancelled.
        When the channel ends, the stream ends with ChannelClosed (after what had arrived).
        """
        replies = await self.start_stream(msg)
        try:
            async for reply in replies:
                yield reply
        finally:
            await replies.aclose()

    async def start_stream(
        self, msg: p.Message, abandon: str = p.K_CANCEL, on_slow: str = p.K_DETACH
    ) -> AsyncGenerator[p.Message, None]:
        """:meth:`stream` in two steps: send the request now, and return the iterator of
        its replies (which the caller must iterate or ``aclose``). The caller knows the
        request is in the guest's channel when this returns (live pause orders by it).
        ``abandon``: what an early close sends the guest (``cancel`` kills an exec's
        command, ``detach`` only ends the stream); ``on_slow``: what a slow reader's does
        (``detach``: the process runs on; ``cancel``: a cell is interrupted)."""
        rid, inbox = self._open_inbox(on_slow)
        try:
            await self._send({**msg, "id": rid, "window": inbox.window})
        except BaseException:
            self._close_inbox(rid)
            raise
        return self._replies(rid, inbox, abandon)

    async def _replies(self, rid: int, inbox: _Inbox, abandon: str) -> AsyncGenerator[p.Message, None]:
        finished = False
        try:
            while True:
                reply = await inbox.get()
                self._grant(rid, inbox)
                if reply is _CLOSED:
                    finished = True
                    raise ChannelClosed(f"VM {self.vm_id}: guest channel closed during exec")
                # ``ok`` ends a stream the guest detached (an attach's end without an exit).
                if reply["k"] in (p.K_EXIT, p.K_ERR, p.K_OK):
                    finished = True
                yield reply
                if finished:
                    return
        finally:
            self._close_inbox(rid)
            if not finished and not self.closed.is_set():
                with contextlib.suppress(Exception):
                    await self._send({"id": next(self._ids), "k": abandon, "target": rid})

    async def wait_heartbeat(self, incarnation: int, timeout: float) -> dict[str, Any]:
        """Wait until the harness heartbeats as ``incarnation`` (its identity is in place)."""
        deadline = time.monotonic() + timeout
        async with self._hb_cond:
            while True:
                hb = self.heartbeat
                # vm_id too: a template's or fork source's guest may heartbeat with the same
                # incarnation number before it has processed our identify.
                if hb is not None and hb["incarnation"] == incarnation and hb["vm_id"] == self.vm_id:
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
        self.closed.set()
        for inbox in list(self._pending.values()):
            inbox.close()
        if self._writer is not None:
            # abort, not close: a guest that stopped reading must not hold us on the
            # unsent bytes, and nothing left in the buffer is owed to it.
            self._writer.transport.abort()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

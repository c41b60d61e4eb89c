"""The host end of the guest channel against a hostile guest: a real unix socket whose other
end (the "guest") sends whatever a compromised VM could."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pal.errors import GuestTimeout
from pal.guest import protocol as p
from pal.manager import channel as ch
from pal.manager import guest_input as gi
from pal.manager.channel import ChannelClosed, GuestError, HarnessChannel
from tests.fakes import live_vm


class Guest:
    """The guest side of one channel: a listening socket the host connects to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None
        self.connected = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.reader, self.writer = r, w
            self.connected.set()

        self.server = await asyncio.start_unix_server(on_conn, path=str(self.path), limit=16 << 20)

    async def send(self, raw: bytes) -> None:
        assert self.writer is not None
        self.writer.write(raw)
        await self.writer.drain()

    async def send_msg(self, msg: dict[str, Any]) -> None:
        await self.send(json.dumps(msg).encode() + b"\n")

    async def next_request(self) -> dict[str, Any]:
        assert self.reader is not None
        while True:
            line = await self.reader.readline()
            if line.strip():
                return json.loads(line)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[HarnessChannel, Guest]]:
    guest = Guest(tmp_path / "agent.sock")
    await guest.start()
    chan = HarnessChannel(guest.path, "vm-1")
    await chan.connect()
    await guest.connected.wait()
    yield chan, guest
    await chan.close()
    await guest.close()


async def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_heartbeat_fields_are_validated_and_clamped(pair: tuple[HarnessChannel, Guest]) -> None:
    chan, guest = pair
    future = int(time.time() * 1000) + 10**9
    await guest.send_msg(
        {
            "id": 0,
            "k": "hb",
            "vm_id": "../../etc",
            "incarnation": "7",
            "active": "yes",
            "last_activity_ms": future,
            "mem_total": -1,
            "mem_used": 5,
            "disk_total": 100,
            "disk_used": 1000,
            "boot_id": "x\x1b[31m\nforged log line",
            "uptime_s": float("nan") if False else "1e400",
        }
    )
    await until(lambda: chan.heartbeat is not None)
    hb = chan.heartbeat
    assert hb is not None
    assert hb["vm_id"] == "" and hb["incarnation"] is None and hb["active"] is False
    assert hb["last_activity_ms"] <= int(time.time() * 1000), "a future claim counts as now at most"
    assert "mem_total" not in hb and "mem_used" not in hb
    assert hb["disk_total"] == 100 and "disk_used" not in hb, "used above total is dropped"
    assert "\n" not in hb["boot_id"] and "\x1b" not in hb["boot_id"]
    assert "uptime_s" not in hb

    await guest.send_msg({"id": 0, "k": "hb", "last_activity_ms": "soon"})
    await until(lambda: chan.heartbeat is not None and chan.heartbeat["last_activity_ms"] == 0)


async def test_undecodable_and_malformed_lines_are_dropped_and_requests_still_work(
    pair: tuple[HarnessChannel, Guest],
) -> None:
    chan, guest = pair
    task = asyncio.create_task(chan.request({"k": p.K_PING}, timeout=10))
    req = await guest.next_request()
    rid = req["id"]
    junk = [
        b"[" * 100_000 + b"\n",  # deep nesting: RecursionError in json
        b"\xff\xfe not utf-8\n",
        json.dumps({"id": [rid], "k": "ok"}).encode() + b"\n",  # non-hashable id
        json.dumps({"id": {"a": 1}, "k": "ok"}).encode() + b"\n",
        json.dumps({"id": True, "k": "ok"}).encode() + b"\n",
        json.dumps({"id": rid, "k": ["ok"]}).encode() + b"\n",
        json.dumps({"id": 10**30, "k": "ok"}).encode() + b"\n",
        json.dumps({"id": 0, "k": "ok"}).encode() + b"\n",  # a reply on the heartbeat id
        json.dumps([1, 2, 3]).encode() + b"\n",
        b"x" * (gi.MAX_GUEST_LINE_BYTES + 10) + b"\n",  # an over-long frame
    ]
    for line in junk:
        await guest.send(line)
    await guest.send_msg({"id": rid, "k": "ok", "result": {}})
    reply, _ = await asyncio.wait_for(task, 10)
    assert reply["k"] == "ok"
    assert not chan.closed.is_set() and chan.violations >= len(junk) - 1


async def test_a_garbage_flood_ends_only_this_channel(tmp_path: Path) -> None:
    bad, good = Guest(tmp_path / "bad.sock"), Guest(tmp_path / "good.sock")
    await bad.start()
    await good.start()
    c_bad, c_good = HarnessChannel(bad.path, "vm-bad"), HarnessChannel(good.path, "vm-good")
    await c_bad.connect()
    await c_good.connect()
    await bad.connected.wait()
    await good.connected.wait()
    try:
        await bad.send(b"{not json}\n" * (ch.MAX_VIOLATIONS + 5))
        await asyncio.wait_for(c_bad.closed.wait(), 10)
        with pytest.raises(ChannelClosed):
            await c_bad.request({"k": p.K_PING})
        task = asyncio.create_task(c_good.request({"k": p.K_PING}, timeout=10))
        req = await good.next_request()
        await good.send_msg({"id": req["id"], "k": "ok", "result": {}})
        assert (await task)[0]["k"] == "ok"
        assert not c_good.closed.is_set()
    finally:
        await c_bad.close()
        await c_good.close()
        await bad.close()
        await good.close()


async def test_guest_error_text_is_cleaned_and_codes_are_known(pair: tuple[HarnessChannel, Guest]) -> None:
    chan, guest = pair
    task = asyncio.create_task(chan.request({"k": p.K_LS, "path": ""}, timeout=10))
    req = await guest.next_request()
    await guest.send_msg({"id": req["id"], "k": "err", "code": "EVIL", "msg": "a\nb\x1b[2J" + "z" * 10_000})
    with pytest.raises(GuestError) as info:
        await task
    assert info.value.guest_code == p.ERR_IO
    assert "\n" not in info.value.message and "\x1b" not in info.value.message
    assert len(info.value.message) <= gi.MAX_GUEST_TEXT + 1


def _out_line(rid: int, size: int) -> bytes:
    data = base64.b64encode(b"y" * size).decode()
    return (json.dumps({"id": rid, "k": "out", "fd": 1, "data": data}) + "\n").encode()


class CreditGuest:
    """A guest that honours its credits (protocol.py, "Flow control") over a real socket:
    it writes ``lines`` output lines of ``chunk`` bytes to the first stream it is asked for,
    each only while its credit is above zero, answers pings, and records what the host
    sent it (credits, detaches)."""

    def __init__(self, path: Path, chunk: int, lines: int) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(1)
        self.chunk, self.lines = chunk, lines
        self.got: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.credit = 0
        self.rid = 0
        self.sent = 0
        self.ended = threading.Event()

    def serve(self) -> None:
        self.conn, _ = self.srv.accept()
        threading.Thread(target=self._write, daemon=True).start()
        buf = b""
        while True:
            try:
                data = self.conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self.cond:
                    self.ended.set()
                    self.cond.notify_all()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    self._handle(json.loads(line))

    def _handle(self, msg: dict[str, Any]) -> None:
        with self.cond:
            self.got.append(msg)
            if msg["k"] == p.K_EXEC:
                self.rid, self.credit = msg["id"], msg["window"]
            elif msg["k"] == p.K_CREDIT and msg["target"] == self.rid:
                self.credit += msg["n"]
            elif msg["k"] in (p.K_DETACH, p.K_CANCEL):
                self.ended.set()
            self.cond.notify_all()
        if msg["k"] == p.K_PING:
            self._send({"id": msg["id"], "k": "ok", "result": {}})

    def _send(self, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.conn.sendall(json.dumps(msg).encode() + b"\n")

    def _write(self) -> None:
        line_for = None
        while self.sent < self.lines:
            with self.cond:
                while (self.credit <= 0 or not self.rid) and not self.ended.is_set():
                    self.cond.wait()
                if self.ended.is_set():
                    break
                line_for = line_for or _out_line(self.rid, self.chunk)
                self.credit -= len(line_for)
            with contextlib.suppress(OSError):
                self.conn.sendall(line_for)
            self.sent += 1
            if self.sent % 8 == 0:  # the harness's heartbeats go out between output lines
                self._send({"id": 0, "k": "hb", "incarnation": 1, "vm_id": "vm-credit"})
        if not self.ended.is_set():
            self._send({"id": self.rid, "k": "exit", "code": 0, "timed_out": False})

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        with self.cond:
            return [m for m in self.got if m["k"] == kind]


async def _credit_pair(
    tmp_path: Path, chunk: int, lines: int, **kw: Any
) -> tuple[HarnessChannel, CreditGuest]:
    guest = CreditGuest(tmp_path / "agent.sock", chunk, lines)
    threading.Thread(target=guest.serve, daemon=True).start()
    chan = HarnessChannel(guest.srv.getsockname(), "vm-credit", **kw)
    await chan.connect()
    return chan, guest


async def test_credits_hold_a_stream_to_its_window_and_everything_arrives(tmp_path: Path) -> None:
    """16 MiB through a reader slower than the guest: the guest sends only what its credit
    allows, the host never holds more than the window (and a line), and every byte arrives
    in order, with no detach."""
    chunk, lines = 60_000, 280
    chan, guest = await _credit_pair(tmp_path, chunk, lines)
    stream = chan.stream({"k": p.K_EXEC, "argv": ["yes"]})
    got = 0
    try:
        while True:
            ev = await asyncio.wait_for(stream.__anext__(), 30)
            if ev["k"] == p.K_EXIT:
                break
            got += len(p.payload(ev))
            inbox = chan._pending[guest.rid]
            assert inbox._bytes <= ch.STREAM_WINDOW + gi.MAX_GUEST_LINE_BYTES
            assert inbox.received - inbox.granted <= gi.MAX_GUEST_LINE_BYTES, "the guest kept to its credit"
            if got % (chunk * 20) == 0:
                await asyncio.sleep(0.05)  # a slow reader
        assert got == chunk * lines and chan.slow_readers == 0
        assert guest.kinds(p.K_CREDIT) and not guest.kinds(p.K_DETACH)
    finally:
        await stream.aclose()
        await chan.close()


async def test_a_stalled_reader_is_detached_and_the_channel_answers_meanwhile(tmp_path: Path) -> None:
    """The reader of a stream stops taking its output (an SSE client that stopped reading):
    the guest stops at its credit, heartbeats and another request's answer still get
    through, the stall does not count as hearing from the guest, and after slow_reader_s
    the guest is told to detach the stream; the reader then gets what was held and
    ``detached {reason: slow-reader}``."""
    chan, guest = await _credit_pair(tmp_path, 60_000, 10_000, slow_reader_s=1.0)
    stream = chan.stream({"k": p.K_EXEC, "argv": ["yes"]})
    try:
        first = await asyncio.wait_for(stream.__anext__(), 30)  # then the reader stalls
        assert first["k"] == p.K_OUT
        await until(lambda: chan._pending[guest.rid].exhausted(), timeout=30)
        stalled_at = chan.last_heard()
        reply, _ = await chan.request({"k": p.K_PING}, timeout=10)
        assert reply["k"] == "ok", "another request answers while the stream is stalled"
        assert chan.last_heard() == stalled_at, "a stalled stream is not the guest talking"
        await until(lambda: guest.kinds(p.K_DETACH), timeout=30)
        (detach,) = guest.kinds(p.K_DETACH)
        assert detach["target"] == guest.rid and detach["reason"] == ch.SLOW_READER
        assert guest.sent * 60_000 < 3 * ch.STREAM_WINDOW, "the guest stopped at its credit"
        rest = [ev async for ev in stream]
        assert rest[-1]["k"] == p.K_OK and rest[-1]["result"] == {"detached": True, "reason": ch.SLOW_READER}
        assert {ev["k"] for ev in rest[:-1]} <= {p.K_OUT} and chan.slow_readers == 1
        assert not chan.closed.is_set()
    finally:
        await stream.aclose()
        await chan.close()


async def test_a_guest_flooding_past_its_credit_is_cut_off_that_stream_and_read_on(tmp_path: Path) -> None:
    """A guest that ignores its credit (a hostile one, or a harness from before credits)
    and writes 64 MiB as fast as it can while nobody consumes: the host keeps reading (the
    guest's writes all go through, its heartbeats arrive), holds at most the window, drops
    the rest, and detaches that stream."""
    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    chan = HarnessChannel(path, "vm-flood")
    await chan.connect()
    conn, _ = await asyncio.to_thread(srv.accept)
    chunk, lines = 60_000, 1100  # ~64 MiB on the wire
    beats = 0

    def read_request() -> dict[str, Any]:
        buf = b""
        while not buf.endswith(b"\n") or not buf.strip():
            buf += conn.recv(65536)
        return dict(json.loads(next(x for x in buf.split(b"\n") if x.strip())))

    def flood(rid: int) -> None:
        nonlocal beats
        line = _out_line(rid, chunk)
        hb = json.dumps({"id": 0, "k": "hb", "incarnation": 1}).encode() + b"\n"
        with contextlib.suppress(OSError):
            for i in range(lines):
                conn.sendall(line)
                if i % 100 == 99:
                    conn.sendall(hb)
                    beats += 1

    stream = chan.stream({"k": p.K_EXEC, "argv": ["yes"]})
    first = asyncio.create_task(stream.__anext__())
    req = await asyncio.to_thread(read_request)
    assert req["window"] == ch.STREAM_WINDOW
    flooder = threading.Thread(target=flood, args=(req["id"],), daemon=True)
    flooder.start()
    try:
        await asyncio.wait_for(first, 10)
        await asyncio.to_thread(flooder.join, 120)
        assert not flooder.is_alive(), "the host stopped reading the guest"
        await until(lambda: chan.heartbeat is not None and chan.heartbeat_at > 0)
        inbox = chan._pending[req["id"]]
        assert inbox._bytes <= ch.STREAM_WINDOW + 2 * gi.MAX_GUEST_LINE_BYTES and inbox.slow
        assert chan._reader is not None and len(chan._reader._buffer) <= 3 * gi.MAX_GUEST_LINE_BYTES
        detach = await asyncio.to_thread(read_request)
        assert detach["k"] == p.K_DETACH and detach["reason"] == ch.SLOW_READER
        rest = [ev async for ev in stream]
        assert rest[-1]["result"]["reason"] == ch.SLOW_READER and not chan.closed.is_set()
    finally:
        await stream.aclose()
        await chan.close()
        conn.close()
        srv.close()


async def test_an_exec_without_timeout_ends_when_the_channel_closes_even_when_its_inbox_is_full(
    pair: tuple[HarnessChannel, Guest],
) -> None:
    chan, guest = pair
    stream = chan.stream({"k": p.K_EXEC, "argv": ["sleep", "inf"]})
    first = asyncio.create_task(stream.__anext__())
    req = await guest.next_request()
    line = _out_line(req["id"], 60_000)
    writer = asyncio.create_task(guest.send(line * 14))  # the whole window, within its overshoot
    await asyncio.wait_for(first, 10)
    await until(lambda: chan._pending[req["id"]].exhausted())
    await chan.close()  # what stopping the VM does
    with pytest.raises(ChannelClosed):
        async for _ in stream:
            pass
    writer.cancel()


async def test_a_guest_that_reads_nothing_loses_its_channel(
    pair: tuple[HarnessChannel, Guest], monkeypatch: pytest.MonkeyPatch
) -> None:
    chan, _guest = pair  # the guest never reads
    monkeypatch.setattr(ch, "SEND_TIMEOUT_S", 0.5)
    big = b"z" * (p.MAX_FILE_BYTES - 1)
    with pytest.raises(ChannelClosed):
        for _ in range(64):  # fill the socket buffers, then one write cannot drain
            with contextlib.suppress(GuestTimeout):
                await chan.request({"k": p.K_WRITE, "path": "f"}, big, timeout=0.1)
    assert chan.closed.is_set()


def test_heartbeat_of_a_node_survives_a_hostile_guest(tmp_path: Path) -> None:
    """The node's heartbeat with one VM whose guest sent nonsense: every VM is reported."""
    from pal.config import Settings
    from pal.manager.heartbeat import NodeIdentity, NodeReports, ReportDeps
    from pal.manager.vm import VmRegistry
    from pal.vmm.host_cpu import LoadSampler

    registry = VmRegistry(tmp_path / "vms", lambda *_: None)
    reports = NodeReports(
        ReportDeps(
            NodeIdentity("n", "e", "tcg"),
            Settings(data_dir=tmp_path),
            store=None,  # type: ignore[arg-type]
            registry=registry,
            templates=None,
            template_host=None,  # type: ignore[arg-type]
            load=LoadSampler(2),
        )
    )
    for vm_id, hb in (
        ("vm-bad", gi.heartbeat({"last_activity_ms": "x", "incarnation": [1], "active": 1}, 10**13)),
        ("vm-good", gi.heartbeat({"last_activity_ms": 5, "incarnation": 1, "active": True}, 10**13)),
    ):
        chan = HarnessChannel(tmp_path / "x", vm_id)
        chan.heartbeat, chan.heartbeat_at = hb, time.monotonic()
        registry.vms[vm_id] = live_vm(tmp_path, vm_id, channel=chan)
    node = asyncio.run(reports.heartbeat())
    by_id = {v.vm_id: v for v in node.vms}
    assert set(by_id) == {"vm-bad", "vm-good"}
    assert by_id["vm-bad"].guest_last_activity_unix_ms == 0 and not by_id["vm-bad"].guest_active
    assert by_id["vm-bad"].incarnation == 1, "the host's incarnation, not the guest's claim"
    assert by_id["vm-good"].guest_active and by_id["vm-good"].guest_last_activity_unix_ms == 5

"""The gateway's waiting I/O for live pause, without VMs: a VM's connections on real loopback
sockets, its ``waiting`` and ``ready`` events by deliver rule, the bounded hold, and the
held upstream end delivered after the data."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pal.network import vm_gateway as gw_mod
from pal.network.gateway import Gateway
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide, UpstreamSide
from pal.network.vm_gateway import VmGateway


class _Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def push(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)


async def _vm_with_conn(
    wait: dict[str, Any] | None,
) -> tuple[VmGateway, _Sink, Connection, asyncio.StreamReader, asyncio.StreamWriter, Any, list[Any]]:
    """A VmGateway with one relayed connection: the 'guest' is a loopback client, the
    'upstream' a loopback server whose writer the test drives."""
    gw = Gateway()
    sink = _Sink()
    gw.sinks.add(sink)  # type: ignore[arg-type]
    vm = VmGateway(gw, "vm-1", Policy("open"), {}, NameTable())
    vm.set_wait(wait)
    loop = asyncio.get_running_loop()
    ups: list[asyncio.StreamWriter] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = _UPSTREAM_GOT[writer] = bytearray()
        ups.append(writer)
        while data := await reader.read(1 << 20):
            got += data

    up_server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    up_port = up_server.sockets[0].getsockname()[1]
    made: asyncio.Future[Connection] = loop.create_future()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        conn = Connection(
            gw.next_id(),
            transport,
            ("127.0.0.1", up_port),
            max_buffer=vm.max_buffer,
            on_waiting=vm._waiting_changed,
            on_held=vm._held_event,
            on_close=vm._closed,
        )
        side.conn = conn
        vm.conns[conn.id] = conn
        made.set_result(conn)

    guest_server = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", guest_server.sockets[0].getsockname()[1])
    conn = await made
    transport, _ = await loop.create_connection(lambda: UpstreamSide(conn), "127.0.0.1", up_port)
    conn.attach_upstream(transport, ("127.0.0.1", up_port))  # type: ignore[arg-type]
    while not ups:
        await asyncio.sleep(0.001)
    return vm, sink, conn, reader, writer, ups[0], [up_server, guest_server]


# What each test upstream (by its writer) has read: a socket closed with bytes it has not
# read yet sends a reset, not an end, so an upstream that ends reads the request first.
_UPSTREAM_GOT: dict[asyncio.StreamWriter, bytearray] = {}


async def _end_upstream(up: asyncio.StreamWriter, after_reading: bytes) -> None:
    await _until(lambda: _UPSTREAM_GOT[up] == after_reading)
    up.close()


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


def _close(servers: list[Any]) -> None:
    for s in servers:
        s.close()


async def test_a_watched_vm_says_once_when_a_connection_starts_waiting() -> None:
    vm, sink, conn, _reader, writer, up, servers = await _vm_with_conn({"deliver": "first-byte"})
    assert vm.hold(if_waiting=True) == {"held": False, "waiting": 0}  # nothing waits yet
    assert not vm.held
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await writer.drain()
    await _until(lambda: conn.waiting)
    writer.write(b"more of the request")
    await writer.drain()
    await _until(lambda: conn.bytes_up > 20)
    assert sink.events == [{"ev": "waiting", "vmId": "vm-1"}]  # one edge, not one per send
    assert vm.wait_state() == {"held": False, "ready": None, "waiting": 1, "buffered": 0}
    up.write(b"HTTP/1.1 200 OK\r\n")
    await _until(lambda: not conn.waiting)
    assert vm.wait_state()["waiting"] == 0
    conn.close()
    _close(servers)


async def test_an_unwatched_vm_says_nothing() -> None:
    vm, sink, conn, _reader, writer, _up, servers = await _vm_with_conn(None)
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    assert sink.events == [] and vm.max_buffer == 16 * 1024 * 1024
    conn.close()
    _close(servers)


async def test_first_byte_while_held_makes_it_ready_and_release_delivers_data_then_the_end() -> None:
    vm, sink, conn, reader, writer, up, servers = await _vm_with_conn({"deliver": "first-byte"})
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    assert vm.hold(if_waiting=True) == {"held": True, "waiting": 1}
    up.write(b"a" * 5000)
    await up.drain()
    await _until(lambda: vm.ready is not None)
    assert sink.events[-1] == {"ev": "ready", "vmId": "vm-1", "reason": "first-byte", "buffered": 5000}
    up.write(b"b" * 5000)
    # The upstream ends while held: the guest sees its end only after the data.
    await _end_upstream(up, after_reading=b"request")
    await _until(lambda: conn.buffered == 10_000 and conn._up_eof)
    assert conn.bytes_down == 0 and len([e for e in sink.events if e["ev"] == "ready"]) == 1
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), timeout=0.05)
    assert vm.release() == {"buffered": 10_000}
    got = await asyncio.wait_for(reader.read(), timeout=10)  # to EOF
    assert got == b"a" * 5000 + b"b" * 5000
    _close(servers)


async def test_complete_waits_for_the_end_the_cap_or_a_quiet_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gw_mod, "COMPLETE_QUIET_S", 0.3)
    # a quiet moment after the last byte
    vm, sink, conn, reader, writer, up, servers = await _vm_with_conn({"deliver": "complete"})
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    vm.hold(if_waiting=True)
    up.write(b"part1")
    await up.drain()
    await _until(lambda: conn.buffered == 5)
    assert vm.ready is None  # more may come
    up.write(b"part2")
    await _until(lambda: vm.ready == "complete", timeout=10)
    assert sink.events[-1]["buffered"] == 10
    vm.release()
    assert await asyncio.wait_for(reader.readexactly(10), 10) == b"part1part2"
    conn.close()
    _close(servers)
    # the upstream's end
    vm, sink, conn, reader, writer, up, servers = await _vm_with_conn({"deliver": "complete"})
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    vm.hold(if_waiting=True)
    up.write(b"all")
    await _end_upstream(up, after_reading=b"request")
    await _until(lambda: vm.ready == "complete")
    vm.release()
    assert await asyncio.wait_for(reader.read(), 10) == b"all"
    _close(servers)
    # the cap: reading stops there (backpressure) and the guest is woken
    vm, sink, conn, reader, writer, up, servers = await _vm_with_conn(
        {"deliver": "complete", "maxBufferBytes": 64 * 1024}
    )
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    vm.hold(if_waiting=True)
    up.write(b"z" * (4 * 1024 * 1024))
    await _until(lambda: vm.ready == "cap")
    assert "hold" in conn.up_valve.reasons and conn.buffered < 2 * 1024 * 1024
    vm.release()
    assert len(await asyncio.wait_for(reader.readexactly(4 * 1024 * 1024), 30)) == 4 * 1024 * 1024
    conn.close()
    _close(servers)


async def test_holding_again_keeps_what_is_ready() -> None:
    vm, _sink, conn, _reader, writer, up, servers = await _vm_with_conn({"deliver": "first-byte"})
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    vm.hold(if_waiting=False)
    up.write(b"x")
    await _until(lambda: vm.ready is not None)
    vm.hold(if_waiting=False)  # a restarted node holds again: the wake must not be lost
    assert vm.wait_state()["ready"] == "first-byte" and vm.wait_state()["held"]
    conn.close()
    _close(servers)

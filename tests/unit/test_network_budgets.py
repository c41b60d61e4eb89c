"""The egress gateway's budgets, without VMs: real loopback sockets stand in for guests
and upstreams, a real DNS server on loopback (tests/dnsserver.py) for the host's name
servers. Each test shows what one VM (or many) cannot take from another, and fails
without the budget it is about."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import dns.message
import dns.rcode
import pytest

from pal.network import budgets, lookups, sniff, vm_gateway
from pal.network.gateway import Gateway
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide
from pal.network.vm_gateway import NODE_CONNECTIONS_RULE, VmGateway
from pal.spec import EgressAllow
from tests.dnsserver import LoopbackDns, loopback_dns

HANG_GUARD_S = 60  # a hang guard, not a speed bound
READ_CHUNK = 256 * 1024  # asyncio reads at most this much at once: one read past a budget


async def _until(cond: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


class _Tr:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append(data)


def _query(vm: VmGateway, name: str) -> _Tr:
    """The guest asks ``name`` (A); the answer lands in the returned transport."""
    tr = _Tr()
    vm.dns_query(tr, dns.message.make_query(name, "A").to_wire(), ("10.0.2.15", 5353))  # type: ignore[arg-type]
    return tr


def _vm(gw: Gateway, vm_id: str, egress: Any = "open", limits: dict[str, Any] | None = None) -> VmGateway:
    vm = VmGateway(gw, vm_id, Policy(egress), limits or {}, NameTable())
    gw.vms[vm_id] = vm
    return vm


@pytest.fixture
def slow_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of a silent name stays in flight for the whole test (no retry either)."""
    monkeypatch.setattr(lookups, "LOOKUP_TRY_S", 120.0)
    monkeypatch.setattr(lookups, "LOOKUP_LIFETIME_S", 120.0)


@pytest.fixture
def dns_server() -> Any:
    with loopback_dns({"fast.test": "151.101.0.1"}, silent=("silent.test",)) as server:
        yield server


def _gateway(server: LoopbackDns, **budgets_msg: Any) -> Gateway:
    gw = Gateway()
    gw.configure(None, [], budgets={"nameservers": server.nameserver, **budgets_msg})
    return gw


# -- DNS ---------------------------------------------------------------------------------------


async def test_a_vm_asking_a_silent_domain_does_not_stall_another_vms_lookups(
    slow_lookups: None, dns_server: LoopbackDns
) -> None:
    gw = _gateway(dns_server)
    flooder, victim = _vm(gw, "flooder"), _vm(gw, "victim")
    asked = [_query(flooder, f"r{i}.silent.test") for i in range(budgets.NODE_LOOKUPS + 16)]
    await _until(lambda: flooder.lookup_slots.in_use == budgets.VM_LOOKUPS)
    answer = _query(victim, "fast.test")
    await _until(lambda: bool(answer.sent))
    assert dns.message.from_wire(answer.sent[0]).rcode() == dns.rcode.NOERROR
    assert not any(t.sent for t in asked), "the flooder's lookups are all still in flight"
    # The flooder holds its own slots only: at most VM_LOOKUPS of the node's.
    assert flooder.lookup_slots.peak == budgets.VM_LOOKUPS
    assert gw.resolver.node.peak <= budgets.VM_LOOKUPS + 1
    silent_names = {q for q in dns_server.queries if q.endswith("silent.test")}
    assert len(silent_names) <= budgets.VM_LOOKUPS


async def test_the_node_caps_lookups_in_flight_of_all_vms(
    slow_lookups: None, dns_server: LoopbackDns
) -> None:
    gw = _gateway(dns_server)
    vms = [_vm(gw, f"vm-{i}") for i in range(budgets.NODE_LOOKUPS // budgets.VM_LOOKUPS + 4)]
    for vm in vms:
        for i in range(budgets.VM_LOOKUPS):
            _query(vm, f"{vm.vm_id}-{i}.silent.test")
    await _until(lambda: all(vm.lookup_slots.in_use == budgets.VM_LOOKUPS for vm in vms))
    waiting = len(vms) * budgets.VM_LOOKUPS - budgets.NODE_LOOKUPS
    await _until(lambda: gw.resolver.node.waiting == waiting)
    await _until(lambda: len(set(dns_server.queries)) == budgets.NODE_LOOKUPS)
    assert gw.resolver.node.in_use == gw.resolver.node.peak == budgets.NODE_LOOKUPS


async def test_a_silent_name_server_is_servfail_after_the_lookups_own_timeout(
    monkeypatch: pytest.MonkeyPatch, dns_server: LoopbackDns
) -> None:
    monkeypatch.setattr(lookups, "LOOKUP_TRY_S", 0.2)
    monkeypatch.setattr(lookups, "LOOKUP_LIFETIME_S", 0.4)
    gw = _gateway(dns_server)
    vm = _vm(gw, "vm-1")
    silent, missing = _query(vm, "x.silent.test"), _query(vm, "missing.test")
    await _until(lambda: bool(silent.sent and missing.sent))
    assert dns.message.from_wire(silent.sent[0]).rcode() == dns.rcode.SERVFAIL
    assert dns.message.from_wire(missing.sent[0]).rcode() == dns.rcode.NXDOMAIN
    assert vm.lookup_slots.in_use == 0 and gw.resolver.node.in_use == 0


# -- connections: buffered bytes and descriptors ------------------------------------------------


@dataclass
class Feeds:
    """Upstreams on 127.0.0.2 that each send ``size`` bytes to whoever connects."""

    server: asyncio.Server
    port: int
    size: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


async def _feeds(size: int) -> Feeds:
    feeds: Feeds

    async def send(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        feeds.writers.append(w)
        block = bytes(range(256)) * (size // 256)
        w.write(block)
        with contextlib.suppress(ConnectionError):
            await w.drain()
        w.close()

    server = await asyncio.start_server(send, "127.0.0.2", 0)
    feeds = Feeds(server, server.sockets[0].getsockname()[1], size)
    return feeds


@dataclass
class Guest:
    conn: Connection
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


@dataclass
class Net:
    gw: Gateway
    guests: asyncio.Server
    made: asyncio.Queue[Connection | None]
    next: tuple[VmGateway, str, int] | None = None

    async def connect(self, vm: VmGateway, ip: str, port: int) -> Guest | None:
        """A guest connection of ``vm`` to ``ip:port``, admitted (or not) as an accepted
        one is; None when it was refused."""
        self.next = (vm, ip, port)
        r, w = await asyncio.open_connection("127.0.0.1", self.guests.sockets[0].getsockname()[1])
        conn = await asyncio.wait_for(self.made.get(), HANG_GUARD_S)
        return None if conn is None else Guest(conn, r, w)


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    gw = Gateway()
    gw.configure(None, ["127.0.0.2"], host_dns=False)
    made: asyncio.Queue[Connection | None] = asyncio.Queue()
    holder: dict[str, Net] = {}

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        target = holder["net"].next
        assert target is not None
        vm, ip, port = target
        vm.admit(side, transport, ip, port)
        made.put_nowait(side.conn if side.conn is not None and side.conn.id in vm.conns else None)

    guests = await asyncio.get_running_loop().create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    n = Net(gw, guests, made)
    holder["net"] = n
    try:
        yield n
    finally:
        for vm in gw.vms.values():
            vm.close()
        guests.close()


def _buffered(vm: VmGateway) -> int:
    return sum(c.buffered for c in vm.conns.values())


def _all_stopped(vm: VmGateway) -> bool:
    """Every held connection stopped reading its upstream (or has all of its bytes)."""
    return all(c.up_valve.reasons or c.buffered >= 1 << 21 for c in vm.conns.values())


async def _read_all(g: Guest, n: int) -> bytes:
    return await asyncio.wait_for(g.reader.readexactly(n), HANG_GUARD_S)


async def test_a_held_vms_connections_share_its_buffer_budget(net: Net) -> None:
    feeds = await _feeds(2 << 20)
    vm = _vm(net.gw, "vm-1")
    vm.set_wait({"deliver": "complete", "maxBufferBytes": 1 << 20})
    vm.hold(False)
    guests = [await net.connect(vm, "127.0.0.2", feeds.port) for _ in range(8)]
    assert all(guests)
    await _until(lambda: len(feeds.writers) == 8 and _buffered(vm) > 0)
    await _until(lambda: _all_stopped(vm))
    # Not 8 x 1 MiB (each connection's own cap): the VM's 1 MiB, plus one read each.
    assert _buffered(vm) <= (1 << 20) + 8 * READ_CHUNK, _buffered(vm)
    assert vm.buffer.used == _buffered(vm)
    vm.release()
    got = [await _read_all(g, feeds.size) for g in guests if g]
    assert got == [bytes(range(256)) * (feeds.size // 256)] * 8, "every byte arrives, in order"
    assert vm.buffer.used == 0
    feeds.server.close()


async def test_the_node_caps_buffered_bytes_and_each_vm_keeps_its_floor(net: Net) -> None:
    feeds = await _feeds(2 << 20)
    net.gw.configure(None, ["127.0.0.2"], host_dns=False, budgets={"nodeBufferBytes": 4 << 20})
    big = _vm(net.gw, "big")
    big.set_wait({"deliver": "complete", "maxBufferBytes": 64 << 20})
    small = _vm(net.gw, "small")
    small.set_wait({"deliver": "first-byte", "maxBufferBytes": 64 << 20})
    big.hold(False)
    mine = [await net.connect(big, "127.0.0.2", feeds.port) for _ in range(8)]
    await _until(lambda: len(feeds.writers) == 8 and _all_stopped(big) and _buffered(big) > 0)
    # The node's 4 MiB less both VMs' floors (1 MiB each) is shared: big takes its floor
    # and the shared 2 MiB, plus one read per connection; never its 64 MiB.
    assert _buffered(big) <= (3 << 20) + 8 * READ_CHUNK, _buffered(big)
    small.hold(False)
    theirs = await net.connect(small, "127.0.0.2", feeds.port)
    assert theirs is not None
    await _until(lambda: small.ready is not None)  # its floor took the first bytes
    assert small.ready == "first-byte" and _buffered(small) > 0
    for vm, guests in ((big, mine), (small, [theirs])):
        vm.release()
        for g in guests:
            assert g is not None and await _read_all(g, feeds.size) == bytes(range(256)) * (feeds.size // 256)
    assert net.gw.buffer_pool.beyond == 0
    feeds.server.close()


async def test_the_node_caps_connections_and_each_vm_keeps_its_floor(net: Net) -> None:
    feeds = await _feeds(1024)
    net.gw.configure(None, ["127.0.0.2"], host_dns=False, budgets={"nodeConnections": 100})
    floor = budgets.VM_FD_FLOOR // budgets.FDS_PER_CONNECTION
    greedy, other = _vm(net.gw, "greedy"), _vm(net.gw, "other")
    shared = 100 - 2 * floor
    got = [await net.connect(greedy, "127.0.0.2", feeds.port) for _ in range(floor + shared + 10)]
    assert sum(1 for g in got if g is not None) == floor + shared, "greedy: its floor and the shared part"
    assert greedy.counters["refused"] == 10
    assert any(e["rule"] == NODE_CONNECTIONS_RULE for e in net.gw.events.since(0))
    mine = [await net.connect(other, "127.0.0.2", feeds.port) for _ in range(floor)]
    assert all(mine), "another VM still gets its own floor"
    assert await _read_all(mine[0], 1024) == bytes(range(256)) * 4  # type: ignore[union-attr]
    feeds.server.close()


# -- bare-IP connections wait for their first bytes without polling -----------------------------


async def test_an_undecided_connection_waits_for_bytes_without_polling(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    feeds = await _feeds(1024)
    monkeypatch.setattr(vm_gateway, "PEEK_TIMEOUT_S", 0.5)
    calls: list[bytes] = []
    real = sniff.name_in

    def counting(data: bytes) -> str | None:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(sniff, "name_in", counting)
    # A domain rule could apply, so a bare IP is peeked at; the address rule lets it through.
    vm = _vm(net.gw, "vm-1", EgressAllow(allow=["api.test", f"127.0.0.2:{feeds.port}"]))
    g = await net.connect(vm, "127.0.0.2", feeds.port)
    assert g is not None
    g.writer.write(b"GE")  # a start that names nothing yet, then silence until the timeout
    await g.writer.drain()
    data = await _read_all(g, 1024)  # judged by its address once the peek timed out
    assert data == bytes(range(256)) * 4
    # Looked at when the connection came and when its bytes came: not every few ms.
    assert 1 <= len(calls) <= 3, len(calls)
    feeds.server.close()


# -- events: one ring per VM ----------------------------------------------------------------


async def test_one_tenants_refusals_do_not_push_out_anothers_events() -> None:
    gw = Gateway()
    victim = _vm(gw, "victim", "none")
    victim.denied(name="evil.test", address=None, port=443, rule="egress none")
    # Many VMs of another tenant, each refused a burst: far more events than a ring holds.
    for i in range(400):
        vm = _vm(gw, f"noisy-{i}", "none")
        for j in range(vm_gateway.EVENT_BURST):
            vm.denied(name=f"n{j}.test", address=None, port=80, rule="egress none")
    kept = gw.events.since(0)
    assert any(e["vmId"] == "victim" and e["name"] == "evil.test" for e in kept)
    seqs = [e["seq"] for e in kept]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

"""Gateway parts without VMs: SNI/Host sniffing, the synthetic DNS table, the relay's
hold/release and rate limit, and DNS answers per policy (dnspython on the wire)."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from pal.manager.vmnet import control_plane_addresses
from pal.network import sniff
from pal.network.gateway import Gateway
from pal.network.names import MAX_NAMES, SYNTHETIC_NET, NameTable, is_synthetic
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide, TokenBucket, UpstreamSide
from pal.network.vm_gateway import VmGateway
from pal.spec import EgressAllow
from tests.dnsserver import loopback_dns


async def _until(cond: Any) -> None:
    """Poll ``cond`` on the event loop, with a hang guard (not a speed bound)."""
    deadline = asyncio.get_running_loop().time() + 60
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.002)


def client_hello(server_name: str) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def test_sni_from_a_real_client_hello() -> None:
    hello = client_hello("API.Example.test")
    assert sniff.name_in(hello) == "api.example.test"
    with pytest.raises(sniff.NeedMore):
        sniff.name_in(hello[:40])


def test_http_host_and_garbage() -> None:
    assert sniff.name_in(b"GET / HTTP/1.1\r\nHost: api.test:8080\r\nAccept: */*\r\n\r\n") == "api.test"
    with pytest.raises(sniff.NeedMore):
        sniff.name_in(b"GET / HTTP/1.1\r\nAccept: */*\r\n")
    assert sniff.name_in(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n") is None
    assert sniff.name_in(b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert sniff.name_in(b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00") is None  # truncated hello body
    assert sniff.name_in(b"GET / HTTP/1.1\r\nHost: bad name!\r\n\r\n") is None
    for junk in (b"\x16\x03\x01\xff\xff" + b"\x00" * 10, bytes(range(256)) * 4):
        try:
            sniff.name_in(junk)
        except sniff.NeedMore:
            pass


def test_name_table_allocates_persists_and_evicts() -> None:
    t = NameTable(max_names=3)
    a = t.address("a.test")
    assert is_synthetic(a) and t.address("a.test") == a and t.name(a) == "a.test"
    b, c = t.address("b.test"), t.address("c.test")
    assert len({a, b, c}) == 3
    restored = NameTable.from_json(t.to_json(), max_names=3)
    assert [restored.name(x) for x in (a, b, c)] == ["a.test", "b.test", "c.test"]
    d = restored.address("d.test")  # full: the least recently used (a) gives up its address
    assert d == a and restored.name(a) == "d.test" and restored.name(b) == "b.test"
    junk: Any = [["x.test", "8.8.8.8"], ["y.test"], 5, ["z.test", "198.18.0.9"]]
    assert NameTable.from_json(junk).to_json() == [["z.test", "198.18.0.9"]]
    assert MAX_NAMES < SYNTHETIC_NET.num_addresses


def test_token_bucket() -> None:
    now = [0.0]
    b = TokenBucket(1000, clock=lambda: now[0])
    assert b.take(1000) == 0.0
    assert b.take(500) == pytest.approx(0.5)
    now[0] = 2.0
    assert b.take(100) == 0.0


async def _pair() -> tuple[Connection, asyncio.StreamReader, asyncio.StreamWriter, list[Any]]:
    """A Connection between a real client socket (the 'guest') and a real server (the
    'upstream'), all on loopback."""
    loop = asyncio.get_running_loop()
    upstream_writers: list[Any] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writers.append(writer)
        await reader.read(1)

    up_server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    up_port = up_server.sockets[0].getsockname()[1]
    made: asyncio.Future[Connection] = loop.create_future()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        conn = Connection(1, transport, ("127.0.0.1", up_port))
        side.conn = conn
        made.set_result(conn)

    guest_server = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", guest_server.sockets[0].getsockname()[1])
    conn = await made
    transport, _ = await loop.create_connection(lambda: UpstreamSide(conn), "127.0.0.1", up_port)
    conn.attach_upstream(transport, ("127.0.0.1", up_port))  # type: ignore[arg-type]
    await _until(lambda: bool(upstream_writers))
    return conn, reader, writer, [up_server, guest_server, *upstream_writers]


async def test_hold_buffers_upstream_data_until_release() -> None:
    conn, reader, writer, keep = await _pair()
    up = keep[2]
    writer.write(b"request")
    await writer.drain()
    await _until(lambda: conn.waiting)
    assert conn.waiting, "request sent, nothing delivered: the connection waits"
    conn.hold()
    up.write(b"x" * 100_000)
    await up.drain()
    await _until(lambda: conn.buffered == 100_000)
    assert conn.buffered == 100_000 and conn.bytes_down == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), timeout=0.05)
    up.close()  # the response ends while held
    await asyncio.sleep(0.05)
    assert conn.state == "open", "held data is still to be delivered"
    conn.release()
    got = await asyncio.wait_for(reader.read(), timeout=10)  # all of it, then EOF
    assert got == b"x" * 100_000 and conn.bytes_down == 100_000 and not conn.waiting
    for s in keep[:2]:
        s.close()


async def test_hold_buffer_is_bounded_by_backpressure() -> None:
    conn, reader, _writer, keep = await _pair()
    up = keep[2]
    conn.max_buffer = 64 * 1024
    conn.hold()
    up.write(b"y" * (8 * 1024 * 1024))
    await _until(lambda: conn.buffered >= conn.max_buffer)  # held data fills up to the cap...
    assert conn.buffered < 2 * 1024 * 1024, "upstream reading stopped near the cap"
    assert "hold" in conn.up_valve.reasons
    conn.release()
    got = await asyncio.wait_for(reader.readexactly(8 * 1024 * 1024), timeout=30)
    assert len(got) == 8 * 1024 * 1024
    conn.close()
    for s in keep[:2]:
        s.close()


class _FakeTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append((data, addr))


async def _ask(vm: VmGateway, name: str, rdtype: int = dns.rdatatype.A) -> dns.message.Message:
    tr = _FakeTransport()
    vm.dns_query(tr, dns.message.make_query(name, rdtype).to_wire(), ("10.0.2.15", 5353))  # type: ignore[arg-type]
    await _until(lambda: bool(tr.sent))
    return dns.message.from_wire(tr.sent[0][0])


async def test_dns_answers_follow_the_policy() -> None:
    gw = Gateway()
    gw.configure("api.test=127.0.0.2,meta.test=169.254.169.254,pub.test=151.101.0.1", ["127.0.0.2"])
    vm = VmGateway(
        gw, "vm-1", Policy(EgressAllow(allow=["api.test:8080", "meta.test", "pub.test"])), {}, NameTable()
    )
    r = await _ask(vm, "api.test")
    assert r.rcode() == dns.rcode.NOERROR
    addr = ipaddress.ip_address(r.answer[0][0].address)
    assert is_synthetic(addr) and vm.table.name(addr) == "api.test"
    assert (await _ask(vm, "api.test", dns.rdatatype.AAAA)).answer == []
    assert (await _ask(vm, "evil.test")).rcode() == dns.rcode.NXDOMAIN
    # an allowed name pointing only at an internal address the operator did not open
    assert (await _ask(vm, "meta.test")).rcode() == dns.rcode.REFUSED
    assert is_synthetic(ipaddress.ip_address((await _ask(vm, "pub.test")).answer[0][0].address))
    rules = [e["rule"] for e in gw.events.since(0)]
    assert "not in the allow list" in rules and any(r.startswith("internal") for r in rules)
    vm.policy = Policy("none")
    assert (await _ask(vm, "api.test")).rcode() == dns.rcode.REFUSED
    assert vm.counters["dnsQueries"] == 6 and vm.counters["refused"] == 3


async def test_the_control_planes_addresses_are_internal_like_the_hosts() -> None:
    """In a cluster the Pal API may run on another machine at a public address: the node
    gives its addresses to the gateway, which refuses them like its own host's."""
    gw = Gateway()
    gw.configure("pub.test=151.101.0.1,api.pal.test=151.101.0.9", [], ["151.101.0.9"])
    vm = VmGateway(gw, "vm-1", Policy("open"), {}, NameTable())
    assert is_synthetic(ipaddress.ip_address((await _ask(vm, "pub.test")).answer[0][0].address))
    assert (await _ask(vm, "api.pal.test")).rcode() == dns.rcode.REFUSED
    assert not gw.guard.permits(ipaddress.ip_address("151.101.0.9"), 8080)
    gw.configure(None, ["151.101.0.9:8080"], ["151.101.0.9"])  # unless the operator opens it
    assert gw.guard.permits(ipaddress.ip_address("151.101.0.9"), 8080)
    # what a node finds for its PAL_SERVERS (a name that does not resolve is skipped)
    urls = ["http://127.0.0.3:8080", "https://[::1]:9", "http://nope.invalid:1", "not a url"]
    assert control_plane_addresses(urls) == ["127.0.0.3", "::1"]


async def test_denied_events_are_rate_limited_and_counted() -> None:
    gw = Gateway()
    vm = VmGateway(gw, "vm-1", Policy("none"), {}, NameTable())
    for i in range(100):
        vm.denied(name=f"n{i}.test", address=None, port=80, rule="egress none")
    assert vm.counters["refused"] == 100
    assert len(gw.events.since(0)) <= 12, "a burst, then the rate"
    vm._ev_at -= 10  # ten seconds later
    vm.denied(name="late.test", address=None, port=80, rule="egress none")
    last = gw.events.since(0)[-1]
    assert last["name"] == "late.test" and last["suppressed"] > 80


async def test_static_dns_sends_no_lookup_off_the_node() -> None:
    """PAL_EGRESS_DNS=static: names outside PAL_EGRESS_RESOLVE do not resolve, and the
    host's name servers are never asked (with the default, they are)."""
    with loopback_dns({"elsewhere.example": "151.101.0.1"}) as server:
        budgets = {"nameservers": server.nameserver}
        gw = Gateway()
        gw.configure("api.test=127.0.0.2", ["127.0.0.2"], host_dns=False, budgets=budgets)
        vm = VmGateway(gw, "vm-1", Policy("open"), {}, NameTable())
        assert (await _ask(vm, "api.test")).rcode() == dns.rcode.NOERROR
        assert (await _ask(vm, "elsewhere.example")).rcode() == dns.rcode.NXDOMAIN
        assert server.queries == []
        gw.configure("api.test=127.0.0.2", ["127.0.0.2"], budgets=budgets)
        assert (await _ask(vm, "elsewhere.example")).rcode() == dns.rcode.NOERROR
        assert sorted(server.queries) == ["elsewhere.example"] * 2  # A and AAAA

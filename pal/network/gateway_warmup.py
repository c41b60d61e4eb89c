"""The gateway's warm-up: every code path run once before it drops privileges (Python
imports lazily, and after the drop the code may no longer be readable)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from pal.network import broker, lookups, sniff
from pal.network.hostaddrs import host_addresses
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide, TokenBucket, UpstreamSide
from pal.network.vm_gateway import NodeGateway, VmGateway
from pal.spec import egress_from_json


async def warm_up(warm_gateway: Callable[[], NodeGateway]) -> None:
    """Run every code path once before dropping privileges: Python imports lazily, and
    after the drop the code (a pyenv under /root, say) may no longer be readable."""
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.HTTPS, dns.rdatatype.TXT):
        q = dns.message.make_query("warm.test", rdtype, use_edns=0)
        dns.message.from_wire(q.to_wire())
        r = dns.message.make_response(q)
        r.set_rcode(dns.rcode.NXDOMAIN)
        dns.message.from_wire(r.to_wire())
    gw = warm_gateway()  # configured to resolve warm.test to loopback
    for egress in (
        "none",
        "open",
        {"allow": ["warm.test:1", "*.w.test", "10.0.0.0/8", "[::1]:1"]},
        {"deny": ["x.test"]},
    ):
        Policy(egress_from_json(egress)).decide("warm.test", [ipaddress.ip_address("127.0.0.1")], 1)
    vm = VmGateway(gw, "warm", Policy("open"), {"egressMbps": 1}, NameTable())

    class _Tr:
        def sendto(self, data: bytes, addr: Any) -> None:
            dns.message.from_wire(data)

    for name in ("warm.test", "nonexistent.invalid"):
        await vm._answer(_Tr(), dns.message.make_query(name, dns.rdatatype.A), ("127.0.0.1", 1))  # type: ignore[arg-type]
    for data in (b"GET / HTTP/1.1\r\nHost: warm.test\r\n\r\n", b"\x16\x03\x01\x00\x01\x01", b"x"):
        with contextlib.suppress(sniff.NeedMore):
            sniff.name_in(data)
    # A real relay over loopback: streams, protocols, flow control, reset.
    loop = asyncio.get_running_loop()
    echo = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = echo.sockets[0].getsockname()[1]
    made: asyncio.Future[Connection] = loop.create_future()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        side.conn = Connection(0, transport, ("127.0.0.1", port), up_bucket=TokenBucket(1e6))
        side.conn.guest_data(b"x")
        made.set_result(side.conn)

    guests = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    _r, w = await asyncio.open_connection("127.0.0.1", guests.sockets[0].getsockname()[1])
    conn = await made
    tr, _ = await loop.create_connection(lambda: UpstreamSide(conn), "127.0.0.1", port)
    conn.attach_upstream(tr, ("127.0.0.1", port))  # type: ignore[arg-type]
    conn.hold()
    conn.release()
    conn.info()
    conn.reset()
    w.close()
    udp, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    udp.close()
    guests.close()
    echo.close()
    await lookups.warm_up()
    host_addresses()
    await asyncio.wait_for(_warm_up_broker(), 60)
    try:
        raise ValueError("warm-up")
    except ValueError:
        logging.getLogger("pal.gateway.warmup").debug("warm-up", exc_info=True)
    json.loads(json.dumps({"ok": True}))


async def _warm_up_broker() -> None:
    """One brokered HTTPS request over loopback: CA and leaf certificates, both TLS sides,
    h11 both ways, the header rewrite."""
    import ssl

    from pal.network.ca import new_ca

    cert, key = new_ca("warm")
    tls = broker.Tls()
    tls.configure(cert)
    issuer = tls.issuer(cert, key)
    seen: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(await r.readuntil(b"\r\n\r\n"))
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()

    srv = await asyncio.start_server(upstream, "127.0.0.1", 0, ssl=tls.server_context(issuer, "warm.test"))
    port = srv.sockets[0].getsockname()[1]
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    rule = {"name": "W", "value": "v", "placeholder": "p", "hosts": ["warm.test"], "format": "{value}"}
    rules = broker.Rules([rule])
    task = asyncio.create_task(
        broker.serve(
            theirs,
            host="warm.test",
            port=port,
            addrs=["127.0.0.1"],
            rules=rules,
            server_ctx=tls.server_context(issuer, "warm.test"),
            upstream_ctx=tls.upstream,
            vm_id="warm",
        )
    )
    r, w = await asyncio.open_connection(
        sock=ours, ssl=ssl.create_default_context(cadata=cert), server_hostname="warm.test"
    )
    w.write(b"GET / HTTP/1.1\r\nHost: warm.test\r\nAuthorization: p\r\nConnection: close\r\n\r\n")
    await r.read()
    w.close()
    await task
    srv.close()
    if not seen or b"Authorization: v" not in seen[0]:
        raise RuntimeError("the brokered-secrets warm-up did not rewrite its request")

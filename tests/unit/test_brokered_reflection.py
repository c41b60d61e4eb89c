"""Issue 23 items 2 and 8 without VMs: a brokered value never comes back to the guest, a
brokered connection carries requests for its own host only, and the CA a guest trusts
signs for its VM's brokered hosts only. A real HTTPS upstream on loopback that reflects
every request header; the gateway's real TLS terminator in between."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import ssl
from typing import Any

import pytest

from pal.network import broker
from pal.network.ca import Issuer, constrained, new_ca
from pal.network.gateway import Gateway
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide
from pal.network.vm_gateway import VmGateway

LOCAL = ipaddress.ip_address("127.0.0.1")
REAL = "sk-real-7f3a9c0e5b2d4411"
PH = "pal-brokered-key-PLACEHOLDER"
RULE = {
    "name": "KEY",
    "value": REAL,
    "placeholder": PH,
    "hosts": ["api.test"],
    "header": "Authorization",
    "format": "Bearer {value}",
}


def server_ctx(issuer: Issuer, host: str) -> ssl.SSLContext:
    chain, key = issuer.leaf(host)
    fd = os.memfd_create("t")
    os.write(fd, (chain + key).encode())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    os.close(fd)
    return ctx


class Mirror:
    """An upstream that reflects: each request's headers back as response headers
    (``X-Echo-<name>``, a redirect built from Host, CORS from Origin, the request id) and as
    a JSON body, in several writes (the value split across them)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while head := await r.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")[1:-2]
                got = dict(line.split(": ", 1) for line in lines)
                self.seen.append(got)
                body = json.dumps(got).encode()
                out = [f"X-Echo-{k}: {v}" for k, v in got.items()]
                out += [
                    f"Location: https://{got.get('Host', '')}/next",
                    f"Access-Control-Allow-Origin: {got.get('Origin', '')}",
                    f"X-Request-Id: {got.get('X-Request-Id', '')}",
                    f"Content-Length: {len(body)}",
                ]
                w.write(("HTTP/1.1 200 OK\r\n" + "\r\n".join(out) + "\r\n\r\n").encode())
                for i in range(0, len(body), 7):
                    w.write(body[i : i + 7])
                    await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()


async def brokered_exchange(requests: list[bytes], vm_ca: str, tenant_key: str) -> dict[str, Any]:
    """Each request on one brokered connection to api.test; the raw bytes the guest got,
    what the upstream saw, and the VM's events."""
    up_ca, up_key = new_ca("upstream")
    mirror = Mirror()
    srv = await asyncio.start_server(
        mirror.serve, "127.0.0.1", 0, ssl=server_ctx(Issuer(up_ca, up_key), "api.test")
    )
    port = srv.sockets[0].getsockname()[1]
    gw = Gateway()
    gw.tls.configure(up_ca)
    vm = VmGateway(
        gw, "vm-r", Policy("open"), {}, NameTable(), broker.Rules([RULE]), {"cert": vm_ca, "key": tenant_key}
    )
    loop = asyncio.get_running_loop()
    made: asyncio.Queue[Connection] = asyncio.Queue()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        side.conn = Connection(gw.next_id(), transport, ("127.0.0.1", port))
        side.conn.state, side.conn.name = "connecting", "api.test"
        made.put_nowait(side.conn)

    guests = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    ctx = ssl.create_default_context(cadata=vm_ca)
    opening = loop.create_task(
        asyncio.open_connection(
            "127.0.0.1", guests.sockets[0].getsockname()[1], ssl=ctx, server_hostname="api.test"
        )
    )
    conn = await made.get()
    assert await vm._starts_with_tls(conn)
    await vm._broker(conn, "api.test", port, [LOCAL], vm.policy)
    r, w = await asyncio.wait_for(opening, 30)
    for req in requests:
        w.write(req)
    # The last request closes the connection (an SSL transport cannot half-close).
    w.write(b"GET /last HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    got = await asyncio.wait_for(r.read(), 30)
    w.close()
    guests.close()
    srv.close()
    return {"guest": got, "upstream": mirror.seen, "events": gw.events.since(0)}


async def test_a_placeholder_in_reflected_headers_never_brings_the_value_back() -> None:
    ca, key = new_ca("tenant")
    req = (
        "GET /echo HTTP/1.1\r\nHost: api.test\r\n"
        f"Authorization: Bearer {PH}\r\nOrigin: https://{PH}.example\r\nReferer: https://x/?k={PH}\r\n"
        f"X-Request-Id: {PH}\r\nX-Org: {PH}\r\n\r\n"
    ).encode()
    out = await brokered_exchange(
        [req, req.replace(b"/echo", b"/again")], constrained(ca, key, ["api.test"]), key
    )
    # Injected into the configured header only; the reflectable ones carried the placeholder.
    assert len(out["upstream"]) == 3
    for seen in out["upstream"][:2]:
        assert seen["Authorization"] == f"Bearer {REAL}"
        assert (
            seen["Origin"] == f"https://{PH}.example" and seen["X-Request-Id"] == PH and seen["X-Org"] == PH
        )
        assert seen["Accept-Encoding"] == "identity"
    # The upstream echoed Authorization in headers and body: cut out, the placeholder back.
    guest = out["guest"]
    assert REAL.encode() not in guest
    assert guest.count(b"HTTP/1.1 200") == 3
    assert f"X-Echo-Authorization: Bearer {PH}".encode() in guest
    assert f'"Authorization": "Bearer {PH}"'.encode() in guest
    reflected = [e for e in out["events"] if e["kind"] == "secret_reflected"]
    assert reflected and reflected[0]["name"] == "api.test" and "KEY reflected" in reflected[0]["rule"]
    assert REAL not in json.dumps(out["events"])


@pytest.mark.parametrize(
    "req",
    [
        b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
        b"GET https://other.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n",
    ],
)
async def test_a_brokered_connection_carries_requests_for_its_own_host_only(req: bytes) -> None:
    """Domain fronting inside the terminated TLS: refused with 421 before the value is put
    in, so it never goes to another site on the same address."""
    ca, key = new_ca("tenant")
    ok = b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n"
    out = await brokered_exchange([ok, req], constrained(ca, key, ["api.test"]), key)
    assert len(out["upstream"]) == 1, "only the first request went up"
    assert b"HTTP/1.1 421" in out["guest"]
    denied = [e for e in out["events"] if e["kind"] == "egress_denied"]
    assert denied and "other.test does not match" in denied[0]["rule"]


def test_the_ca_a_guest_trusts_signs_for_its_brokered_hosts_only() -> None:
    """Issue 23 item 8: a leaked tenant CA key mints a certificate for any name, but the
    guest's trust anchor carries name constraints: OpenSSL refuses what is outside them."""
    ca, key = new_ca("tenant")
    anchor = constrained(ca, key, ["api.test", "*.wild.test"])
    leaked = Issuer(ca, key)  # whoever holds the key, with the unconstrained certificate

    def handshake(trusted: str, host: str) -> str:
        srv_ctx = server_ctx(leaked, host)
        cli_ctx = ssl.create_default_context(cadata=trusted)
        c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
        cli = cli_ctx.wrap_bio(c_in, c_out, server_hostname=host)
        srv = srv_ctx.wrap_bio(s_in, s_out, server_side=True)
        for _ in range(10):
            for side, src, dst in ((cli, c_out, s_in), (srv, s_out, c_in)):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as exc:
                    return exc.verify_message
                dst.write(src.read())
        return "ok"

    assert handshake(anchor, "api.test") == "ok"
    assert handshake(anchor, "x.wild.test") == "ok"
    assert handshake(ca, "bank.example") == "ok", "without constraints the key signs anything"
    assert handshake(anchor, "bank.example") == "permitted subtree violation"
    assert constrained(ca, key, ["*.wild.test", "api.test"]) == anchor, "deterministic"

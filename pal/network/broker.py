"""Brokered secrets in the egress gateway: TLS terminated for the hosts that have one, the
real value put into each request's headers, the request re-encrypted to the real upstream.

Only connections whose name (DNS or SNI) matches a brokered secret's ``hosts`` and that
start with a TLS ClientHello come here; every other connection (other hosts, plain HTTP)
is relayed untouched, so a placeholder sent anywhere else goes out as the placeholder.

How a brokered connection runs: the gateway's ordinary relay (relay.Connection: counters,
limits, hold/release) carries the guest's bytes to one end of a socketpair instead of to
the upstream; :func:`serve` holds the other end, where it is a TLS server with a leaf
certificate for the name signed by the tenant's CA (ca.py), and talks HTTP/1.1 (h11, ALPN
http/1.1 only) to a TLS client connection to the upstream, verified against the system
store plus ``PAL_EGRESS_CA_BUNDLE``. Each request must name the connection's host (its
``Host`` and an absolute target's authority; otherwise 421 and an ``egress_denied`` event),
and its headers are rewritten (:meth:`Rules.rewrite`: the value goes into the configured
header only); request bodies stream through unchanged. Each response is searched for the
values injected and they are replaced by their placeholders (redact.py; a
``secret_reflected`` event says so). An upgraded connection (101) is relayed as bytes from
then on, unsearched.

The value exists only in this process's memory and the node's: it is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

from pal.network import redact
from pal.network.ca import Issuer
from pal.network.namecheck import Refused, authority_name

log = logging.getLogger("pal.gateway.broker")

READ = 64 * 1024
HANDSHAKE_TIMEOUT_S = 30.0
MAX_CONTEXTS = 256  # leaf certificates kept per tenant CA
MAX_HEADER_BYTES = 64 * 1024
# Without a configured ``header`` the placeholder is replaced in these request headers only:
# credential headers, which upstreams do not echo the way they echo Origin or Referer.
DEFAULT_HEADERS = (b"authorization", b"x-api-key")
SECRET_REFLECTED = "secret_reflected"
EGRESS_DENIED = "egress_denied"
# (event kind, host, rule) of this VM: gateway.VmGateway.denied
Audit = Callable[[str, str | None, str], None]


@dataclass(frozen=True)
class Rule:
    name: str
    value: str
    placeholder: str
    hosts: tuple[str, ...]
    header: str | None
    format: str

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Rule:
        return cls(
            name=str(raw["name"]),
            value=str(raw["value"]),
            placeholder=str(raw["placeholder"]),
            hosts=tuple(str(h).lower() for h in raw["hosts"]),
            header=str(raw["header"]) if raw.get("header") else None,
            format=str(raw.get("format") or "{value}"),
        )

    def matches(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for h in self.hosts:
            if h.startswith("*."):
                if host.endswith(h[1:]) and host != h[2:]:
                    return True
            elif host == h:
                return True
        return False


class Rules:
    """One VM's brokered secrets."""

    def __init__(self, raw: list[dict[str, Any]] | None = None) -> None:
        self.rules = [Rule.from_json(r) for r in raw or []]

    def __bool__(self) -> bool:
        return bool(self.rules)

    def for_host(self, host: str | None) -> list[Rule]:
        return [r for r in self.rules if host and r.matches(host)]

    def rewrite(self, host: str, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The headers with this host's secrets in, only where configured: a rule's
        ``header`` is set to its format (the guest's own value of it dropped); a rule
        without one has its placeholder replaced in :data:`DEFAULT_HEADERS`. A placeholder
        anywhere else (Host, Origin, Referer, a custom header an upstream may reflect)
        goes out as the placeholder."""
        rules = self.for_host(host)
        out = []
        for k, v in headers:
            if k.lower() in DEFAULT_HEADERS:
                for r in rules:
                    if r.header is None and r.placeholder.encode() in v:
                        v = v.replace(r.placeholder.encode(), r.value.encode())
            out.append((k, v))
        for r in rules:
            if r.header:
                name = r.header.lower().encode()
                out = [(k, v) for k, v in out if k.lower() != name]
                out.append((r.header.encode(), r.format.replace("{value}", r.value).encode()))
        return out

    def redaction(self, host: str) -> list[redact.Pair]:
        """What to cut out of this host's responses: each value, back to its placeholder."""
        return redact.pairs_of((r.value, r.placeholder) for r in self.for_host(host))


class Tls:
    """The TLS contexts of one gateway: upstream verification, and per-tenant leaf contexts."""

    def __init__(self) -> None:
        self.upstream = self.upstream_context(None)
        self._issuers: dict[str, Issuer] = {}
        self._leaves: OrderedDict[tuple[str, str], str] = OrderedDict()

    @staticmethod
    def upstream_context(extra_ca_pem: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        if extra_ca_pem:
            ctx.load_verify_locations(cadata=extra_ca_pem)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def configure(self, extra_ca_pem: str | None) -> None:
        self.upstream = self.upstream_context(extra_ca_pem)

    def issuer(self, ca_cert: str, ca_key: str) -> Issuer:
        got = self._issuers.get(ca_cert)
        if got is None:
            got = self._issuers[ca_cert] = Issuer(ca_cert, ca_key)
        return got

    def server_context(self, issuer: Issuer, host: str) -> ssl.SSLContext:
        """A fresh context per connection (cheap) around a cached leaf certificate."""
        key = (issuer.ca_cert_pem, host)
        pem = self._leaves.get(key)
        if pem is None:
            chain, leaf_key = issuer.leaf(host)
            pem = self._leaves[key] = chain + leaf_key
        self._leaves.move_to_end(key)
        while len(self._leaves) > MAX_CONTEXTS:
            self._leaves.popitem(last=False)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])  # we rewrite HTTP/1.1 only
        # ssl loads certificates from files only: an anonymous memory file, never on disk.
        fd = os.memfd_create("pal-leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem.encode())
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return ctx


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _accept_tls(sock: socket.socket, ctx: ssl.SSLContext) -> Streams:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ)
    protocol = asyncio.StreamReaderProtocol(reader)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, sock=sock, ssl=ctx, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def _connect_upstream(
    addrs: list[str], port: int, host: str, ctx: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    last: BaseException | None = None
    for addr in addrs:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(addr, port, ssl=ctx, server_hostname=host, limit=READ),
                HANDSHAKE_TIMEOUT_S,
            )
        except ssl.SSLError:
            raise  # a certificate that does not verify: no other address is tried
        except (OSError, TimeoutError) as exc:
            last = exc
    raise ConnectionError(f"no address of {host} answered: {last}")


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(READ):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


class _Exchange:
    """HTTP/1.1 between the guest (we are its server) and the upstream (we are its client)."""

    def __init__(
        self,
        guest: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        host: str,
        rules: Rules,
        audit: Audit,
    ) -> None:
        self.g_reader, self.g_writer = guest
        self.u_reader, self.u_writer = up
        self.host = host
        self.rules = rules
        self.audit = audit
        self.pairs: list[redact.Pair] = []  # the values sent with the current request
        self.head_only = False  # the current request is a HEAD: its answer has no body
        self.g = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.u = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)

    async def _event(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            ev = conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            conn.receive_data(await reader.read(READ))

    async def _to_up(self, ev: Any) -> None:
        self.u_writer.write(self.u.send(ev) or b"")
        await self.u_writer.drain()

    async def _to_guest(self, ev: Any) -> None:
        self.g_writer.write(self.g.send(ev) or b"")
        await self.g_writer.drain()

    async def run(self) -> None:
        while True:
            req = await self._event(self.g, self.g_reader)
            if isinstance(req, h11.ConnectionClosed) or req is h11.PAUSED:
                return
            assert isinstance(req, h11.Request)
            if self.g.they_are_waiting_for_100_continue:
                await self._to_guest(h11.InformationalResponse(status_code=100, headers=[]))
            if not await self._names_its_host(req):
                return
            drop = (b"expect", b"accept-encoding")
            headers = [(k, v) for k, v in req.headers.raw_items() if k.lower() not in drop]
            # Bodies are searched for reflected values (redact.py): ask for them uncompressed.
            headers = [*self.rules.rewrite(self.host, headers), (b"Accept-Encoding", b"identity")]
            self.pairs = self.rules.redaction(self.host)
            self.head_only = req.method.upper() == b"HEAD"
            await self._to_up(h11.Request(method=req.method, target=req.target, headers=headers))
            while not isinstance(ev := await self._event(self.g, self.g_reader), h11.EndOfMessage):
                await self._to_up(ev)
            await self._to_up(ev)
            upgraded = await self._response()
            if upgraded:
                return
            if self.g.our_state is h11.MUST_CLOSE or self.u.our_state is h11.MUST_CLOSE:
                return
            self.g.start_next_cycle()
            self.u.start_next_cycle()

    async def _names_its_host(self, req: h11.Request) -> bool:
        """Does the request name the host this connection was brokered for (its Host and an
        absolute target)? Otherwise the guest gets 421 and the connection ends: a request
        for another site on the same address never carries the value there."""
        hosts = [v for k, v in req.headers.raw_items() if k.lower() == b"host"]
        try:
            if len(hosts) != 1:
                raise Refused("a request without exactly one Host header")
            names = {authority_name(hosts[0])}
            if b"://" in req.target:
                names.add(authority_name(req.target.split(b"://", 1)[1].split(b"/", 1)[0]))
            wrong = sorted(n or "(an IP address)" for n in names if n != self.host)
            if wrong:
                raise Refused(f"HTTP Host {wrong[0]} does not match the brokered name", wrong[0])
        except Refused as exc:
            self.audit(EGRESS_DENIED, exc.host or self.host, str(exc))
            body = b"this connection is for " + self.host.encode() + b" only\n"
            out = [(b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]
            await self._to_guest(h11.Response(status_code=421, headers=out))
            await self._to_guest(h11.Data(data=body))
            await self._to_guest(h11.EndOfMessage())
            return False
        return True

    def _redacted(self, headers: list[tuple[bytes, bytes]], where: str) -> list[tuple[bytes, bytes]]:
        out, hits = redact.redact_headers(headers, self.pairs)
        if hits:
            self._reflected(where)
        return out

    def _reflected(self, where: str) -> None:
        names = ", ".join(r.name for r in self.rules.for_host(self.host))
        rule = f"{names} reflected in the {where}; replaced by the placeholder"
        self.audit(SECRET_REFLECTED, self.host, rule)

    async def _response(self) -> bool:
        while True:
            resp = await self._event(self.u, self.u_reader)
            if isinstance(resp, h11.ConnectionClosed):
                raise ConnectionError("the upstream closed without answering")
            headers = self._redacted(list(resp.headers.raw_items()), "response headers")
            if isinstance(resp, h11.InformationalResponse):
                if resp.status_code == 101:
                    await self._to_guest(h11.InformationalResponse(status_code=101, headers=headers))
                    await self._switch()
                    return True
                await self._to_guest(h11.InformationalResponse(status_code=resp.status_code, headers=headers))
                continue
            body = self._body_redactor(resp.status_code, headers)
            if body is not None:  # its length changes with each value cut out: re-framed
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            out = h11.Response(status_code=resp.status_code, headers=headers, reason=resp.reason)
            await self._to_guest(out)
            break
        while not isinstance(ev := await self._event(self.u, self.u_reader), h11.EndOfMessage):
            if body is not None and isinstance(ev, h11.Data):
                ev = h11.Data(data=body.feed(ev.data))
                if not ev.data:
                    continue  # all of it kept back: it may begin a value
            await self._to_guest(ev)
        if body is not None:
            if rest := body.flush():
                await self._to_guest(h11.Data(data=rest))
            if body.hits:
                self._reflected("response body")
        trailers = self._redacted(list(ev.headers.raw_items()), "response trailers")
        await self._to_guest(h11.EndOfMessage(headers=trailers))
        return False

    def _body_redactor(self, status: int, headers: list[tuple[bytes, bytes]]) -> redact.Redactor | None:
        """A body to search: one that exists, and is not compressed (a compressed body is
        relayed as it is: the gateway asked for identity, an upstream may ignore that)."""
        if not self.pairs or self.head_only or status in (204, 304):
            return None
        codings = [v.strip().lower() for k, v in headers if k.lower() == b"content-encoding"]
        if any(c not in (b"", b"identity") for c in codings):
            return None
        return redact.Redactor(self.pairs)

    async def _switch(self) -> None:
        """After a 101: raw bytes both ways, starting with what h11 already read."""
        g_rest, _ = self.g.trailing_data
        u_rest, _ = self.u.trailing_data
        if g_rest:
            self.u_writer.write(g_rest)
        if u_rest:
            self.g_writer.write(u_rest)
        await asyncio.gather(_pump(self.g_reader, self.u_writer), _pump(self.u_reader, self.g_writer))


async def serve(
    sock: socket.socket,
    *,
    host: str,
    port: int,
    addrs: list[str],
    rules: Rules,
    server_ctx: ssl.SSLContext,
    upstream_ctx: ssl.SSLContext,
    vm_id: str,
    audit: Audit | None = None,
) -> None:
    """Terminate the guest's TLS on ``sock`` and broker its requests to ``host:port``."""
    writers: list[asyncio.StreamWriter] = []
    try:
        try:
            guest = await _accept_tls(sock, server_ctx)
        except BaseException:
            sock.close()  # never handed to a transport
            raise
        # From here the transport owns ``sock``: closing it behind the event loop's back
        # would free its descriptor number while still registered (the next socket with
        # that number would never be read).
        writers.append(guest[1])
        up = await _connect_upstream(addrs, port, host, upstream_ctx)
        writers.append(up[1])
        await _Exchange(guest, up, host, rules, audit or (lambda *_: None)).run()
    except (h11.ProtocolError, ssl.SSLError, OSError, ConnectionError, TimeoutError) as exc:
        # No header or value in the message: only what failed.
        log.info("VM %s brokered connection to %s:%d ended: %s", vm_id, host, port, type(exc).__name__)
    finally:
        for w in writers:
            w.close()


def is_tls(first: bytes) -> bool | None:
    """Whether a connection's first bytes are a TLS handshake (None: too few to tell)."""
    if len(first) < 3:
        return None
    return first[0] == 0x16 and first[1] == 0x03

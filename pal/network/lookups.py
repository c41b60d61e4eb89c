"""Names to addresses for the gateway: PAL_EGRESS_RESOLVE first, then (unless
PAL_EGRESS_DNS=static) the host's name servers, asked asynchronously (dnspython's asyncio
resolver) with timeouts of the gateway's own.

Lookups run on the gateway's event loop, not on a thread pool a few threads wide, so a
name server that never answers costs a VM a few sockets and a timeout, never another VM's
lookups. Each lookup takes a slot of its VM, then one of the node's (budgets.py): a guest
asking for random names under a silent domain fills only its own slots. Concurrent lookups
of one name share one query. Answers are cached (their TTL, at most ``CACHE_S``), and so
are names that do not exist; failures (timeouts, no server answering) are not.

The name servers are PAL_EGRESS_NAMESERVERS (``ip[:port],...``, pal/config.py), else /etc/resolv.conf's
(re-read when it changes). /etc/hosts is not consulted: PAL_EGRESS_RESOLVE is the way to
give a name a fixed address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rcode
import dns.rdatatype
import dns.resolver

from pal.network.budgets import NODE_LOOKUPS, VM_LOOKUPS, Slots
from pal.network.internal import Address

LOOKUP_TRY_S = 2.0  # one query to one name server
LOOKUP_LIFETIME_S = 5.0  # a whole lookup: A and AAAA, every server, retries
CACHE_S = 30.0  # at most, for an answer (its TTL if shorter) or a name that does not exist
CACHE_NAMES = 10_000
RESOLV_CONF = "/etc/resolv.conf"


@dataclass(frozen=True)
class Found:
    """A lookup's outcome: addresses (IPv4 first), or none because the name has none
    (``failed`` False) or because no name server answered in time (``failed`` True)."""

    addresses: tuple[Address, ...] = ()
    failed: bool = False

    @property
    def rcode(self) -> dns.rcode.Rcode:
        """What the guest is told when there is no address."""
        return dns.rcode.SERVFAIL if self.failed else dns.rcode.NXDOMAIN


class Resolver:
    def __init__(self) -> None:
        self.static: dict[str, list[Address]] = {}
        self.host_dns = True
        self.node = Slots(NODE_LOOKUPS)
        self._nameservers: list[tuple[str, int]] = []  # empty: resolv.conf's
        self._dns: dns.asyncresolver.Resolver | None = None
        self._conf_mtime: float | None = None
        self._cache: dict[str, tuple[float, Found]] = {}
        self._inflight: dict[str, asyncio.Task[Found]] = {}

    def configure(
        self, static: dict[str, list[Address]], host_dns: bool, nameservers: list[tuple[str, int]]
    ) -> None:
        self.static, self.host_dns, self._nameservers = static, host_dns, list(nameservers)
        self._dns = None
        self._cache.clear()

    def vm_slots(self) -> Slots:
        return Slots(VM_LOOKUPS)

    def _resolver(self) -> dns.asyncresolver.Resolver | None:
        """The dnspython resolver (made again when resolv.conf changed); None without servers."""
        if not self._nameservers:
            try:
                mtime = os.stat(RESOLV_CONF).st_mtime
            except OSError:
                mtime = None
            if mtime != self._conf_mtime:
                self._dns, self._conf_mtime = None, mtime
        if self._dns is None:
            if self._nameservers:
                r = dns.asyncresolver.Resolver(configure=False)
                r.nameservers = [dns.nameserver.Do53Nameserver(h, p) for h, p in self._nameservers]
            else:
                try:
                    r = dns.asyncresolver.Resolver(filename=RESOLV_CONF)
                except (OSError, dns.resolver.NoResolverConfiguration):
                    return None
            r.timeout, r.lifetime, r.cache = LOOKUP_TRY_S, LOOKUP_LIFETIME_S, None
            r.retry_servfail = False
            self._dns = r
        return self._dns

    async def resolve(self, name: str, slots: Slots | None = None) -> list[Address]:
        return list((await self.lookup(name, slots)).addresses)

    async def lookup(self, name: str, slots: Slots | None = None) -> Found:
        """``name``'s addresses; ``slots``: the asking VM's lookup budget."""
        if name in self.static:
            return Found(tuple(self.static[name]))
        if not self.host_dns:
            return Found()
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        async with slots.held() if slots is not None else contextlib.nullcontext():
            task = self._inflight.get(name)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._query(name))
                self._inflight[name] = task
                task.add_done_callback(lambda _t: self._inflight.pop(name, None))
            return await asyncio.shield(task)  # one asker giving up leaves it to the others

    async def _query(self, name: str) -> Found:
        async with self.node.held():
            found, ttl = await self._ask(name)
        if not found.failed:
            if len(self._cache) >= CACHE_NAMES:
                self._cache.clear()
            self._cache[name] = (time.monotonic() + ttl, found)
        return found

    async def _ask(self, name: str) -> tuple[Found, float]:
        """The name's A and AAAA addresses, and how long they may be cached."""
        resolver = self._resolver()
        if resolver is None:
            return Found(failed=True), 0.0
        try:
            qname = dns.name.from_text(name)
        except dns.exception.DNSException:
            return Found(), CACHE_S
        (v4, ttl4), (v6, ttl6) = await asyncio.gather(
            self._one(resolver, qname, dns.rdatatype.A), self._one(resolver, qname, dns.rdatatype.AAAA)
        )
        addrs = (*(v4 or ()), *(v6 or ()))
        ttl = max(1.0, min(ttl4, ttl6))
        if addrs:
            return Found(addrs), ttl
        return Found(failed=v4 is None and v6 is None), ttl

    async def _one(
        self, resolver: dns.asyncresolver.Resolver, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> tuple[list[Address] | None, float]:
        """The addresses of one type ([] when the name has none, None when the lookup
        failed) and their TTL."""
        try:
            answer = await resolver.resolve(qname, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.resolver.YXDOMAIN):
            return [], CACHE_S
        except Exception:  # timeouts, every server failing, an answer dnspython rejects
            return None, CACHE_S
        if answer.rrset is None:
            return [], CACHE_S
        out: list[Address] = []
        for rd in answer.rrset:
            with contextlib.suppress(ValueError, AttributeError):
                out.append(ipaddress.ip_address(rd.address))
        return out, min(CACHE_S, float(answer.rrset.ttl))


class _WarmServer(asyncio.DatagramProtocol):
    """Answers ``warm.test`` A with 127.0.0.1 and nothing else (the rest time out)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        import dns.message
        import dns.rdataclass
        import dns.rrset

        q = dns.message.from_wire(data)
        if q.question[0].name.to_text() != "warm.test.":
            return
        r = dns.message.make_response(q)
        if q.question[0].rdtype == dns.rdatatype.A:
            rrset = dns.rrset.from_text("warm.test.", 5, dns.rdataclass.IN, dns.rdatatype.A, "127.0.0.1")
            r.answer.append(rrset)
        self.transport.sendto(r.to_wire(), addr)


async def warm_up() -> None:
    """One lookup answered and one timed out, over loopback, before the gateway drops its
    privileges: dnspython imports its asyncio backend and record types lazily."""
    import dns.rdata
    import dns.rdataclass

    for rdtype in ("A", "AAAA", "CNAME", "DNAME", "SOA"):  # what answers carry (imported lazily)
        dns.rdata.get_rdata_class(dns.rdataclass.IN, dns.rdatatype.from_text(rdtype))
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_WarmServer, local_addr=("127.0.0.1", 0))
    try:
        port = transport.get_extra_info("sockname")[1]
        r = Resolver()
        r.configure({}, True, [("127.0.0.1", port)])
        found = await r.lookup("warm.test", r.vm_slots())
        if not found.addresses:
            raise RuntimeError("the lookup warm-up got no answer from its own server")
        assert r._dns is not None
        r._dns.lifetime = r._dns.timeout = 0.05
        await r.lookup("silent.test")
        with contextlib.suppress(OSError):
            Resolver()._resolver()  # resolv.conf's parser
    finally:
        transport.close()

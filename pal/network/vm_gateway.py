"""One VM's side of the egress gateway (:class:`VmGateway`): the compiled policy, the
synthetic DNS table, counters, the open connections, rate-limited ``egress_denied``
events, and the waiting I/O of a live-paused guest (gateway.py is the process)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections import deque
from typing import Any, Protocol

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from pal.guest.protocol import GATEWAY_IP
from pal.network import broker, namecheck, resvport, sniff
from pal.network.broker import EGRESS_DENIED
from pal.network.budgets import (
    FDS_PER_CONNECTION,
    VM_BYTES_FLOOR,
    VM_FD_FLOOR,
    Account,
    Pool,
)
from pal.network.events import Events
from pal.network.lookups import Resolver
from pal.network.names import NameTable, is_synthetic
from pal.network.policy import INTERNAL_RULE, Address, InternalGuard, Policy
from pal.network.relay import READ_LIMIT, Connection, GuestSide, TokenBucket, UpstreamSide, reset
from pal.spec import DEFAULT_HOLD_BUFFER, DEFAULT_MAX_CONNECTIONS

log = logging.getLogger("pal.gateway")

SO_ORIGINAL_DST = 80
VOLUME_SERVER_ADDRESS = GATEWAY_IP  # the host side of every VM's link (netns.py)
# Waiting for a ClientHello / request head on a bare-IP connection when a name rule could
# apply. A client may take a while to send them (curl loads its CA bundle after connect();
# seconds under TCG on a busy host); a server-speaks-first protocol waits this long before
# being judged by its address alone.
PEEK_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 10.0
DNS_TTL_S = 30  # of synthetic answers; the table keeps the address longer
MAX_DNS_INFLIGHT = 32  # per VM; more are dropped (the guest retries)
EVENT_RATE_PER_S = 2.0  # egress_denied events per VM, burst EVENT_BURST
EVENT_BURST = 10
NODE_CONNECTIONS_RULE = "node connection budget (PAL_GATEWAY_MAX_CONNECTIONS)"
# deliver "complete": a response counts as complete once the upstream closed, the buffer
# is full, or no byte came for this long after the last one (keep-alive responses).
COMPLETE_QUIET_S = 0.2


class NodeGateway(Protocol):
    """What a VM's side uses of the node-wide gateway (gateway.Gateway): shared budgets,
    resolver, TLS, the internal-address guard and the event sinks."""

    events: Events
    resolver: Resolver
    tls: broker.Tls
    guard: InternalGuard
    buffer_pool: Pool
    fd_pool: Pool
    max_buffer: int
    volume_ports: dict[int, int]

    def emit(self, ev: dict[str, Any]) -> None: ...

    def next_id(self) -> int: ...


class VmGateway:
    """Everything the gateway knows about one VM (one incarnation of it)."""

    def __init__(
        self,
        gw: NodeGateway,
        vm_id: str,
        policy: Policy,
        limits: dict[str, Any],
        table: NameTable,
        rules: broker.Rules | None = None,
        ca: dict[str, str] | None = None,
    ):
        self.gw = gw
        self.vm_id = vm_id
        self.policy = policy
        self.table = table
        # Brokered secrets (broker.py) and the tenant CA that signs their leaf certificates.
        self.rules = rules or broker.Rules()
        self.issuer = gw.tls.issuer(ca["cert"], ca["key"]) if ca else None
        self._brokering: set[asyncio.Task[None]] = set()
        self.conns: dict[int, Connection] = {}
        # Budgets (budgets.py): lookups in flight, buffered bytes and descriptors.
        self.lookup_slots = gw.resolver.vm_slots()
        self.buffer = Account(gw.buffer_pool, min(DEFAULT_HOLD_BUFFER, gw.max_buffer), VM_BYTES_FLOOR)
        self.fds = Account(gw.fd_pool, DEFAULT_MAX_CONNECTIONS * FDS_PER_CONNECTION, VM_FD_FLOOR)
        self.counters = {
            "bytesIn": 0,  # delivered to the guest
            "bytesOut": 0,  # sent by the guest
            "connections": 0,
            "refused": 0,
            "dnsQueries": 0,
        }
        self.set_limits(limits)
        self._ev_tokens = float(EVENT_BURST)
        self._ev_at = time.monotonic()
        self._ev_suppressed = 0
        self._dns_inflight = 0
        self.servers: list[Any] = []
        # This VM's loopback address toward the node's volume server (None: it reaches none).
        self.volume_source: str | None = None
        # accept -> upstream connected, ms, of the latest connections (pal bench network)
        self.setup_ms: deque[float] = deque(maxlen=2000)
        # Wait management (live pause): the VM's rule, whether the node holds it, and
        # which of its connections wait on their upstream.
        self.wait: dict[str, Any] | None = None  # {deliver, maxBufferBytes}; None: not watched
        self.held = False
        self.ready: str | None = None  # why data is ready for the held guest (once per hold)
        self.waiting_ids: set[int] = set()
        self._quiet: asyncio.TimerHandle | None = None

    def set_wait(self, wait: dict[str, Any] | None) -> None:
        self.wait = dict(wait) if isinstance(wait, dict) else None
        self.buffer.set_limit(self.max_buffer)  # the VM's buffers in all, not each one's

    @property
    def max_buffer(self) -> int:
        raw = (self.wait or {}).get("maxBufferBytes")
        return int(raw) if isinstance(raw, int) and raw > 0 else min(DEFAULT_HOLD_BUFFER, self.gw.max_buffer)

    def set_limits(self, limits: dict[str, Any]) -> None:
        self.max_connections = int(limits.get("maxConnections") or DEFAULT_MAX_CONNECTIONS)
        self.fds.set_limit(self.max_connections * FDS_PER_CONNECTION)
        mbps = limits.get("egressMbps")
        rate = float(mbps) * 125_000 if mbps else None  # Mbit/s -> bytes/s
        self.up_bucket = TokenBucket(rate) if rate else None
        self.down_bucket = TokenBucket(rate) if rate else None

    def snapshot_counters(self) -> dict[str, int]:
        return {**self.counters, "active": len(self.conns)}

    # -- events ------------------------------------------------------------------------------

    def denied(
        self, *, name: str | None, address: str | None, port: int | None, rule: str, kind: str = EGRESS_DENIED
    ) -> None:
        if kind == EGRESS_DENIED:  # else an audit event of a brokered connection (broker.py)
            self.counters["refused"] += 1
        now = time.monotonic()
        self._ev_tokens = min(EVENT_BURST, self._ev_tokens + (now - self._ev_at) * EVENT_RATE_PER_S)
        self._ev_at = now
        if self._ev_tokens < 1:
            self._ev_suppressed += 1
            return
        self._ev_tokens -= 1
        ev: dict[str, Any] = {
            "vmId": self.vm_id,
            "kind": kind,
            "name": name,
            "address": address,
            "port": port,
            "rule": rule,
        }
        if self._ev_suppressed:
            ev["suppressed"] = self._ev_suppressed
            self._ev_suppressed = 0
        self.gw.events.add(ev)

    # -- TCP -----------------------------------------------------------------------------------

    def accepted(self, side: GuestSide, transport: asyncio.Transport) -> None:
        transport.set_write_buffer_limits(high=READ_LIMIT)
        sock = transport.get_extra_info("socket")
        try:
            raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            ip = socket.inet_ntoa(raw[4:8])
        except OSError:
            reset(transport)
            return
        self.admit(side, transport, ip, port)

    def admit(self, side: GuestSide, transport: asyncio.Transport, ip: str, port: int) -> None:
        """A guest connection to ``ip``:``port``: within the VM's and the node's budgets,
        decided and relayed; else reset with an event."""
        self.counters["connections"] += 1
        conn = Connection(
            self.gw.next_id(),
            transport,
            (ip, port),
            up_bucket=self.up_bucket,
            down_bucket=self.down_bucket,
            on_bytes=self._count,
            on_close=self._closed,
            max_buffer=self.max_buffer,
            on_waiting=self._waiting_changed,
            on_held=self._held_event,
            budget=self.buffer,
        )
        if self.held:
            conn.hold()  # a connection the guest opened just before its vCPUs stopped
        side.conn = conn
        if len(self.conns) >= self.max_connections:
            self.denied(name=None, address=ip, port=port, rule=f"maxConnections ({self.max_connections})")
            conn.reset()
            return
        if not self.fds.fits(FDS_PER_CONNECTION):  # the node's connections are at their cap
            self.denied(name=None, address=ip, port=port, rule=NODE_CONNECTIONS_RULE)
            conn.reset()
            return
        self.fds.take(FDS_PER_CONNECTION)
        self.conns[conn.id] = conn
        asyncio.get_running_loop().create_task(self._open(conn))

    def _count(self, up: int, down: int) -> None:
        self.counters["bytesOut"] += up
        self.counters["bytesIn"] += down

    def _closed(self, conn: Connection) -> None:
        if self.conns.pop(conn.id, None) is not None:
            self.fds.give(FDS_PER_CONNECTION)

    async def _open(self, conn: Connection) -> None:
        t0 = time.perf_counter()
        try:
            await self._decide_and_connect(conn)
            if conn.state == "open":
                self.setup_ms.append((time.perf_counter() - t0) * 1000)
        except Exception as exc:  # never let one connection hurt the gateway
            log.warning("VM %s connection to %s failed: %r", self.vm_id, conn.dst, exc)
            conn.reset()

    async def _peek_name(self, conn: Connection) -> str | None:
        deadline = asyncio.get_running_loop().time() + PEEK_TIMEOUT_S
        while conn.state == "deciding":
            try:
                return sniff.name_in(conn.pending_bytes())
            except sniff.NeedMore:
                pass
            if len(conn.pending_bytes()) > sniff.MAX_PEEK or not await conn.more_pending(deadline):
                return None
        return None

    async def _decide_and_connect(self, conn: Connection) -> None:
        ip_s, port = conn.dst
        if ip_s == VOLUME_SERVER_ADDRESS and port in self.gw.volume_ports and self.volume_source:
            await self._to_volume_server(conn, port)
            return
        ip = ipaddress.ip_address(ip_s)
        policy = self.policy
        name: str | None = None
        if is_synthetic(ip):
            name = self.table.name(ip)
            if name is None:
                self.denied(name=None, address=ip_s, port=port, rule="unknown synthetic address")
                conn.reset()
                return
        elif policy.domains:
            name = await self._peek_name(conn)
            policy = self.policy  # the peek may wait seconds: decide by the policy in force now
        if conn.state == "closed":
            return
        # The guest named its destination: connect only to what we resolve for that name
        # (a bare IP is used as asked only when no name rule is involved).
        by_name = name is not None and (is_synthetic(ip) or policy.domain_rule(name, port) is not None)
        if by_name:
            assert name is not None
            candidates = await self.gw.resolver.resolve(name, self.lookup_slots)
            if ip in candidates:
                candidates.remove(ip)
                candidates.insert(0, ip)
            if not candidates:
                self.denied(name=name, address=None, port=port, rule="name does not resolve")
                conn.reset()
                return
        else:
            candidates = [ip]
        verdict = policy.decide(name, candidates, port)
        if not verdict.allowed:
            self.denied(name=name, address=str(candidates[0]), port=port, rule=verdict.rule)
            conn.reset()
            return
        guard = self.gw.guard
        allowed = [a for a in verdict.addresses if guard.permits(a, port)]
        if not allowed:
            self.denied(name=name, address=str(verdict.addresses[0]), port=port, rule=INTERNAL_RULE)
            conn.reset()
            return
        conn.name, conn.rule, conn.state = name, verdict.rule, "connecting"
        if policy.binds(name, port):  # its SNI and every Host must match (namecheck.py)
            namecheck.bind(conn, port, lambda: self.policy, self.denied)
        if name is not None and self.issuer is not None and self.rules.for_host(name):
            if await self._starts_with_tls(conn):
                await self._broker(conn, name, port, allowed, policy)
                return
            if conn.state == "closed":
                return
        loop = asyncio.get_running_loop()
        last: BaseException | None = None
        for addr in allowed:
            if conn.state == "closed":
                return
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_connection(lambda: UpstreamSide(conn), str(addr), port),
                    timeout=CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as exc:
                last = exc
                continue
            if conn.state == "closed" or not self._still_allowed(conn, policy, addr, port):
                transport.abort()
                return
            transport.set_write_buffer_limits(high=READ_LIMIT)
            conn.attach_upstream(transport, (str(addr), port))  # type: ignore[arg-type]
            return
        log.info("VM %s: upstream %s:%d unreachable: %s", self.vm_id, name or ip_s, port, last)
        conn.reset()

    async def _to_volume_server(self, conn: Connection, port: int) -> None:
        """The guest's NFS or MOUNT connection (docs/volumes.md): to the node's volume
        server, from this VM's own source address, which the server's exports list for the
        volumes this VM mounts (and for no other); outside the egress policy."""
        assert self.volume_source is not None
        conn.name, conn.rule, conn.state = None, "volume", "connecting"
        try:
            # from a port below 1024: the exports take the VM's address from no other
            # (any local process may bind 127.77.x.y, only the gateway such a port)
            sock = await resvport.open_connection(
                self.volume_source, "127.0.0.1", self.gw.volume_ports[port], CONNECT_TIMEOUT_S
            )
            try:
                transport, _ = await asyncio.get_running_loop().create_connection(
                    lambda: UpstreamSide(conn), sock=sock
                )
            except BaseException:
                sock.close()
                raise
        except (OSError, TimeoutError) as exc:
            log.info("VM %s: the volume server is unreachable: %s", self.vm_id, exc)
            conn.reset()
            return
        if conn.state == "closed":
            transport.abort()
            return
        transport.set_write_buffer_limits(high=READ_LIMIT)
        conn.attach_upstream(transport, ("127.0.0.1", self.gw.volume_ports[port]))  # type: ignore[arg-type]

    def _still_allowed(self, conn: Connection, decided_by: Policy, addr: Address, port: int) -> bool:
        """Right before a connection starts relaying: was it decided by the policy in force?
        A live change (apply_policy) resets only open connections; one still deciding or
        connecting meanwhile (a peek, a lookup, a slow connect) is judged here, with no
        await between this check and the relay, so no connection escapes the new policy."""
        if self.policy is decided_by:
            return True
        verdict = self.policy.decide(conn.name, [addr], port)
        if verdict.allowed:
            conn.rule = verdict.rule
            return True
        self.denied(name=conn.name, address=str(addr), port=port, rule=verdict.rule)
        conn.reset()
        return False

    async def _starts_with_tls(self, conn: Connection) -> bool:
        """Wait for the guest's first bytes: a ClientHello or not (a server-speaks-first
        protocol sends nothing: it is relayed untouched)."""
        deadline = asyncio.get_running_loop().time() + PEEK_TIMEOUT_S
        while conn.state != "closed":
            tls = broker.is_tls(conn.pending_bytes())
            if tls is not None:
                return tls
            if not await conn.more_pending(deadline):
                return False
        return False

    async def _broker(
        self, conn: Connection, name: str, port: int, allowed: list[Address], decided_by: Policy
    ) -> None:
        """Carry the guest's bytes to a local TLS terminator instead of the upstream; it
        talks to the upstream itself, with the secrets put in (broker.py). The relay keeps
        counting, limiting and holding this connection like any other."""
        assert self.issuer is not None
        server_ctx = self.gw.tls.server_context(self.issuer, name)
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: UpstreamSide(conn), sock=ours)
        except OSError:
            ours.close()
            theirs.close()
            conn.reset()
            return
        if conn.state == "closed" or not self._still_allowed(conn, decided_by, allowed[0], port):
            transport.abort()
            theirs.close()
            return
        addrs = [str(a) for a in allowed]
        transport.set_write_buffer_limits(high=READ_LIMIT)
        conn.rule += " (brokered)"
        conn.attach_upstream(transport, (addrs[0], port))  # type: ignore[arg-type]
        task = loop.create_task(
            broker.serve(
                theirs,
                host=name,
                port=port,
                addrs=addrs,
                rules=self.rules,
                server_ctx=server_ctx,
                upstream_ctx=self.gw.tls.upstream,
                vm_id=self.vm_id,
                audit=lambda kind, host, rule: self.denied(
                    kind=kind, name=host, address=addrs[0], port=port, rule=rule
                ),
            )
        )
        self._brokering.add(task)
        task.add_done_callback(self._brokering.discard)

    # -- DNS -----------------------------------------------------------------------------------

    def dns_query(self, transport: asyncio.DatagramTransport, data: bytes, addr: tuple[str, int]) -> None:
        self.counters["dnsQueries"] += 1
        if self._dns_inflight >= MAX_DNS_INFLIGHT:
            return
        try:
            query = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return
        if query.flags & dns.flags.QR or len(query.question) != 1:
            return
        self._dns_inflight += 1
        task = asyncio.get_running_loop().create_task(self._answer(transport, query, addr))
        task.add_done_callback(lambda _t: self._dns_done())

    def _dns_done(self) -> None:
        self._dns_inflight -= 1

    async def _answer(
        self, transport: asyncio.DatagramTransport, query: dns.message.Message, addr: Any
    ) -> None:
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        resp = dns.message.make_response(query)
        resp.flags |= dns.flags.RA
        if q.rdclass != dns.rdataclass.IN:
            resp.set_rcode(dns.rcode.REFUSED)
        else:
            rcode, address = await self._resolve_for_guest(name, q.rdtype)
            resp.set_rcode(rcode)
            if address is not None:
                resp.answer.append(
                    dns.rrset.from_text(q.name, DNS_TTL_S, dns.rdataclass.IN, dns.rdatatype.A, str(address))
                )
        with contextlib.suppress(OSError):
            transport.sendto(resp.to_wire(), addr)

    async def _resolve_for_guest(
        self, name: str, rdtype: int
    ) -> tuple[dns.rcode.Rcode, ipaddress.IPv4Address | None]:
        ok, rule = self.policy.name_allowed(name)
        if not ok:
            if rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                self.denied(name=name, address=None, port=None, rule=rule)
            return (dns.rcode.REFUSED if self.policy.mode == "none" else dns.rcode.NXDOMAIN), None
        found = await self.gw.resolver.lookup(name, self.lookup_slots)
        if not found.addresses:
            return found.rcode, None  # NXDOMAIN, or SERVFAIL when no server answered in time
        addrs = list(found.addresses)
        if not any(self.gw.guard.permits(a, None) for a in addrs):
            # An allowed name pointing only at internal addresses (DNS rebinding).
            if rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                self.denied(name=name, address=str(addrs[0]), port=None, rule=INTERNAL_RULE)
            return dns.rcode.REFUSED, None
        if rdtype != dns.rdatatype.A:
            return dns.rcode.NOERROR, None  # the guest has no IPv6; other types: no data
        return dns.rcode.NOERROR, self.table.address(name)

    # -- live changes ----------------------------------------------------------------------

    def apply_policy(self, policy: Policy) -> int:
        """New connections follow ``policy`` at once; open ones it refuses are reset."""
        self.policy = policy
        closed = 0
        for conn in list(self.conns.values()):
            if conn.state != "open" or conn.upstream_addr is None:
                continue
            addr = ipaddress.ip_address(conn.upstream_addr[0])
            verdict = policy.decide(conn.name, [addr], conn.upstream_addr[1])
            if not verdict.allowed:
                self.denied(name=conn.name, address=str(addr), port=conn.upstream_addr[1], rule=verdict.rule)
                conn.reset()
                closed += 1
        return closed

    # -- waiting I/O (live pause) ------------------------------------------------------

    def _waiting_changed(self, conn: Connection, waiting: bool) -> None:
        was = bool(self.waiting_ids)
        if waiting:
            self.waiting_ids.add(conn.id)
        else:
            self.waiting_ids.discard(conn.id)
        if waiting and not was and self.wait is not None and not self.held:
            self.gw.emit({"ev": "waiting", "vmId": self.vm_id})

    def _held_event(self, conn: Connection, what: str) -> None:
        """Data (or an end) reached a held connection: is it ready for the guest, by the
        VM's deliver rule? Told to the node once per hold."""
        if not self.held or self.ready is not None:
            return
        deliver = (self.wait or {}).get("deliver", "first-byte")
        if what in ("eof", "closed"):
            self._ready("closed" if deliver == "first-byte" else "complete")
        elif deliver != "complete":
            self._ready("first-byte")
        elif what == "full":
            self._ready("cap")
        else:  # complete: ready once no byte came for a moment
            if self._quiet is not None:
                self._quiet.cancel()
            self._quiet = asyncio.get_running_loop().call_later(COMPLETE_QUIET_S, self._ready, "complete")

    def _ready(self, reason: str) -> None:
        if not self.held or self.ready is not None:
            return
        self.ready = reason
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        self.gw.emit({"ev": "ready", "vmId": self.vm_id, "reason": reason, "buffered": self.buffered()})

    def buffered(self) -> int:
        return sum(c.buffered for c in self.conns.values())

    def hold(self, if_waiting: bool) -> dict[str, Any]:
        """Stop delivering to the guest (its vCPUs are about to stop). With ``if_waiting``
        only if a connection waits on its upstream (atomic here: no byte can slip in
        between the check and the hold)."""
        waiting = sum(1 for c in self.conns.values() if c.waiting)
        if if_waiting and not waiting:
            return {"held": False, "waiting": 0}
        if not self.held:  # holding again (a restarted node) keeps what is already ready
            self.held, self.ready = True, None
        for c in self.conns.values():
            c.hold()
        return {"held": True, "waiting": waiting}

    def release(self) -> dict[str, Any]:
        """Deliver everything held; returns the bytes that were buffered."""
        self.held, self.ready = False, None
        if self._quiet is not None:
            self._quiet.cancel()
            self._quiet = None
        n = sum(c.release() for c in list(self.conns.values()))
        return {"buffered": n}

    def wait_state(self) -> dict[str, Any]:
        return {
            "held": self.held,
            "ready": self.ready,
            "waiting": sum(1 for c in self.conns.values() if c.waiting),
            "buffered": self.buffered(),
        }

    def close(self) -> None:
        for task in list(self._brokering):
            task.cancel()
        if self._quiet is not None:
            self._quiet.cancel()
        for server in self.servers:
            server.close()
        for conn in list(self.conns.values()):
            conn.reset()
        self.buffer.close()
        self.fds.close()
        self.gw.events.vm_closed(self.vm_id)


class _DnsSide(asyncio.DatagramProtocol):
    def __init__(self, vm: VmGateway) -> None:
        self.vm = vm
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.vm.dns_query(self.transport, data, addr)

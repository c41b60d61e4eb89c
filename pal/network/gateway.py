"""The egress gateway: one process per node, `python -m pal.network.gateway`.

It runs as its own unprivileged uid (it needs no privilege: the node creates each VM's
listener and DNS socket inside the VM's namespace and hands them over as descriptors), in
its own process so that a flood or a fat download never slows the API's event loop. The
node starts and supervises it and talks to it over a root-only unix socket (control.py).

Per VM (:class:`VmGateway`): the compiled policy, the synthetic DNS table, counters, the
open connections, rate-limited ``egress_denied`` events, and the waiting I/O of a
live-paused guest: while the node holds a VM, upstream data is buffered (bounded, then
TCP backpressure), and a node that asked to ``watch`` is told when a VM with wait
management starts waiting on an upstream (``waiting``) and when a held VM has data ready
for its guest (``ready``, by the VM's ``deliver`` rule). Every guest TCP connection is
accepted here (nftables in the VM's namespace redirects it), its destination read with
SO_ORIGINAL_DST, its name taken from the synthetic address it went to or from the first
bytes (TLS SNI / HTTP Host), decided, and relayed to addresses the gateway resolved itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import resource
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from pal.config import NetBudgets, env_log_level, parse_nameservers
from pal.network import broker, lookups, namecheck, sniff
from pal.network.broker import EGRESS_DENIED
from pal.network.budgets import (
    FDS_PER_CONNECTION,
    VM_BYTES_FLOOR,
    VM_FD_FLOOR,
    Account,
    Pool,
    node_descriptors,
)
from pal.network.events import Events
from pal.network.hostaddrs import host_addresses
from pal.network.lookups import Resolver
from pal.network.names import NameTable, is_synthetic
from pal.network.policy import INTERNAL_RULE, Address, InternalGuard, Policy, parse_static_names
from pal.network.relay import READ_LIMIT, Connection, GuestSide, TokenBucket, UpstreamSide, reset
from pal.spec import DEFAULT_HOLD_BUFFER, DEFAULT_MAX_CONNECTIONS, egress_from_json

log = logging.getLogger("pal.gateway")

SO_ORIGINAL_DST = 80
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
ORPHAN_EXIT_S = 15.0  # no node connected and no VM: exit
# deliver "complete": a response counts as complete once the upstream closed, the buffer
# is full, or no byte came for this long after the last one (keep-alive responses).
COMPLETE_QUIET_S = 0.2
HOST_ADDR_REFRESH_S = 30.0


class VmGateway:
    """Everything the gateway knows about one VM (one incarnation of it)."""

    def __init__(
        self,
        gw: Gateway,
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


class Gateway:
    def __init__(self) -> None:
        self.vms: dict[str, VmGateway] = {}
        self.events = Events()
        self.resolver = Resolver()
        # The node's totals (budgets.py): buffered bytes and connection descriptors.
        self.max_buffer = DEFAULT_HOLD_BUFFER  # PAL_MAX_BUFFER_BYTES: of a VM without a wait rule
        self.buffer_pool = Pool(NetBudgets.node_buffer_bytes)
        self.fd_pool = Pool(node_descriptors())
        self.guard = InternalGuard()
        self.tls = broker.Tls()
        self._allow_internal: list[str] = []
        self._api_addresses: list[Address] = []
        self._conn_ids = 0
        self.clients = 0
        self._idle_since = time.monotonic()
        self.sinks: set[ControlConnection] = set()  # node connections that asked to watch

    def emit(self, ev: dict[str, Any]) -> None:
        """Tell every watching node (``watch``) about ``ev`` (never blocks the relay)."""
        for sink in list(self.sinks):
            sink.push(ev)

    def next_id(self) -> int:
        self._conn_ids += 1
        return self._conn_ids

    def configure(
        self,
        resolve: str | None,
        allow_internal: list[str],
        api_addresses: Sequence[str] = (),
        host_dns: bool = True,
        budgets: dict[str, Any] | None = None,
    ) -> None:
        b = budgets or {}
        self.resolver.configure(
            parse_static_names(resolve), host_dns, parse_nameservers(b.get("nameservers"))
        )
        self.buffer_pool.resize(int(b.get("nodeBufferBytes") or NetBudgets.node_buffer_bytes))
        self.fd_pool.resize(node_descriptors(b.get("nodeConnections")))
        self.max_buffer = int(b.get("maxBufferBytes") or DEFAULT_HOLD_BUFFER)
        self._allow_internal = list(allow_internal)
        self._api_addresses = [ipaddress.ip_address(a) for a in api_addresses]
        self.refresh_host_addresses()

    def refresh_host_addresses(self) -> None:
        """Internal besides the ranges: this host's addresses and the control plane's (the
        Pal API, which in a cluster may run on another machine at a public address)."""
        self.guard = InternalGuard(self._allow_internal, [*host_addresses(), *self._api_addresses])

    async def register(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        vm_id = str(msg["vmId"])
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise ValueError("register needs the listener and DNS socket descriptors")
        listener = socket.socket(fileno=fds[0])
        dns_sock = socket.socket(fileno=fds[1])
        old = self.vms.pop(vm_id, None)
        if old is not None:
            old.close()
        policy = Policy(egress_from_json(msg["egress"]))
        table = NameTable.from_json(msg.get("names"))
        rules = broker.Rules(msg.get("brokered"))
        ca = msg.get("ca") if isinstance(msg.get("ca"), dict) else None
        self.events.vm_registered(vm_id)
        vm = VmGateway(self, vm_id, policy, dict(msg.get("limits") or {}), table, rules, ca)
        vm.set_wait(msg.get("wait"))
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        dns_sock.setblocking(False)
        server = await loop.create_server(lambda: GuestSide(vm.accepted), sock=listener)
        transport, _ = await loop.create_datagram_endpoint(lambda: _DnsSide(vm), sock=dns_sock)
        vm.servers = [server, transport]
        self.vms[vm_id] = vm
        return {"vmId": vm_id}

    def vm(self, msg: dict[str, Any]) -> VmGateway:
        vm = self.vms.get(str(msg.get("vmId")))
        if vm is None:
            raise KeyError(f"VM {msg.get('vmId')} is not registered")
        return vm

    async def handle(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "ping":
            return {"pid": os.getpid(), "vms": sorted(self.vms)}
        if op == "configure":
            self.configure(
                msg.get("resolve"),
                list(msg.get("allowInternal") or []),
                list(msg.get("apiAddresses") or []),
                host_dns=msg.get("hostDns") is not False,
                budgets=msg.get("budgets") if isinstance(msg.get("budgets"), dict) else None,
            )
            self.tls.configure(msg.get("caBundle") or None)
            return {}
        if op == "register":
            return await self.register(msg, fds)
        for fd in fds:  # only register takes descriptors
            os.close(fd)
        if op == "unregister":
            vm = self.vms.pop(str(msg.get("vmId")), None)
            if vm is None:
                return {"counters": None, "names": None}
            vm.close()
            return {"counters": vm.snapshot_counters(), "names": vm.table.to_json()}
        if op == "policy":
            vm = self.vm(msg)
            closed = vm.apply_policy(Policy(egress_from_json(msg["egress"])))
            if "limits" in msg:
                vm.set_limits(dict(msg["limits"] or {}))
            return {"closed": closed}
        if op == "brokered":
            # In place: open brokered connections use the new values from their next request.
            vm = self.vm(msg)
            vm.rules.rules = broker.Rules(msg.get("brokered")).rules
            return {"rules": len(vm.rules.rules)}
        if op == "names":
            return {"names": self.vm(msg).table.to_json()}
        if op == "stats":
            if msg.get("vmId"):
                return {"counters": self.vm(msg).snapshot_counters()}
            return {"counters": {vid: vm.snapshot_counters() for vid, vm in self.vms.items()}}
        if op == "events":
            ev = self.events
            after = int(msg.get("after") or 0) if msg.get("epoch") == ev.epoch else 0
            return {"events": ev.since(after), "seq": ev.seq, "epoch": ev.epoch}
        if op == "timings":
            return {"setupMs": list(self.vm(msg).setup_ms)}
        if op == "conns":
            return {"conns": [c.info() for c in self.vm(msg).conns.values()]}
        if op == "hold":
            return {"conns": len(self.vm(msg).conns), **self.vm(msg).hold(bool(msg.get("ifWaiting")))}
        if op == "release":
            return {"conns": len(self.vm(msg).conns), **self.vm(msg).release()}
        if op == "wait":  # the VM's wait management rule (null: not watched)
            self.vm(msg).set_wait(msg.get("wait"))
            return {}
        if op == "waitState":
            if msg.get("vmId"):
                return {"state": self.vm(msg).wait_state()}
            return {"states": {vid: vm.wait_state() for vid, vm in self.vms.items()}}
        if op == "sync":
            keep = set(msg.get("vmIds") or [])
            for vid in [v for v in self.vms if v not in keep]:
                self.vms.pop(vid).close()
            return {"vms": sorted(self.vms)}
        if op == "shutdown":
            asyncio.get_running_loop().call_soon(_stop_loop)
            return {}
        raise ValueError(f"unknown op {op!r}")


class _DnsSide(asyncio.DatagramProtocol):
    def __init__(self, vm: VmGateway) -> None:
        self.vm = vm
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.vm.dns_query(self.transport, data, addr)


# ------------------------------------------------------------------------------ control socket

MAX_CONTROL_LINE = 8 * 1024 * 1024


class ControlConnection:
    """One node connection: JSON lines; descriptors ride along with the bytes (SCM_RIGHTS)
    and are matched to requests in order (a request says how many it carries)."""

    def __init__(self, gw: Gateway, sock: socket.socket) -> None:
        self.gw = gw
        self.sock = sock
        self.buf = bytearray()
        self.fds: deque[int] = deque()
        self._out: asyncio.Queue[bytes] | None = None  # a watching node's events
        self._writer: asyncio.Task[None] | None = None

    MAX_QUEUED = 10_000  # events for a watching node that does not read: then it is dropped

    def push(self, ev: dict[str, Any]) -> None:
        if self._out is None:
            return
        if self._out.qsize() >= self.MAX_QUEUED:
            log.warning("a watching node does not read its events; dropping it")
            self.gw.sinks.discard(self)
            self.sock.shutdown(socket.SHUT_RDWR)
            return
        self._out.put_nowait(json.dumps({"event": ev}).encode() + b"\n")

    async def _write_events(self) -> None:
        assert self._out is not None
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            while True:
                await loop.sock_sendall(self.sock, await self._out.get())

    def watch(self) -> None:
        """From now on this connection carries events to the node (``{"event": ...}``
        lines after the reply to ``watch``); the node sends nothing more on it."""
        self._out = asyncio.Queue()
        self.gw.sinks.add(self)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        readable = asyncio.Event()
        loop.add_reader(self.sock.fileno(), readable.set)
        self.gw.clients += 1
        try:
            while True:
                await readable.wait()
                readable.clear()
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 16)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                self.fds.extend(fds)
                if not data:
                    return
                self.buf += data
                if len(self.buf) > MAX_CONTROL_LINE:
                    return
                while (i := self.buf.find(b"\n")) >= 0:
                    line = bytes(self.buf[:i])
                    del self.buf[: i + 1]
                    await self._one(line)
        finally:
            self.gw.sinks.discard(self)
            if self._writer is not None:
                self._writer.cancel()
            loop.remove_reader(self.sock.fileno())
            self.sock.close()
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.gw.clients -= 1
            self.gw._idle_since = time.monotonic()

    async def _one(self, line: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            msg = json.loads(line)
            nfds = int(msg.get("nfds") or 0)
            if nfds > len(self.fds):
                raise ValueError(f"request announced {nfds} descriptors, {len(self.fds)} arrived")
            fds = [self.fds.popleft() for _ in range(nfds)]
            if msg.get("op") == "watch":
                reply: dict[str, Any] = {"ok": True}
                await loop.sock_sendall(self.sock, json.dumps(reply).encode() + b"\n")
                self.watch()
                self._writer = loop.create_task(self._write_events())
                return
            reply = {"ok": True, **(await self.gw.handle(msg, fds))}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        await loop.sock_sendall(self.sock, json.dumps(reply).encode() + b"\n")


_STOP: Callable[[], None] | None = None


def _stop_loop() -> None:
    if _STOP is not None:
        _STOP()


async def serve(control: socket.socket) -> None:
    global _STOP
    gw = Gateway()
    gw.configure(None, [])
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    _STOP = done.set
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    control.setblocking(False)
    tasks: set[asyncio.Task[None]] = set()

    async def accept_loop() -> None:
        while True:
            conn, _ = await loop.sock_accept(control)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != 0:  # the node runs as root; nobody else may steer the gateway
                conn.close()
                continue
            t = loop.create_task(ControlConnection(gw, conn).serve())
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def housekeeping() -> None:
        while True:
            await asyncio.sleep(HOST_ADDR_REFRESH_S / 6)
            if gw.clients == 0 and not gw.vms and time.monotonic() - gw._idle_since > ORPHAN_EXIT_S:
                log.info("no node and no VM for %.0f s: exiting", ORPHAN_EXIT_S)
                done.set()
            with contextlib.suppress(OSError):
                gw.refresh_host_addresses()

    bg = [loop.create_task(accept_loop()), loop.create_task(housekeeping())]
    await done.wait()
    for t in bg:
        t.cancel()
    for vm in list(gw.vms.values()):
        vm.close()


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _warm_up() -> None:
    """Run every code path once before dropping privileges: Python imports lazily, and
    after the drop the code (a pyenv under /root, say) may no longer be readable."""
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.HTTPS, dns.rdatatype.TXT):
        q = dns.message.make_query("warm.test", rdtype, use_edns=0)
        dns.message.from_wire(q.to_wire())
        r = dns.message.make_response(q)
        r.set_rcode(dns.rcode.NXDOMAIN)
        dns.message.from_wire(r.to_wire())
    gw = Gateway()
    gw.configure("warm.test=127.0.0.1", ["127.0.0.1"])
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


def drop_privileges(uid: int) -> None:
    """For good: no groups, the gateway's uid and gid, no way back (no_new_privs)."""
    if os.getuid() != 0:
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    pr_set_no_new_privs = 38
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_no_new_privs, 1, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pal.network.gateway")
    ap.add_argument("--control-fd", type=int, required=True, help="listening unix socket (inherited)")
    ap.add_argument("--node", default="", help="the node's data dir (identifies the process)")
    ap.add_argument("--uid", type=int, default=None, help="drop to this uid/gid after start-up")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=env_log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _raise_nofile()
    asyncio.run(_warm_up())
    if args.uid is not None:
        drop_privileges(args.uid)
    control = socket.socket(fileno=args.control_fd)
    log.info("egress gateway up (pid %d, uid %d) for %s", os.getpid(), os.getuid(), args.node)
    asyncio.run(serve(control))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

from pal.config import NetBudgets, env_log_level, parse_nameservers
from pal.network import broker, resvport
from pal.network.budgets import (
    Pool,
    node_descriptors,
)
from pal.network.events import Events
from pal.network.gateway_warmup import warm_up
from pal.network.hostaddrs import host_addresses
from pal.network.lookups import Resolver
from pal.network.names import NameTable
from pal.network.policy import Address, InternalGuard, Policy, parse_static_names
from pal.network.relay import GuestSide
from pal.network.vm_gateway import VmGateway, _DnsSide
from pal.spec import DEFAULT_HOLD_BUFFER, egress_from_json

log = logging.getLogger("pal.gateway")

ORPHAN_EXIT_S = 15.0  # no node connected and no VM: exit
HOST_ADDR_REFRESH_S = 30.0


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
        # The node's volume server (pal/manager/volume_server.py): guest port -> its port
        # on 127.0.0.1; empty until the node starts one.
        self.volume_ports: dict[int, int] = {}

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
        source = msg.get("volumeSource")
        vm.volume_source = source if isinstance(source, str) and source.startswith("127.") else None
        for other in self.vms.values():  # one VM per source address, ever (a VM a node
            if other.volume_source == vm.volume_source:  # restart adopted keeps none)
                other.volume_source = None
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        dns_sock.setblocking(False)
        server = await loop.create_server(lambda: GuestSide(vm.accepted), sock=listener)
        transport, _ = await loop.create_datagram_endpoint(lambda: _DnsSide(vm), sock=dns_sock)
        vm.servers = [server, transport]
        self.vms[vm_id] = vm
        return {"vmId": vm_id}

    def set_volume_ports(self, raw: Any) -> None:
        """``{guest port: server port}`` of the node's volume server (None: none runs)."""
        if isinstance(raw, dict):
            self.volume_ports = {int(k): int(v) for k, v in raw.items()}

    def vm(self, msg: dict[str, Any]) -> VmGateway:
        vm = self.vms.get(str(msg.get("vmId")))
        if vm is None:
            raise KeyError(f"VM {msg.get('vmId')} is not registered")
        return vm

    async def handle(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "ping":
            sources = {v.vm_id: v.volume_source for v in self.vms.values() if v.volume_source}
            return {"pid": os.getpid(), "vms": sorted(self.vms), "volumeSources": sources}
        if op == "configure":
            self.configure(
                msg.get("resolve"),
                list(msg.get("allowInternal") or []),
                list(msg.get("apiAddresses") or []),
                host_dns=msg.get("hostDns") is not False,
                budgets=msg.get("budgets") if isinstance(msg.get("budgets"), dict) else None,
            )
            self.tls.configure(msg.get("caBundle") or None)
            self.set_volume_ports(msg.get("volumePorts"))
            return {}
        if op == "volumeServer":
            self.set_volume_ports(msg.get("ports"))
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


def drop_privileges(uid: int) -> None:
    """For good: no groups, the gateway's uid and gid, no way back (no_new_privs). It keeps
    one capability, CAP_NET_BIND_SERVICE: its connections to the node's volume server come
    from a port below 1024, which the server's exports require (resvport.py)."""
    if os.getuid() != 0:
        return
    resvport.setuid_keeping_bind_service(uid)
    pr_set_no_new_privs = 38
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_no_new_privs, 1, 0, 0, 0)


def _warm_gateway() -> Gateway:
    gw = Gateway()
    gw.configure("warm.test=127.0.0.1", ["127.0.0.1"])
    return gw


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
    asyncio.run(warm_up(_warm_gateway))
    if args.uid is not None:
        drop_privileges(args.uid)
    control = socket.socket(fileno=args.control_fd)
    log.info("egress gateway up (pid %d, uid %d) for %s", os.getpid(), os.getuid(), args.node)
    asyncio.run(serve(control))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The runtime manager's side of each VM's network: its namespace, its tap for QEMU, its
registration with the node's egress gateway, and what a snapshot keeps of it (net.json).

Order on spawn: namespace (tap + rules + gateway sockets, ~2-5 ms, made in a thread while
the disk is cloned) -> register with the gateway (policy, limits, the DNS table the guest
may have cached) -> QEMU starts with the tap descriptor -> the guest takes a new MAC on
`identify`. Each incarnation gets a fresh namespace and gateway state; the DNS table is the
only thing carried over (from the snapshot the guest memory comes from).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal import keyfile
from pal.config import Settings
from pal.errors import NotFound, Unavailable
from pal.images.paths import ImagePaths
from pal.manager.volume_server import SOURCE_PREFIX, VolumeServer
from pal.manager.volumes import VolumeFiles
from pal.network import netns
from pal.network.control import GatewayProcess
from pal.secretbox import SecretBox
from pal.snapshots.layout import NET_ARTIFACT
from pal.spec import Egress, WaitPause, egress_to_json
from pal.wire.models import SpawnRequest, VolumeMount

log = logging.getLogger(__name__)
GUEST_NFS_PORT, GUEST_MOUNT_PORT = 2049, 20048  # what the guest connects to (pal/guest/volumes.py)


@dataclass
class Brokered:
    """A VM's brokered secrets as the gateway takes them, and its tenant's CA."""

    rules: list[dict[str, Any]] = field(default_factory=list)
    ca: dict[str, str] | None = None  # {"cert", "key"} PEM


def control_plane_addresses(urls: list[str]) -> list[str]:
    """The addresses of the control plane's hosts (``PAL_SERVERS``): the Pal API is an
    internal destination for guests wherever it runs (a name that does not resolve now
    is skipped; the private ranges and this host's addresses are internal anyway)."""
    out: set[str] = set()
    for url in urls:
        host = urllib.parse.urlsplit(url).hostname
        if not host:
            continue
        with contextlib.suppress(OSError, UnicodeError):
            for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP):
                out.add(str(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])))
    return sorted(out)


def limits_json(egress_mbps: int | None, max_connections: int | None) -> dict[str, Any]:
    return {"egressMbps": egress_mbps, "maxConnections": max_connections}


def wait_rule(wait: WaitPause | None) -> dict[str, Any] | None:
    """The gateway's part of a VM's wait management (None: the gateway does not watch it)."""
    if wait is None:
        return None
    return {"deliver": wait.deliver, "maxBufferBytes": wait.max_buffer_bytes}


def read_names(snapshot_dir: Path | None) -> list[Any]:
    """The DNS table saved with a snapshot (empty for templates and old snapshots)."""
    if snapshot_dir is None:
        return []
    try:
        raw = json.loads((snapshot_dir / NET_ARTIFACT).read_text())
    except (OSError, ValueError):
        return []
    names = raw.get("names") if isinstance(raw, dict) else None
    return names if isinstance(names, list) else []


def _read_bundle(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise Unavailable(f"PAL_EGRESS_CA_BUNDLE {path} cannot be read: {exc}") from exc


class VmNetworking:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tag = netns.node_tag(settings.data_dir)
        self._bytes: dict[str, tuple[int, int]] = {}
        self._box: SecretBox | None = None
        self.volumes = VolumeServer(settings.data_dir / "run")
        self.volume_files = VolumeFiles(settings.volumes_root)  # PAL_VOLUMES_DIR or the data dir's
        self._sources: dict[str, str] = {}  # VM id -> its source address toward the volume server
        self.gateway = GatewayProcess(
            settings.data_dir,
            resolve=settings.egress_resolve,
            host_dns=settings.egress_host_dns,
            allow_internal=settings.egress_allow_internal,
            ca_bundle=_read_bundle(settings.egress_ca_bundle),
            api_addresses=control_plane_addresses(settings.servers),
            budgets=settings.net_budgets.gateway_json(),
        )

    def ns_name(self, slot: str) -> str:
        """A VM's namespace is named by its slot (slots.py), the gateway's state by its id."""
        return netns.ns_name(self.tag, slot)

    # -- a VM's brokered secrets at rest (its state.json, for adoption after a restart) ---------

    @property
    def box(self) -> SecretBox:
        if self._box is None:  # made on first use: nodes without brokered secrets need no key
            self._box = SecretBox(keyfile.load_or_create(self.settings.secrets_key_path))
        return self._box

    def seal_brokered(self, vm_id: str, b: Brokered) -> str | None:
        """The real values and the tenant CA's key, sealed under the host's secrets key and
        bound to the VM (never in clear on disk)."""
        if not b.rules and b.ca is None:
            return None
        return self.box.seal(json.dumps({"rules": b.rules, "ca": b.ca}), vm_id)

    def open_brokered(self, vm_id: str, sealed: object, clear_ca: object = None) -> Brokered:
        """What :meth:`seal_brokered` wrote (or, from an older Pal, the rules and CA in clear)."""
        if sealed is None:
            return Brokered()
        if isinstance(sealed, list):
            return Brokered(list(sealed), clear_ca if isinstance(clear_ca, dict) else None)
        got = json.loads(self.box.open(str(sealed), vm_id))
        return Brokered(list(got.get("rules") or []), got.get("ca"))

    @staticmethod
    def new_mac() -> str:
        return netns.guest_mac(secrets.token_bytes(16))

    async def create(self, slot: str) -> netns.VmNetns:
        name = self.ns_name(slot)
        if netns.exists(name):  # left by a VM of this slot that died with a previous node
            await asyncio.to_thread(netns.delete, name)
        return await asyncio.to_thread(netns.create, name)

    async def register(
        self,
        vm_id: str,
        sockets: tuple[int, int],
        egress: Egress,
        limits: dict[str, Any],
        names: list[Any],
        brokered: Brokered | None = None,
        wait: dict[str, Any] | None = None,
    ) -> None:
        msg: dict[str, Any] = {
            "op": "register",
            "vmId": vm_id,
            "egress": egress_to_json(egress),
            "limits": limits,
            "names": names,
            "wait": wait,
            "volumeSource": self.source_of(vm_id),
        }
        if brokered is not None and brokered.rules:
            msg["brokered"] = brokered.rules
            msg["ca"] = brokered.ca
        await self.gateway.call(msg, list(sockets))

    async def reregister(
        self,
        vm_id: str,
        slot: str,
        egress: Egress,
        limits: dict[str, Any],
        brokered: Brokered | None = None,
        wait: dict[str, Any] | None = None,
        *,
        names: list[Any] | None = None,
        new_guest: bool = False,
    ) -> None:
        """New gateway sockets in the VM's existing namespace: after the gateway restarted
        (its DNS table is lost with it), or for a parked QEMU that continues as a new
        incarnation (``names``: its snapshot's table; ``new_guest``: its NIC takes a new
        MAC, so the namespace forgets the old one's neighbour entry)."""
        name = self.ns_name(slot)
        if new_guest:
            await asyncio.to_thread(netns.forget_neighbours, name)
        listener, dns = await asyncio.to_thread(netns.gateway_sockets, name)
        try:
            await self.register(
                vm_id, (listener.fileno(), dns.fileno()), egress, limits, names or [], brokered, wait
            )
        finally:
            listener.close()
            dns.close()

    async def unregister(self, vm_id: str) -> dict[str, Any] | None:
        """Drop the VM's gateway state (its connections reset), keep its namespace and
        tap (a parked QEMU holds them); the final counters."""
        try:
            reply = await self.gateway.call({"op": "unregister", "vmId": vm_id})
            return reply.get("counters")
        except Exception as exc:
            log.warning("gateway unregister of %s failed: %s", vm_id, exc)
            return None

    # -- waiting I/O (live pause, docs/live-pause.md) ---------------------------------------

    async def hold(self, vm_id: str, *, if_waiting: bool = False) -> dict[str, Any]:
        """Stop delivering to the VM's guest (its upstream is still read into a bounded
        buffer). With ``if_waiting``: only if one of its connections waits on an upstream;
        ``{"held": bool, "waiting": n}``."""
        return await self.gateway.call({"op": "hold", "vmId": vm_id, "ifWaiting": if_waiting})

    async def deliver(self, vm_id: str) -> int:
        """Deliver what the gateway held for the VM; the bytes that were buffered."""
        reply = await self.gateway.call({"op": "release", "vmId": vm_id})
        return int(reply.get("buffered") or 0)

    async def wait_state(self, vm_id: str | None = None) -> dict[str, Any]:
        """``{held, ready, waiting, buffered}`` of one VM, or ``{vm id: that}`` of all."""
        msg: dict[str, Any] = {"op": "waitState"}
        if vm_id is not None:
            msg["vmId"] = vm_id
            return dict((await self.gateway.call(msg)).get("state") or {})
        return dict((await self.gateway.call(msg)).get("states") or {})

    # -- volumes (docs/volumes.md) ---------------------------------------------------------------

    def source_of(self, vm_id: str) -> str:
        """The VM's own loopback address toward the volume server (kept while it lives)."""
        addr = self._sources.get(vm_id)
        if addr is None:
            used = set(self._sources.values())
            addr = next(
                f"{SOURCE_PREFIX}.{n >> 8}.{n & 255}" for n in range(1, 65534)
                if f"{SOURCE_PREFIX}.{n >> 8}.{n & 255}" not in used
            )  # fmt: skip
            self._sources[vm_id] = addr
        return addr

    def rekey_source(self, old_vm_id: str, new_vm_id: str) -> None:
        """A pooled VM claimed under a tenant's id keeps its address (it mounted nothing)."""
        if old_vm_id in self._sources:
            self._sources[new_vm_id] = self._sources.pop(old_vm_id)

    async def mount_volumes(self, req: SpawnRequest, image: ImagePaths) -> dict[str, float]:
        """:meth:`export_volumes` for a spawn; the milliseconds it took (a step of the
        spawn's timings: ``volumes_export_ms``), nothing when the VM mounts nothing."""
        t0 = time.perf_counter()
        await self.export_volumes(req.vm_id, req.volumes, image)
        return {"volumes_export_ms": round((time.perf_counter() - t0) * 1000, 1)} if req.volumes else {}

    async def export_volumes(self, vm_id: str, volumes: list[VolumeMount], image: ImagePaths) -> None:
        """The VM's volumes (``req.volumes``) exported to it before its guest mounts them
        (identify); each volume's ``data/`` made the image's workload user's (All_Squash
        writes as that user)."""
        cfg = image.config
        mounts = []
        for v in volumes:
            data = self.settings.volumes_root / v.volume_id / "data"
            try:
                st = await asyncio.to_thread(data.stat)
            except FileNotFoundError:
                raise NotFound(f"volume {v.volume_id} is not on this node") from None
            if (st.st_uid, st.st_gid) != (cfg.uid, cfg.gid):
                await asyncio.to_thread(os.chown, data, cfg.uid, cfg.gid)
            export_id = await self.volume_files.export_id(v.volume_id)  # every node's the same
            mounts.append((v.volume_id, data, v.read_only, export_id))
        await self.attach_volumes(vm_id, mounts, cfg.uid, cfg.gid)

    async def attach_volumes(
        self, vm_id: str, mounts: list[tuple[str, Path, bool, int]], uid: int, gid: int
    ) -> None:
        """Before the guest mounts: the server exports each volume to this VM (and no
        longer anything it does not mount), and the gateway knows where the server is."""
        if not mounts:
            await self.volumes.detach(vm_id)
            return
        nfs, mnt = await self.volumes.attach(vm_id, self.source_of(vm_id), mounts, uid, gid)
        ports = {str(GUEST_NFS_PORT): nfs, str(GUEST_MOUNT_PORT): mnt}
        if self.gateway.volume_ports != ports:
            self.gateway.volume_ports = ports
            await self.gateway.call({"op": "volumeServer", "ports": ports})

    async def unexport(self, vm_id: str) -> None:
        """A VM that never reached the gateway (its spawn failed): off every export, its
        source address free again."""
        await self.volumes.detach(vm_id)
        self._sources.pop(vm_id, None)

    async def release(self, vm_id: str, slot: str) -> dict[str, Any] | None:
        """Unregister from the gateway and remove the namespace; the final counters."""
        await self.volumes.detach(vm_id)
        self._sources.pop(vm_id, None)
        counters = None
        try:
            reply = await self.gateway.call({"op": "unregister", "vmId": vm_id})
            counters = reply.get("counters")
        except Exception as exc:
            log.warning("gateway unregister of %s failed: %s", vm_id, exc)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(netns.delete, self.ns_name(slot))
        return counters

    async def set_brokered(self, vm_id: str, rules: list[dict[str, Any]]) -> None:
        """New values for a running VM's brokered secrets (rotation): its next request."""
        await self.gateway.call({"op": "brokered", "vmId": vm_id, "brokered": rules})

    async def save_names(self, vm_id: str, dest_dir: Path) -> None:
        """Write the guest's DNS table next to a snapshot's other artifacts."""
        reply = await self.gateway.call({"op": "names", "vmId": vm_id})
        (dest_dir / NET_ARTIFACT).write_text(json.dumps({"names": reply.get("names") or []}))

    async def set_policy(self, vm_id: str, egress: Egress, limits: dict[str, Any]) -> int:
        reply = await self.gateway.call(
            {"op": "policy", "vmId": vm_id, "egress": egress_to_json(egress), "limits": limits}
        )
        return int(reply.get("closed") or 0)

    async def counters(self, vm_id: str) -> dict[str, Any] | None:
        try:
            reply = await self.gateway.call({"op": "stats", "vmId": vm_id})
        except Exception:
            return None
        c = reply.get("counters")
        return dict(c) if isinstance(c, dict) else None

    async def refresh_counters(self) -> None:
        """Fetch every VM's byte counters at once, for :meth:`cached_bytes`."""
        try:
            reply = await self.gateway.call({"op": "stats"})
        except Exception:
            return
        counters = reply.get("counters") or {}
        self._bytes = {
            vm: (int(c.get("bytesIn", 0)), int(c.get("bytesOut", 0)))
            for vm, c in counters.items()
            if isinstance(c, dict)
        }

    def cached_bytes(self, vm_id: str) -> tuple[int, int] | None:
        """(received, sent) by the guest as of the last refresh; None if unknown."""
        return self._bytes.get(vm_id)

    async def events(self, after: int, epoch: str) -> dict[str, Any]:
        """Events newer than ``after`` of numbering ``epoch`` (all, if the epoch changed)."""
        reply = await self.gateway.call({"op": "events", "after": after, "epoch": epoch})
        return {k: reply.get(k) for k in ("events", "seq", "epoch")}

    async def registered(self) -> set[str]:
        reply = await self.gateway.call({"op": "ping"})
        sources = reply.get("volumeSources")
        for vm_id, source in sources.items() if isinstance(sources, dict) else ():
            self._sources.setdefault(str(vm_id), str(source))  # adopted VMs keep theirs
        return set(reply.get("vms") or [])

    async def sync(self, vm_ids: set[str], slots: set[str]) -> None:
        """Drop gateway state of VMs this node no longer has; remove the namespaces of
        slots no VM holds, and those of data dirs that were deleted (their nodes will
        never sweep them)."""
        await self.gateway.call({"op": "sync", "vmIds": sorted(vm_ids)})
        self._sources = {k: v for k, v in self._sources.items() if k in vm_ids}
        keep = {self.ns_name(s) for s in slots}
        gone = await asyncio.to_thread(netns.sweep, self.tag, keep)
        if gone:
            log.warning("removed %d network namespace(s) of VMs that are gone: %s", len(gone), gone)
        await asyncio.to_thread(netns.claim, self.tag, self.settings.data_dir)
        orphans = await asyncio.to_thread(netns.sweep_orphans)
        if orphans:
            log.warning("removed %d network namespace(s) of deleted data dirs: %s", len(orphans), orphans)

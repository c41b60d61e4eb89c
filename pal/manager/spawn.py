"""Spawn: a VM starts on this node, by cold boot, warm template, snapshot restore (a
resume or a fork), or by continuing its parked QEMU.

``Spawner.spawn`` reads as its steps. Each step records what it acquired in the
:class:`_Spawning` it is given, and ``_rollback`` (the one place that undoes a spawn)
releases exactly that, whatever step failed: the guest channel, the QEMU, the network
namespace and the gateway's state, the VM's dir, its uid, its fork memory mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal import failpoints
from pal.config import Settings
from pal.errors import Conflict, InsufficientStorage, NotFound, PalError
from pal.guest import protocol as p
from pal.images.paths import ImagePaths
from pal.manager import admission
from pal.manager.channel import HarnessChannel
from pal.manager.fork import ForkMemory
from pal.manager.identify import identify
from pal.manager.parked import Parking
from pal.manager.prestart import PrestartSet
from pal.manager.restore import BootSource, Restores, brokered_of, identity_of
from pal.manager.restore_gate import RestoreGate
from pal.manager.spawned import disk_limits, spawn_result
from pal.manager.vm import LiveVm, VmRegistry
from pal.manager.vmnet import VmNetworking, limits_json, read_names, wait_rule
from pal.network.netns import VmNetns
from pal.snapshots.layout import SnapshotRef
from pal.vmm import disks
from pal.vmm.errors import VmmError
from pal.vmm.jail import Jail
from pal.vmm.qemu import QemuVm, VmSpec
from pal.vmm.vmm_meta import read_vmm_meta
from pal.wire.models import SpawnRequest, SpawnResult

log = logging.getLogger(__name__)

COLD_BOOT_TIMEOUT_S = 120.0  # TCG boots take seconds; a loaded CI machine more


@dataclass(frozen=True)
class PoolHooks:
    """The warm pool's part in a spawn (pool.py): ``claim`` a pooled VM for a request (its
    result, or None to spawn as usual), ``evict`` pooled VMs to free MiB (how many it freed).
    The pool spawns its VMs through the spawner, so these reach it when called."""

    claim: Callable[[SpawnRequest], Awaitable[SpawnResult | None]]
    evict: Callable[[int], Awaitable[int]]


@dataclass
class SpawnDeps:
    """Exactly what a spawn needs of the node."""

    settings: Settings
    accel: str
    registry: VmRegistry
    net: VmNetworking
    jail: Jail
    forks: ForkMemory
    parking: Parking
    restores: Restores
    gate: RestoreGate
    pool: PoolHooks
    prestart: PrestartSet  # QEMUs waiting for a restore to take (prestart.py)


@dataclass
class _Spawning:
    """One spawn under way: what its steps acquired so far (``_rollback`` frees it)."""

    req: SpawnRequest
    slot: str  # what its host resources are named by (slots.py)
    vm_dir: Path
    t0: float = field(default_factory=time.perf_counter)
    src: BootSource | None = None
    vnet: VmNetns | None = None
    registered: bool = False  # the gateway knows the VM
    mem_ref: SnapshotRef | None = None  # a fork child: counted as mapping this snapshot
    disk: tuple[Path, str] | None = None  # (path, format)
    fork_mem: Path | None = None
    groups: tuple[int, ...] = ()
    qemu: QemuVm | None = None
    channel: HarnessChannel | None = None
    mac: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    pooled: bool = False  # made for the warm pool: kept out of the registry (pool.py)
    prestarted: bool = False  # its QEMU and slot were a pre-started QEMU's (prestart.py)
    lv: LiveVm | None = None
    exporting: asyncio.Task[dict[str, float]] | None = None  # its volumes' exports (vmnet.py)
    admission: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


class Spawner:
    def __init__(self, deps: SpawnDeps) -> None:
        self.d = deps

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        reg = self.d.registry
        if req.vm_id in reg.vms or req.vm_id in reg.spawning:
            raise Conflict(f"VM {req.vm_id} is already live on this node")
        what = f"VM {req.vm_id} ({req.memory_mib} MiB RAM)"
        # Before any work: its RAM file and disk must fit (a full disk SIGBUSes a guest).
        await self._admit_memory(req.memory_mib, what)
        unparked = await self._continue_parked(req)
        if unparked is not None:
            return unparked
        # A parked process of another snapshot of this VM (or too old) is in the way.
        await self.d.parking.discard(req.vm_id)
        reg.spawning.add(req.vm_id)
        try:
            claimed = await self.d.pool.claim(req)
        finally:
            reg.spawning.discard(req.vm_id)
        if claimed is not None:
            return claimed
        await asyncio.to_thread(admission.check_disk, self.d.settings.data_dir, req.memory_mib, what)
        return self._result(await self._build(req, pooled=False))

    async def _admit_memory(self, need_mib: int, what: str) -> None:
        """507 unless the host has the memory; parked QEMUs, then pooled VMs, go first."""
        try:
            await self.d.parking.admit_memory(need_mib, what)
        except InsufficientStorage:
            if not await self.d.pool.evict(need_mib):
                raise
            await self.d.parking.admit_memory(need_mib, what)

    async def spawn_pooled(self, req: SpawnRequest) -> LiveVm:
        """A VM for the warm pool (pool.py): spawned like any other, from the template of its
        size, but kept out of the registry (no heartbeat reports it, no call reaches it) and
        marked pooled in its state file (a restart kills it)."""
        reg = self.d.registry
        if req.vm_id in reg.vms or req.vm_id in reg.spawning:
            raise Conflict(f"VM {req.vm_id} is already live on this node")
        what = f"pooled VM {req.vm_id} ({req.memory_mib} MiB RAM)"
        await asyncio.to_thread(admission.check_memory, req.memory_mib, what)
        await asyncio.to_thread(admission.check_disk, self.d.settings.data_dir, req.memory_mib, what)
        s = await self._build(req, pooled=True)
        assert s.lv is not None
        return s.lv

    async def _build(self, req: SpawnRequest, *, pooled: bool) -> _Spawning:
        reg = self.d.registry
        reg.spawning.add(req.vm_id)
        slot = reg.slots.assign(req.vm_id)
        s = _Spawning(req, slot, reg.slot_dir(slot), pooled=pooled)
        pinned = contextlib.ExitStack()  # the template restored from, kept until done
        try:
            await self._admitted(s)
            s.src = await self.d.restores.source(req, pinned)
            self._export_volumes(s)
            if await self._take_prestarted(s):
                await self._load_prestarted(s)
            else:
                self._make_vm_dir(s)
                await self._disk_and_network(s)
                await self._register_network(s)
                await self._map_fork_memory(s)
                await self._start_qemu(s)
            await self._identify(s)
            self._enlist(s)
            return s
        except BaseException as exc:
            await self._rollback(s, exc)
            raise
        finally:
            pinned.close()
            await s.admission.aclose()
            reg.spawning.discard(req.vm_id)

    async def _admitted(self, s: _Spawning) -> None:
        """Wait for free CPU (restore_gate.py); the slot is held until the spawn ends."""
        t = time.perf_counter()
        await s.admission.enter_async_context(self.d.gate.admit())
        s.timings["admit_wait_ms"] = round((time.perf_counter() - t) * 1000, 1)
        s.t0 = time.perf_counter()  # the restore's own steps start now

    def _export_volumes(self, s: _Spawning) -> None:
        """The VM's volumes exported to it while its QEMU is made (measured: 1-5 ms of the
        spawn's serial path, and ganesha's reload, which a SIGHUP starts and does not wait
        for, is in force long before the guest's first MOUNT); awaited at identify."""
        if s.req.volumes:
            assert s.src is not None
            s.exporting = asyncio.create_task(self.d.net.mount_volumes(s.req, s.src.image))

    async def _continue_parked(self, req: SpawnRequest) -> SpawnResult | None:
        """A resume of the snapshot a parked QEMU of this VM holds: continue that one."""
        if req.restore is None or req.restore.mem_mode != "shared":
            return None
        parked = self.d.parking.take(req.vm_id, req.restore.snapshot_id)
        if parked is None:
            return None
        try:
            return await self.d.restores.unpark(parked, req)
        except Exception as exc:
            # Its snapshot is intact: restore it into a new QEMU as if never parked.
            log.warning("VM %s: parked QEMU could not continue (%s); restoring", req.vm_id, exc)
            await self.d.parking.park_failed(parked)
            return None

    def _make_vm_dir(self, s: _Spawning) -> None:
        """A fresh VM dir with its config drive (what the guest reads before identify)."""
        if s.vm_dir.exists():
            shutil.rmtree(s.vm_dir)
        s.vm_dir.mkdir(parents=True)
        req = s.req
        cfg = {
            "vm_id": req.vm_id,
            "incarnation": req.incarnation,
            "token": req.token,
            "env": req.env,
            "hb_interval": self.d.settings.heartbeat_interval_s,
        }
        (s.vm_dir / "config.img").write_bytes(p.encode_config(cfg))

    async def _disk_and_network(self, s: _Spawning) -> None:
        """The VM's own disk, cloned while its network namespace is made."""
        assert s.src is not None
        got_disk, got_net = await asyncio.gather(
            _disk_from(s.src.disk_src, s.src.image, s.vm_dir, s.req.disk_mib),
            self.d.net.create(s.slot),
            return_exceptions=True,
        )
        if not isinstance(got_net, BaseException):
            s.vnet = got_net
        for got in (got_disk, got_net):
            if isinstance(got, BaseException):
                raise got
        assert not isinstance(got_disk, BaseException)
        s.disk = got_disk

    async def _register_network(self, s: _Spawning) -> None:
        """The gateway takes the VM's sockets, policy, limits, secrets and wait rule (a
        restored VM keeps its snapshot's DNS names)."""
        assert s.vnet is not None and s.src is not None
        req = s.req
        await self.d.net.register(
            req.vm_id,
            (s.vnet.listener.fileno(), s.vnet.dns.fileno()),
            req.egress,
            limits_json(req.egress_mbps, req.max_connections),
            read_names(s.src.snap_dir),
            brokered_of(req),
            wait=wait_rule(req.wait_pause),
        )
        s.registered = True

    async def _map_fork_memory(self, s: _Spawning) -> None:
        """A fork child maps its source snapshot's memory privately (fork.py)."""
        assert s.src is not None
        restore = s.req.restore
        if restore is None or restore.mem_mode != "private":
            return
        assert s.src.snap_dir is not None and s.src.ref is not None
        if (s.src.snap_dir / "mem").exists():
            s.mem_ref = s.src.ref
            s.fork_mem, s.groups = await self.d.forks.map(s.src.ref, s.slot)

    def _vm_spec(self, s: _Spawning) -> VmSpec:
        assert s.src is not None and s.disk is not None and s.vnet is not None
        req = s.req
        return VmSpec(
            run_as=self.d.jail.identity(s.slot),
            groups=s.groups,
            cgroup_limits=self.d.settings.cgroups,
            seccomp=self.d.settings.seccomp,
            vm_id=req.vm_id,
            slot=s.slot,
            vm_dir=s.vm_dir,
            image=s.src.image,
            vcpus=req.vcpus,
            memory_mib=req.memory_mib,
            disk_path=s.disk[0],
            disk_format=s.disk[1],
            config_drive=s.vm_dir / "config.img",
            accel=self.d.accel,
            net_fd=s.vnet.tap_fd,
            disk_limits=disk_limits(req),
        )

    async def _start_qemu(self, s: _Spawning) -> None:
        assert s.src is not None and s.vnet is not None
        spec = self._vm_spec(s)
        s.timings["prepare_ms"] = round((time.perf_counter() - s.t0) * 1000, 1)
        if s.src.snap_dir is not None:
            assert s.req.restore is not None
            s.qemu = await QemuVm.restore(spec, s.src.snap_dir, s.req.restore.mem_mode, s.fork_mem)
        elif s.src.template is not None:
            s.qemu = await QemuVm.restore(spec, s.src.template, "shared")
        else:
            s.qemu = await QemuVm.boot(spec)
        failpoints.hit("manager:booted")  # QEMU runs; no state.json to adopt it by yet
        s.vnet.close_fds()  # QEMU holds the tap, the gateway its sockets
        s.timings.update({f"qemu_{k}_ms": round(v, 1) for k, v in s.qemu.timings_ms.items()})

    async def _take_prestarted(self, s: _Spawning) -> bool:
        """A restore into RAM of its own takes a pre-started QEMU its snapshot fits
        (prestart.py), if one waits: its slot is the VM's from now on (the fresh one, still
        empty, is given back). A fork child that maps its snapshot's fork memory never does:
        a pre-started QEMU mapped its RAM file when it started (prestart.py, "Forks")."""
        ps, src, req = self.d.prestart, s.src, s.req
        if src is None or src.snap_dir is None or req.restore is None:
            return False
        if req.restore.mem_mode != "shared":
            return False
        try:
            meta, rootfs = await asyncio.to_thread(_snapshot_shape, src.snap_dir)
        except (OSError, VmmError):
            return False  # the usual path reports what is wrong with the snapshot
        got = ps.take(req.memory_mib, req.vcpus, req.disk_mib, src.image, meta, rootfs)
        if got is None:
            return False
        reg = self.d.registry
        reg.slots.release(req.vm_id, s.slot)
        s.slot = reg.slots.rekey(got.prestart_id, req.vm_id)
        s.vm_dir = reg.slot_dir(s.slot)
        s.qemu, s.prestarted = got.qemu, True
        s.qemu.spec.vm_id = req.vm_id
        failpoints.hit("manager:prestart-taken")  # its state file still says prestarted
        return True

    async def _load_prestarted(self, s: _Spawning) -> None:
        """The VM on the gateway (fresh sockets in the slot's namespace) while the snapshot's
        disk and RAM are reflinked into the taken QEMU; then its device state loaded, its
        vCPUs run."""
        assert s.qemu is not None and s.src is not None and s.src.snap_dir is not None
        req = s.req
        registered, filled = await asyncio.gather(
            self.d.net.reregister(
                req.vm_id,
                s.slot,
                req.egress,
                limits_json(req.egress_mbps, req.max_connections),
                brokered_of(req),
                wait_rule(req.wait_pause),
                names=read_names(s.src.snap_dir),
            ),
            s.qemu.fill(s.src.snap_dir),
            return_exceptions=True,
        )
        s.registered = not isinstance(registered, BaseException)
        for got in (registered, filled):
            if isinstance(got, BaseException):
                raise got
        s.disk = (s.qemu.spec.disk_path, s.qemu.spec.disk_format)
        failpoints.hit("manager:prestart-filled")  # the snapshot's files in, nothing loaded
        s.timings["prepare_ms"] = round((time.perf_counter() - s.t0) * 1000, 1)
        await s.qemu.limit_disk(disk_limits(req))  # before its guest runs
        await s.qemu.load()
        failpoints.hit("manager:prestart-loaded")  # the guest runs, no identity, no commit
        s.timings["prestarted"] = 1
        s.timings.update({f"qemu_{k}_ms": round(v, 1) for k, v in s.qemu.timings_ms.items()})

    async def _identify(self, s: _Spawning) -> None:
        """The guest answers on its channel and takes its identity (identify.py)."""
        assert s.qemu is not None and s.src is not None
        t_vmm = time.perf_counter()
        settings = self.d.settings
        s.channel = HarnessChannel(s.qemu.agent_socket, s.req.vm_id, settings.slow_reader_secs)
        await s.channel.connect()
        cold = s.src.method == "cold"
        timeout = COLD_BOOT_TIMEOUT_S if cold else settings.harness_ready_timeout_ms / 1000
        if s.exporting is not None:
            t_export = time.perf_counter()
            s.timings.update(await s.exporting)
            # the export's share of the serial path (0 unless it outlasted the restore)
            s.timings["volumes_export_wait_ms"] = round((time.perf_counter() - t_export) * 1000, 1)
        else:
            await self.d.net.mount_volumes(s.req, s.src.image)  # no volumes: none of any VM's
        who = identity_of(s.req, self.d.net.new_mac())
        s.mac = who.mac
        load = self.d.gate.sampler
        steps = await identify(s.channel, s.qemu, who, timeout, settings.heartbeat_interval_s, load)
        s.timings["identify_ms"] = round((time.perf_counter() - t_vmm) * 1000, 1)
        s.timings.update({f"identify_{k}": v for k, v in steps.items()})

    def _enlist(self, s: _Spawning) -> None:
        """The VM is up: into the registry (a pooled one: into the pool's hands), its state
        file written (adoptable from now, unless pooled)."""
        assert s.qemu is not None and s.channel is not None and s.src is not None
        req = s.req
        lv = LiveVm(
            vm_id=req.vm_id,
            tenant_id=req.tenant_id,
            qemu=s.qemu,
            channel=s.channel,
            image=s.src.image,
            incarnation=req.incarnation,
            token=req.token,
            env=dict(req.env),
            memory_mib=req.memory_mib,
            vcpus=req.vcpus,
            disk_mib=req.disk_mib,
            mem_snapshot_id=s.mem_ref.snapshot_id if s.mem_ref else None,
            mem_ref=s.mem_ref,
            egress=req.egress,
            net_limits=limits_json(req.egress_mbps, req.max_connections),
            mac=s.mac,
            brokered=brokered_of(req),
            wait=req.wait_pause,
            slot=s.slot,
            pooled=s.pooled,
            volumes=list(req.volumes),
        )
        s.lv = lv
        if not s.pooled:
            self.d.registry.vms[req.vm_id] = lv
        self.d.registry.write_state(lv)

    def _result(self, s: _Spawning) -> SpawnResult:
        assert s.qemu is not None and s.src is not None and s.lv is not None
        req, lv = s.req, s.lv
        boot_ms = (time.perf_counter() - s.t0) * 1000
        # Where the time went, step by step (docs/lifecycle.md, "The restore path").
        log.info(
            "VM %s up by %s in %.0f ms (pid %s): %s", req.vm_id, s.src.method, boot_ms, s.qemu.pid, s.timings
        )
        # A restored VM is what its snapshot was, whatever the image is now.
        version = req.restore.agent_version_id if req.restore else s.src.image.agent_version_id
        return spawn_result(
            req,
            s.qemu,
            boot_ms,
            s.src.method,
            version,
            mem_snapshot_id=lv.mem_snapshot_id,
            timings=s.timings,
        )

    async def _rollback(self, s: _Spawning, exc: BaseException) -> None:
        """Undo exactly what the spawn's steps acquired (see ``_Spawning``)."""
        if s.channel is not None:
            await s.channel.close()
        if s.exporting is not None:  # awaited, not cancelled: ganesha may be starting
            await asyncio.gather(s.exporting, return_exceptions=True)
            if not s.registered:  # release (below) unexports a registered VM
                await self.d.net.unexport(s.req.vm_id)
        if s.qemu is not None:
            tail = s.qemu.log_tail()
            await s.qemu.kill()
            if isinstance(exc, PalError) and tail and not isinstance(exc, NotFound):
                log.warning("VM %s failed to start: %s\n%s", s.req.vm_id, exc, tail)
        if s.vnet is not None:
            s.vnet.close_fds()
        if s.registered:
            await self.d.net.release(s.req.vm_id, s.slot)
        elif s.vnet is not None or s.prestarted:
            await asyncio.to_thread(_quiet_delete_netns, self.d.net.ns_name(s.slot))
        with contextlib.suppress(OSError):
            shutil.rmtree(s.vm_dir)
        self.d.jail.release(s.slot)
        self.d.registry.slots.release(s.req.vm_id, s.slot)
        if s.mem_ref is not None:
            await self.d.forks.unmap(s.mem_ref.snapshot_id)


async def _disk_from(src: Path, image: ImagePaths, vm_dir: Path, disk_mib: int) -> tuple[Path, str]:
    """A per-VM writable disk: reflink where possible, qcow2 overlay otherwise."""
    if not src.exists():
        # A legacy snapshot without a captured disk (the spec's behaviour): restore onto
        # the base image, which does not match the snapshot's memory.
        log.warning("snapshot at %s has no rootfs; restoring onto the base image", src.parent)
        src = image.rootfs
    dst = vm_dir / "disk"
    method = await asyncio.to_thread(disks.clone, src, dst, disk_mib * 1024 * 1024)
    return dst, disks.disk_format_for(method)


def _snapshot_shape(snap_dir: Path) -> tuple[dict[str, Any], int]:
    """What decides which QEMU a snapshot loads into: its vmm.json and its disk's size."""
    return read_vmm_meta(snap_dir), (snap_dir / "rootfs").stat().st_size


def _quiet_delete_netns(name: str) -> None:
    from pal.network import netns

    with contextlib.suppress(OSError):
        netns.delete(name)

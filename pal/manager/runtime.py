"""The runtime manager: owns the VMs of one host.

A façade: each operation lives in a module of its own, working against the small
interface its constructor names (docs/internals.md, "The node's request paths"):

| module | what |
|---|---|
| vm.py | the VM registry: live VMs, their state files, the live/running preconditions |
| vm_states.py | the node's states of a VM and the moves allowed between them |
| spawn.py, restore.py, identify.py, fork.py | spawn, its sources, the guest's identity, fork memory |
| stop.py | stop, and freeing what a VM held |
| snapshot.py | snapshot capture and the stored snapshots |
| exec_files.py, guest_ports.py | exec and files through the guest channel; ports |
| live.py, waits.py | live pause, offload and resume; wait management |
| parked.py, templates.py | parked QEMUs; warm templates |
| pool.py, slots.py | the claimable warm pool; host slots (what host resources are named by) |
| prestart.py | QEMUs waiting in `-incoming defer` for a restore to take |
| adopt.py | adoption after a crash or restart |
| egress.py, heartbeat.py, sampling.py | the VM's network; the node's reports; metrics |

It knows VM ids, images and snapshots, never tenants' quotas or lifecycle states: those
are the scheduler's. Every method follows the contract documented in
``pal/manager/api.py``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pal.config import Settings
from pal.manager import models as m
from pal.manager.adopt import AdoptDeps, Adopter
from pal.manager.code import GuestCode
from pal.manager.egress import Egress
from pal.manager.exec_files import GuestCalls
from pal.manager.fork import ForkMemory
from pal.manager.guest_ports import GuestPorts
from pal.manager.heartbeat import NodeIdentity, NodeReports, ReportDeps
from pal.manager.live import LiveControl, PauseDeps
from pal.manager.metrics import MetricsBook
from pal.manager.notices import NoticeBoard
from pal.manager.parked import Parking
from pal.manager.pool import PoolDeps, WarmPool
from pal.manager.ports import GuestConnection, PortRoutes
from pal.manager.prestart import PrestartDeps, PrestartSet
from pal.manager.processes import GuestProcesses
from pal.manager.restore import RestoreDeps, Restores
from pal.manager.restore_gate import RestoreGate
from pal.manager.sampling import Sampler
from pal.manager.snapshot import SnapshotDeps, Snapshots
from pal.manager.spawn import SpawnDeps, Spawner
from pal.manager.stop import Stopper, VmFiles
from pal.manager.templates import TemplateCache
from pal.manager.vm import LiveVm, VmRegistry
from pal.manager.vmnet import VmNetworking
from pal.manager.waits import WaitWatcher
from pal.snapshots.store import SnapshotStore
from pal.spec import ExecRequest
from pal.vmm.accel import AccelInfo
from pal.vmm.jail import Jail


class NodeRuntime:
    def __init__(self, settings: Settings, store: SnapshotStore, accel: AccelInfo) -> None:
        self.settings = settings
        self.store = store
        self.accel = accel
        self.me = NodeIdentity(settings.node_name or os.uname().nodename, uuid.uuid4().hex, accel.name)
        self.node_id, self.epoch = self.me.node_id, self.me.epoch  # epoch: this process's incarnation
        self.templates: TemplateCache | None = None  # set by the server (PAL_TEMPLATES=0: none)
        self.net = VmNetworking(settings)
        self.registry = VmRegistry(settings.vms_dir, self.net.seal_brokered)
        self.jail = Jail()  # each QEMU's uid, and groups for RAM files forks share
        self.metrics = MetricsBook(interval_s=settings.metrics_interval_s)
        self.ports = PortRoutes()
        self.notices_board = NoticeBoard()
        reg, board = self.registry, self.notices_board
        self.forks = ForkMemory(store, self.jail)
        self.files = VmFiles(reg, self.net, self.jail)
        self.parking = Parking(self.files, settings.parked_max, settings.parked_secs)
        pausing = PauseDeps(reg, self.net, board)
        self.live = LiveControl(pausing, lambda lv: self.waits.watch(lv))
        self.waits = WaitWatcher(pausing, self.live.start_prefetch)
        watchers = (self.live.forget, self.metrics.stopped, self.ports.forget, self.waits.forget)
        self.stopper = Stopper(reg, self.files, self.parking, self.forks, watchers)
        gate = self.restore_gate = RestoreGate(settings.fork_concurrency)
        restores = Restores(
            RestoreDeps(settings, store, self.net, reg, lambda: self.templates, self, gate.sampler)
        )
        net, jail = self.net, self.jail
        self.spawner = Spawner(
            SpawnDeps(settings, accel.name, reg, net, jail, self.forks, self.parking, restores, gate)
        )
        self.pool = WarmPool(
            PoolDeps(
                settings,
                reg,
                self.net,
                self.spawner.spawn_pooled,
                self.files.free_vm_files,
                lambda: self.templates,
                self,
            )
        )
        self.spawner.claim, self.spawner.evict_pool = self.pool.claim, self.pool.evict
        self.prestart = PrestartSet(
            PrestartDeps(settings, accel.name, reg, net, jail, gate, self.files.free_vm_files)
        )
        self.spawner.prestart = self.prestart
        self.snapshots = Snapshots(
            SnapshotDeps(reg, store, self.net, self.parking, self.live, self.stopper, accel.name)
        )
        self.guest = GuestCalls(reg)
        self.processes = GuestProcesses(reg)  # the RPC calls it directly (rpc_processes.py)
        self.code = GuestCode(reg)  # code contexts, the same way (rpc_code.py)
        self.guest_ports = GuestPorts(reg, self.ports, self.net, board)
        self.egress = Egress(reg, self.net, board)
        self.adopter = Adopter(
            AdoptDeps(settings, accel.name, reg, self.jail, self.net, self.forks, gate.sampler)
        )
        self.reports = NodeReports(
            ReportDeps(self.me, settings, store, reg, lambda: self.templates, self, gate.sampler)
        )
        self.sampler = Sampler(
            reg, self.metrics, settings.heartbeat_interval_s, self.net.cached_bytes, self.net.refresh_counters
        )

    # ------------------------------------------------------------------ the node
    @property
    def vms(self) -> dict[str, LiveVm]:
        return self.registry.vms

    @property
    def url(self) -> str:
        return self.me.url

    @url.setter
    def url(self, value: str) -> None:
        self.me.url = value  # where the control plane reaches this node (set by `pal node`)

    async def adopt_all(self) -> tuple[list[str], list[str]]:
        return await self.adopter.adopt_all()

    async def start_network(self) -> None:
        """Start (or adopt) the egress gateway and watch its events; before adopt_all."""
        await self.egress.start(self.waits)

    async def settle_network(self) -> None:
        await self.egress.settle(self.parking.vms, self.live, self.waits)

    async def heartbeat(self) -> m.NodeHeartbeat:
        return await self.reports.heartbeat()

    async def stats(self) -> m.NodeStats:
        pool, pre = self.pool.status(), self.prestart.status()
        return (await self.reports.stats()).model_copy(
            update={
                "pool_ready": sum(r["ready"] for r in pool["sizes"].values()),
                "pool_target": sum(r["target"] for r in pool["sizes"].values()),
                "pool_rss_bytes": pool["rssBytes"],
                "pool_claims": pool["claims"],
                "pool_misses": pool["misses"],
                "prestart_ready": sum(r["ready"] for r in pre["sizes"].values()),
                "prestart_target": sum(r["target"] for r in pre["sizes"].values()),
                "prestart_rss_bytes": pre["rssBytes"],
                "prestart_takes": pre["takes"],
                "prestart_misses": pre["misses"],
            }
        )

    def start_pool(self) -> None:
        """Fill the warm pool and start the pre-started QEMUs in the background (after
        adoption: PAL_POOL, PAL_PRESTART)."""
        self.pool.start()
        self.prestart.start()

    async def images(self) -> list[m.ImageInfo]:
        return await self.reports.images()

    async def warm(self, req: m.WarmRequest) -> m.WarmResult:
        return await self.reports.warm(req)

    async def notices(self, after: int, epoch: str, wait_s: float) -> m.Notices:
        return await self.notices_board.wait(after, epoch, wait_s)

    async def run_sampler(self) -> None:
        await self.sampler.run()

    def vm_metrics(self, vm_id: str) -> m.VmMetrics:
        return self.sampler.vm_metrics(vm_id)

    # ------------------------------------------------------------------ a VM's life
    async def spawn(self, req: m.SpawnRequest) -> m.SpawnResult:
        return await self.spawner.spawn(req)

    def runs_other_incarnation(self, vm_id: str, incarnation: int) -> bool:
        return self.stopper.runs_other_incarnation(vm_id, incarnation)

    async def stop(self, vm_id: str) -> dict[str, Any] | None:
        return await self.stopper.stop(vm_id)

    async def free_vm_files(self, vm_id: str) -> dict[str, Any] | None:
        return await self.files.free_vm_files(vm_id)

    async def stop_all(self) -> None:
        await self.pool.close()
        await self.prestart.close()
        await self.stopper.stop_all()

    async def snapshot(self, vm_id: str, req: m.SnapshotRequest) -> m.SnapshotResult:
        return await self.snapshots.snapshot(vm_id, req)

    async def live_pause(self, vm_id: str, req: m.LivePauseRequest) -> m.LivePauseResult:
        return await self.live.pause(vm_id, req)

    async def live_resume(self, vm_id: str) -> m.LiveResumeResult:
        return await self.live.resume(vm_id)

    async def live_status(self, vm_id: str) -> m.LiveState | None:
        return await self.live.status(vm_id)

    # ------------------------------------------------------------------ snapshots kept
    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> m.SnapshotStatus:
        return await self.snapshots.status(agent_version_id, vm_id, snapshot_id)

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await self.snapshots.ensure_uploaded(agent_version_id, vm_id, snapshot_id)

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await self.snapshots.delete(agent_version_id, vm_id, snapshot_id)

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[m.SnapshotInfo]:
        return await self.snapshots.list_vm(agent_version_id, vm_id)

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        return await self.snapshots.delete_vm(agent_version_id, vm_id, keep)

    async def snapshot_owners(self) -> m.SnapshotOwners:
        return await self.snapshots.owners()

    # ------------------------------------------------------------------ in the guest
    def require_running(self, vm_id: str) -> None:
        """409 (or 409 LIVE_PAUSED) unless the VM's guest runs here: the RPC's exec checks
        it before its stream starts, so the refusal has its status."""
        self.registry.running(vm_id)

    def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[m.ExecEvent]:
        return self.guest.exec_stream(vm_id, req)

    async def list_files(self, vm_id: str, path: str) -> m.FileList:
        return await self.guest.list_files(vm_id, path)

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        return await self.guest.read_file(vm_id, path)

    async def write_file(self, vm_id: str, path: str, data: bytes) -> m.FileWritten:
        return await self.guest.write_file(vm_id, path, data)

    async def delete_file(self, vm_id: str, path: str) -> m.FileDeleted:
        return await self.guest.delete_file(vm_id, path)

    async def open_port(self, vm_id: str, port: int) -> GuestConnection:
        return await self.guest_ports.open_port(vm_id, port)

    def port_traffic(self, vm_id: str) -> None:
        self.guest_ports.port_traffic(vm_id)

    # ------------------------------------------------------------------ egress
    async def set_egress(self, vm_id: str, req: m.EgressSet) -> m.EgressSetResult:
        return await self.egress.set_egress(vm_id, req)

    async def set_brokered(self, vm_id: str, req: m.BrokeredSet) -> None:
        await self.egress.set_brokered(vm_id, req)

    async def egress_counters(self, vm_id: str) -> dict[str, int] | None:
        return await self.egress.counters(vm_id)

    async def egress_events(self, after: int, epoch: str) -> m.EgressEvents:
        return await self.egress.events(after, epoch)
